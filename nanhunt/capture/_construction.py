"""How a capture's model was built: its constructor's arguments (field ``model_init``), and rebuilding them.

Capturing (:func:`how_built`), for a model of your own class with no ``model_factory`` or ``model_kwargs`` given:

- under ``nanhunt run``, the arguments each module of a class outside torch was called with are recorded when it
  is built (:class:`ConstructionLog`: ``nn.Module.__init__`` wrapped for the run; the arguments read from the
  outermost ``__init__`` of the instance as it calls ``super().__init__()``, turned into plain data at once, so
  that no tensor or object is kept);
- else, or when that record does not rebuild the model, read back from the model: each constructor parameter
  from the attribute of the same name (``GPT(config)`` keeps ``self.config``), a parameter with a default and no
  such attribute left to its default;
- either is kept only once the class, built again with it on the meta device (nothing allocated, its prints
  and random draws undone), gives the model's parameters, buffers and layers: else :attr:`Construction.problem`
  says what to pass, and the Guard says it when it is made (``nanhunt run``: with the capture's command).

Values are recorded as plain data (:mod:`._plain_args`). Replaying (:func:`arguments`), the record is used only
with a model you confirmed (``--model``, naming the capture's model) or a package you trust, and a config
class is built only when it is defined in that same module (or is a transformers config class); its fields are
checked against those the class declares, and the model is built on the meta device first and checked against
the capture's weights, as a model the file chose is (``_build._check_on_meta``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import sys
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError, first_line
from .._util._wrappers import user_class
from . import _names
from ._hf import _hf_model_spec
from ._nn_model import built_on_meta
from ._nn_structure import matches
from ._plain_args import Classes, Unrecordable, decode, encode
from ._statedict import map_state_dict

__all__ = ["Construction", "ConstructionLog", "how_built", "arguments"]

_ACTIVE: ConstructionLog | None = None  # the log of the run (nanhunt run), while it is installed
_FIX = ("pass nanhunt.Guard model_factory='package.module:fn' (a function that builds the model) or "
        "model_kwargs={...}, or replay with --model naming such a function")


@dataclasses.dataclass(frozen=True)
class Construction:
    """What a capture records of how its model was built: ``record`` (the field ``model_init``: ``args``,
    ``kwargs``, ``how``), None when the class needs nothing or your factory builds it; ``problem``: why the
    replay would not rebuild the model (None: it would)."""

    record: dict[str, Any] | None = None
    problem: str | None = None


class ConstructionLog:
    """The constructor arguments of the modules built while it is installed (``nanhunt run``), as plain data
    (or why they are not plain), by module; a module's entry goes with it."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref[nn.Module], tuple[list[Any], dict[str, Any]] | str]] = {}
        self.paused = False

    def install(self, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> ConstructionLog:
        """Wrap ``nn.Module.__init__`` through ``patch`` (whose owner takes it out again) and start recording."""
        global _ACTIVE
        patch(nn.Module, "__init__", self._wrap)
        _ACTIVE = self
        return self

    def close(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._seen.clear()

    def record_of(self, module: nn.Module) -> tuple[list[Any], dict[str, Any]] | str | None:
        got = self._seen.get(id(module))
        return got[1] if got is not None and got[0]() is module else None

    def _wrap(self, init: Callable[..., None]) -> Callable[..., None]:
        log = self

        @functools.wraps(init)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            init(module, *args, **kwargs)
            if _ACTIVE is log and not log.paused:
                try:
                    log._note(module, args, kwargs, sys._getframe(1))
                except Exception:  # nanhunt's own failure never breaks the script: this module goes unrecorded
                    pass

        return __init__

    def _note(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              caller: types.FrameType | None) -> None:
        if (type(module).__module__ or "").partition(".")[0] == "torch":
            return  # torch.nn's own layers are described by their attributes (_nn_structure)
        outer = None
        frame = caller
        while frame is not None and frame.f_code.co_name == "__init__" and frame.f_code.co_argcount:
            if frame.f_locals.get(frame.f_code.co_varnames[0]) is not module:
                break
            outer, frame = frame, frame.f_back
        given: tuple[list[Any], dict[str, Any]] = (list(args), dict(kwargs)) if outer is None else _called(outer)
        try:
            entry: tuple[list[Any], dict[str, Any]] | str = _encoded(*given)
        except Unrecordable as e:
            entry = str(e)
        key = id(module)
        seen = self._seen
        seen[key] = (weakref.ref(module, lambda _, k=key: seen.pop(k, None)), entry)  # type: ignore[misc]


def _called(frame: types.FrameType) -> tuple[list[Any], dict[str, Any]]:
    """The arguments an ``__init__`` frame was called with, as its parameters hold them (by name, unless it takes
    positional-only parameters or ``*args``)."""
    code, local = frame.f_code, frame.f_locals
    n, k, names = code.co_argcount, code.co_kwonlyargcount, code.co_varnames
    star = bool(code.co_flags & inspect.CO_VARARGS)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if star or code.co_posonlyargcount > 1:
        args = [local[name] for name in names[1:n]] + (list(local[names[n + k]]) if star else [])
    else:
        kwargs = {name: local[name] for name in names[1:n]}
    kwargs.update({name: local[name] for name in names[n:n + k]})
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[n + k + star]])
    return args, kwargs


