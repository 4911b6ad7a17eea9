"""A model made only of torch.nn's own classes (``nn.Sequential(nn.Linear(4, 8), nn.ReLU(), ...)``), described by
its structure: each container's children by name, each layer's class and constructor arguments, read back from
the attributes torch.nn's layers keep under the arguments' names. Its class alone cannot rebuild it (an empty
``Sequential``), so a capture holds this description (``nn_model``) and the replay builds the model from it.

Capturing, the description is rebuilt on the meta device and must give the live model's parameters, buffers,
classes and every layer's ``extra_repr`` exactly, or there is none and the caller asks for a factory. Replaying, it
comes from a file: every class must be torch.nn's own, every argument a plain value, and its size is bounded."""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._names import capture_name
from .._util._errors import first_line as _first_line
from ._lowp import built_class, built_repr

__all__ = ["structure", "build", "matches"]

_CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_MAX_DEPTH = 32  # containers inside containers
_MAX_MODULES = 4096
_MAX_ITEMS = 16  # in one argument's list (a kernel size, a normalized shape)
# Arguments no attribute keeps the value of; a layer's own tensors come from the capture's weights.
_SKIPPED = ("device", "dtype")


def structure(model: nn.Module, class_of: Callable[[str], type[nn.Module]]) -> dict[str, Any]:
    """``model``'s description; ``class_of`` resolves a class's name as the replay will. ValueError (why, in
    words) when ``model`` holds anything else than torch.nn's classes, or their rebuild differs from it."""
    count = [0]
    spec = _describe(model, "the model", 0, count)
    with torch.device("meta"):
        probe = build(spec, class_of)
    if not matches(probe, model):
        raise ValueError(f"its layers rebuilt from their arguments differ from it ({type(model).__name__})")
    return spec


def matches(probe: nn.Module, model: nn.Module) -> bool:
    """``probe`` (built on the meta device) is ``model`` rebuilt: the same parameters and buffers by name and
    shape, the same modules by name, class and arguments."""
    return _layout(probe) == _layout(model) and _layers(probe) == _layers(model)


def _layers(m: nn.Module) -> list[tuple[str, type, str]]:
    """Every module's name, class (the one you wrote: not FSDP2's; a float8 layer's ``nn.Linear``, which the
    replay converts again) and ``extra_repr`` (its arguments)."""
    return [(k, built_class(x), built_repr(x)) for k, x in m.named_modules()]


def _layout(m: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter and buffer (persistent or not) by name, with its shape."""
    return [(k, tuple(t.shape)) for k, t in [*m.named_parameters(), *m.named_buffers()]]


def _describe(m: nn.Module, where: str, depth: int, count: list[int]) -> dict[str, Any]:
    count[0] += 1
    if depth > _MAX_DEPTH or count[0] > _MAX_MODULES:
        raise ValueError(f"it nests more than {_MAX_DEPTH} containers or holds more than {_MAX_MODULES} modules")
    name = capture_name(built_class(m))  # under FSDP2, not the class fully_shard made
    module = (name or "").partition(":")[0]
    if name is None or not (module == "torch.nn" or module.startswith("torch.nn.modules.")):
        raise ValueError(f"{where} ({built_class(m).__name__}) is not one of torch.nn's classes")
    if built_class(m) in _CONTAINERS:
        return {"class": name, "children": [[k, _describe(c, f"layer {k!r}", depth + 1, count)]
                                            for k, c in m.named_children()]}
    return {"class": name, "args": _arguments(m, where)}


def _arguments(m: nn.Module, where: str) -> dict[str, Any]:
    """The constructor's arguments, each read from the attribute of its name (``bias``: whether the layer has
    one). An argument no attribute keeps cannot be known: no description."""
    args: dict[str, Any] = {}
    params = inspect.signature(built_class(m)).parameters.values()  # the constructor's, self left out
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in _SKIPPED or p.name.startswith("_"):
            continue
        if not hasattr(m, p.name):
            raise ValueError(f"{where} ({built_class(m).__name__}) keeps no attribute for its argument {p.name!r}")
        value = getattr(m, p.name)
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None  # bias=True made a bias parameter
        try:
            args[p.name] = _plain(value)
        except ValueError as e:
            raise ValueError(f"{where} ({built_class(m).__name__}) has argument {p.name!r} = {e}") from None
    return args


def _plain(value: Any, depth: int = 0, *, sequence: Callable[[list[Any]], Any] = list) -> Any:
    """``value`` if a plain value (JSON's types, a sequence at most two deep and ``_MAX_ITEMS`` long; a float
    finite), its sequences made by ``sequence``: a list as the capture stores it, a tuple as a constructor takes
    it; ValueError for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= _MAX_ITEMS:
        return sequence([_plain(v, depth + 1, sequence=sequence) for v in value])
    raise ValueError(f"a {type(value).__name__}, not a plain value")


def build(spec: Any, class_of: Callable[[str], type[nn.Module]]) -> nn.Module:
    """The model ``spec`` describes (under ``torch.device("meta")``: on the meta device). ValueError (why, in
    words) for a description that is not one: the caller names the file."""
    return _build(spec, class_of, 0, [0])


def _build(spec: Any, class_of: Callable[[str], type[nn.Module]], depth: int, count: list[int]) -> nn.Module:
    count[0] += 1
    if depth > _MAX_DEPTH or count[0] > _MAX_MODULES:
        raise ValueError(f"nests more than {_MAX_DEPTH} containers or holds more than {_MAX_MODULES} modules")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("class"), str) or set(spec) not in (
            {"class", "children"}, {"class", "args"}):
        raise ValueError("holds an entry that is not {'class': ..., 'children' or 'args': ...}")
    cls = class_of(spec["class"])
    if "children" in spec:
        if cls not in _CONTAINERS:
            raise ValueError(f"gives children to {spec['class']!r}, which is not Sequential, ModuleList or ModuleDict")
        pairs = spec["children"]
        if not isinstance(pairs, list) or len(pairs) > _MAX_MODULES or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise ValueError("holds children that are not a list of [name, layer] pairs")
        names = [p[0] for p in pairs]
        if len(set(names)) != len(names):
            raise ValueError("names two children alike")
        children = [(k, _build(c, class_of, depth + 1, count)) for k, c in pairs]
        try:
            if cls is nn.ModuleList:
                if names != [str(i) for i in range(len(names))]:
                    raise ValueError("names a ModuleList's children other than 0, 1, ...")
                return nn.ModuleList([c for _, c in children])
            if cls is nn.ModuleDict:
                return nn.ModuleDict(OrderedDict(children))
            return nn.Sequential(OrderedDict(children))
        except (KeyError, TypeError) as e:  # a name torch refuses ("a.b", "")
            raise ValueError(f"names a child badly: {e}") from None
    if cls in _CONTAINERS:
        raise ValueError(f"gives arguments to {spec['class']!r}, a container")
    args = spec["args"]
    if not isinstance(args, Mapping) or not all(isinstance(k, str) and k.isidentifier() and k not in _SKIPPED
                                                for k in args):
        raise ValueError(f"gives {spec['class']!r} arguments that are not a dict of names")
    try:
        kwargs = {k: _plain(v, sequence=tuple) for k, v in args.items()}  # a list as a tuple
    except ValueError as e:
        raise ValueError(f"gives {spec['class']!r} an argument that is {e}") from None
    try:
        return cls(**kwargs)
    except Exception as e:
        raise ValueError(f"builds {spec['class']!r}, which raised {_first_line(e)}") from None