def _encoded(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    count = [0]
    return ([encode(v, f"argument {i}", count) for i, v in enumerate(args)],
            {name: encode(v, f"argument {name!r}", count) for name, v in kwargs.items()})


# ------------------------------------------------------------------------------------------- capturing
def how_built(module: nn.Module, model_factory: str | None, model_kwargs: Mapping[str, Any] | None) -> Construction:
    """How the replay rebuilds ``module`` (the module docstring): recorded and checked, or the problem."""
    cls = user_class(module)
    own = _names.capture_name(cls)
    if own is None or model_kwargs or (model_factory is not None and model_factory != own):
        return Construction()  # your factory or your arguments build it
    if own.partition(".")[0] == "torch" or _hf_model_spec(module) is not None:
        return Construction()  # torch.nn's own (_nn_model) or a transformers model (its config)
    tried: list[str] = []
    candidates: list[tuple[str, tuple[list[Any], dict[str, Any]]]] = []
    logged = _ACTIVE.record_of(module) if _ACTIVE is not None else None
    if isinstance(logged, tuple):
        candidates.append(("recorded when it was built", logged))
    elif isinstance(logged, str):
        tried.append(f"the arguments it was built with are not plain values ({logged})")
    back = _read_back(module, cls)
    if isinstance(back, str):
        tried.append(back)
    elif not candidates or back != candidates[0][1]:
        candidates.append(("read back from the model's attributes", back))
    for how, (args, kwargs) in candidates:
        same, why = _verify(module, cls, args, kwargs)
        if same or (same is None and how.startswith("recorded")):  # exact, though the meta device cannot build it
            return Construction({"args": args, "kwargs": kwargs, "how": how} if args or kwargs else None)
        tried.append(why)
    reason = tried[0] if tried else "it takes arguments nanhunt cannot read"
    return Construction(None, f"the printed replay command cannot rebuild {cls.__name__}: {reason}; {_FIX}")


def _read_back(module: nn.Module, cls: type) -> tuple[list[Any], dict[str, Any]] | str:
    """Each constructor parameter of ``cls`` from ``module``'s attribute of the same name, as plain data; one
    with a default and no plain attribute keeps its default. A string: why it cannot be read back."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return f"{cls.__name__}'s constructor has no signature to read its arguments from"
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    count = [0]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        try:
            value = encode(getattr(module, p.name), f"its argument {p.name!r}", count)
        except Unrecordable as e:
            if p.default is p.empty:
                return f"{e} (read back from the model's attribute {p.name!r})"
            continue
        except Exception:  # no such attribute (or a property that raised)
            if p.default is p.empty:
                return f"its argument {p.name!r} is kept by no attribute of the model"
            continue
        if p.kind is p.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[p.name] = value
    return args, kwargs


def _verify(module: nn.Module, cls: type, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool | None, str]:
    """Whether ``cls`` built on the meta device with the recorded arguments is ``module`` (same parameters,
    buffers and layers): True; False, and why not; None when it cannot be built there (said why)."""
    try:
        classes = Classes(_live_dataclass, "the model")
        a = [decode(v, classes, f"argument {i}") for i, v in enumerate(args)]
        k = {name: decode(v, classes, f"argument {name!r}") for name, v in kwargs.items()}
    except InputError as e:
        return False, first_line(e)
    log = _ACTIVE
    if log is not None:
        log.paused = True  # the probe's modules are not the script's
    try:
        probe = built_on_meta(lambda: cls(*a, **k))
    except Exception as e:
        return None, f"{cls.__name__} cannot be built on the meta device to check its arguments ({first_line(e)})"
    finally:
        if log is not None:
            log.paused = False
    if not isinstance(probe, nn.Module) or not matches(probe, module):
        return False, (f"{cls.__name__} built again with the arguments it can be given differs from the model (its "
                       "parameters, buffers or layers: changed after it was built?)")
    return True, ""


def _live_dataclass(name: str) -> type:
    """The dataclass a recorded name stands for in this process, among the modules loaded (nothing imported)."""
    where, _, qual = name.rpartition(":")
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    script = _names.is_script(name) and isinstance(file, str) and os.path.abspath(file) == where
    home = main if script else sys.modules.get(where)
    obj: Any = home
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise InputError(f"the config class {name!r} cannot be found again by its name")
    return obj


# ------------------------------------------------------------------------------------------- replaying
# a config's layer counts (n_layer, depth, num_layers): each layer is built, each holds one of the weights at least
_LAYER_COUNT = re.compile(r"depth|n_layers?|\w*_layers")
_UNSAVED = 1 << 24  # values a model may hold beyond its weights file (non-persistent buffers: masks, frequencies)


def arguments(init: Any, factory: Any, recorded: Any, where: str,
              sd: Mapping[str, Any] | None) -> tuple[list[Any], dict[str, Any]]:
    """The positional and keyword arguments a capture's ``model_init`` gives ``factory`` (the model you confirmed,
    the capture's ``recorded`` factory): decoded under the rules of the module docstring, and with ``sd`` (the
    capture's weights) the model built on the meta device and checked against them first."""
    if not (isinstance(init, Mapping) and isinstance(init.get("args", []), list)
            and isinstance(init.get("kwargs", {}), Mapping)
            and all(type(k) is str and k.isidentifier() for k in init.get("kwargs", {}))):
        raise InputError(f"{where} is not a valid nanhunt capture: field 'model_init' holds no constructor "
                         "arguments; save the capture again")
    if sd is not None:
        _layers_fit(init, sd, where)
    classes = Classes(functools.partial(_confirmed_dataclass, factory=factory, recorded=recorded, where=where),
                      where)
    args = [decode(v, classes, f"argument {i}") for i, v in enumerate(init.get("args", []))]
    kwargs = {k: decode(v, classes, f"argument {k!r}") for k, v in init.get("kwargs", {}).items()}
    if sd is not None:
        _fits(factory, args, kwargs, sd, where)
    return args, kwargs


def _confirmed_dataclass(name: str, *, factory: Any, recorded: Any, where: str) -> type:
    """The config class ``name`` from the module of the model you confirmed, where it must be defined; any
    other is refused (the file chose it)."""
    module, _, qual = name.rpartition(":")
    home_name = recorded.rpartition(":")[0] if isinstance(recorded, str) else None
    home = sys.modules.get(getattr(factory, "__module__", None) or "")
    refuse = (f"{where}: the model's config class {name!r} is not defined in {home_name!r}, the module of the model "
              "you confirmed: nanhunt builds a config class only from that module; write a function that builds "
              "the model and pass it as --model")
    if module != home_name or home is None or not all(p.isidentifier() and not p.startswith("__")
                                                      for p in qual.split(".")):
        raise InputError(refuse)
    obj: Any = home
    for part in qual.split("."):
        obj = obj.__dict__.get(part) if isinstance(obj, (type, types.ModuleType)) else None
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == home.__name__
            and obj.__qualname__ == qual):
        raise InputError(refuse)
    return obj


def _layers_fit(init: Any, sd: Mapping[str, Any], where: str, depth: int = 0) -> None:
    """No recorded layer count (``n_layer``, ``depth``) over the number of tensors the weights hold: checked on
    the plain data, before any class is built (each layer takes the meta device time to build)."""
    if depth > 32:
        return  # the decoding refuses it
    items = init.items() if isinstance(init, Mapping) else enumerate(init) if isinstance(init, list) else ()
    tensors = sum(isinstance(t, torch.Tensor) for t in sd.values())
    for k, v in items:
        if isinstance(k, str) and _LAYER_COUNT.fullmatch(k) and type(v) is int and v > tensors:
            raise InputError(f"{where}: field 'model_init' names {v:,} layers ({k}), more than the {tensors:,} "
                             "tensors its weights hold; the file may be hostile")
        _layers_fit(v, sd, where, depth + 1)


def _fits(factory: Any, args: list[Any], kwargs: dict[str, Any], sd: Mapping[str, Any], where: str) -> None:
    """``factory(*args, **kwargs)`` built on the meta device holds the capture's weights: every name and shape,
    and not far more values than they hold."""
    try:
        probe = built_on_meta(lambda: factory(*args, **kwargs), quiet=False)
    except Exception as e:
        raise InputError(f"{where}: the model built on the meta device with the capture's arguments raised "
                         f"{first_line(e)}; write a function that builds the model and pass it as --model") from None
    if not isinstance(probe, nn.Module):
        raise InputError(f"{where}: the model factory returned a {type(probe).__name__}, not an nn.Module")
    map_state_dict(sd, probe)  # every key and shape, one error line
    held = sum(t.numel() for t in {id(t): t for t in [*probe.parameters(), *probe.buffers()]}.values())
    given = sum(t.numel() for t in sd.values() if isinstance(t, torch.Tensor))
    if held > given + _UNSAVED:
        raise InputError(f"{where}: the model built with the capture's arguments holds {held:,} values, far more "
                         f"than its weights' {given:,}; the file may be hostile")


def loss_at_of(ck: Mapping[str, Any], where: str) -> tuple[int | str, ...] | None:
    """The capture's ``loss_at`` (where the model's output holds its loss), checked: one index or key."""
    at = ck.get("loss_at")
    if at is None:
        return None
    if not (isinstance(at, list) and len(at) == 1 and all(
            type(k) is int and 0 <= k < 1 << 16 or type(k) is str and 0 < len(k) <= 256 for k in at)):
        raise InputError(f"{where} is not a valid nanhunt capture: field 'loss_at' is not one index or key of the "
                         "model's output; save the capture again, or pass --loss package.module:fn")
    return tuple(at)
