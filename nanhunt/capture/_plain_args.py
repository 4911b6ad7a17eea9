"""A model's constructor arguments as plain data, and back.

A capture records how its model was built (``model_init``, :mod:`._construction`) as values a weights-only load
and a JSON manifest both hold: ``None``, booleans, numbers, strings and lists as they are; every other value a
one-key tagged dict, so that nothing in the file is ambiguous:

- ``{"tuple": [...]}``, ``{"dict": {...}}`` (string keys), ``{"dtype": "float32"}``;
- a dataclass instance (a model config): ``{"dataclass": "module:Qualname", "fields": {...}}``, its ``init``
  fields only;
- ``argparse.Namespace`` / ``types.SimpleNamespace``: ``{"namespace": "argparse:Namespace", "attrs": {...}}``;
- a transformers config: ``{"hf_config": "transformers...:GPT2Config", "json": "..."}``.

Anything else (a tensor, a module, a function, an object of another class) is not recorded: the capture says
the model cannot be rebuilt from it. Reading it back (:func:`decode`) builds a class only where its caller allows
(:class:`Classes`): the file's names are suggestions, constructors are code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._util._errors import InputError, first_line
from .._util._text import dtype_name
from ._names import capture_name, is_session

__all__ = ["Unrecordable", "encode", "decode", "Classes"]

_MAX_DEPTH = 16  # containers inside containers
_MAX_ITEMS = 10_000  # values in one constructor's arguments, all together
_MAX_TEXT = 1 << 20  # characters in one string
_NAMESPACES: dict[str, type] = {"argparse:Namespace": argparse.Namespace,
                                "types:SimpleNamespace": types.SimpleNamespace}


class Unrecordable(ValueError):
    """A constructor argument that is no plain value (its message: which, and what it is)."""


def encode(value: Any, where: str, count: list[int] | None = None, depth: int = 0) -> Any:
    """``value`` as plain data (module docstring); :class:`Unrecordable` naming ``where`` otherwise."""
    count = [0] if count is None else count
    count[0] += 1
    if depth > _MAX_DEPTH or count[0] > _MAX_ITEMS:
        raise Unrecordable(f"{where} nests deeper than {_MAX_DEPTH} levels or holds over {_MAX_ITEMS} values")
    kind = type(value)
    if value is None or kind in (bool, int, float):
        return value
    if kind is str:
        if len(value) > _MAX_TEXT:
            raise Unrecordable(f"{where} is a string of {len(value)} characters")
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if kind is list:
        return [encode(v, f"{where}[{i}]", count, depth + 1) for i, v in enumerate(value)]
    if kind is tuple:
        return {"tuple": [encode(v, f"{where}[{i}]", count, depth + 1) for i, v in enumerate(value)]}
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise Unrecordable(f"{where} is a dict whose keys are not all strings")
        return {"dict": {k: encode(v, f"{where}[{k!r}]", count, depth + 1) for k, v in value.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = capture_name(kind)
        if name is None or is_session(name):
            raise Unrecordable(f"{where} is a {kind.__name__} defined where it cannot be imported from (a notebook?)")
        return {"dataclass": name, "fields": {f.name: encode(getattr(value, f.name), f"{where}.{f.name}", count,
                                                             depth + 1)
                                              for f in dataclasses.fields(value) if f.init}}
    spaced = next((n for n, c in _NAMESPACES.items() if kind is c), None)
    if spaced is not None:
        return {"namespace": spaced, "attrs": {k: encode(v, f"{where}.{k}", count, depth + 1)
                                               for k, v in vars(value).items()}}
    hf = _hf_config(value)
    if hf is not None:
        return hf
    what = ("a Tensor (a capture holds tensors as weights only)" if isinstance(value, torch.Tensor) else
            f"a {kind.__name__}" + (", a function" if callable(value) and not isinstance(value, type) else ""))
    raise Unrecordable(f"{where} is {what}, not a plain value")


def _hf_config(value: Any) -> dict[str, Any] | None:
    """A transformers config, by its class and its JSON; None for anything else."""
    module = getattr(type(value), "__module__", "") or ""
    if module.partition(".")[0] != "transformers" or not hasattr(value, "to_dict"):
        return None
    base = _hf_base()
    if base is None or not isinstance(value, base):
        return None
    try:
        text = json.dumps(getattr(value, "to_dict")())
    except (TypeError, ValueError) as e:
        raise Unrecordable(f"a {type(value).__name__} whose values JSON cannot hold ({first_line(e)})") from None
    return {"hf_config": f"{module}:{type(value).__qualname__}", "json": text}


def _hf_base() -> type | None:
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    base = getattr(transformers, "PreTrainedConfig", None) or getattr(transformers, "PretrainedConfig", None)
    return base if isinstance(base, type) else None


@dataclasses.dataclass(frozen=True)
class Classes:
    """The classes a recorded value may be rebuilt with: ``dataclass(name)`` gives the dataclass a recorded
    name stands for, or raises :class:`InputError` saying why it is refused (the caller's rule)."""

    dataclass: Callable[[str], type]
    where: str


def decode(value: Any, classes: Classes, at: str = "", depth: int = 0) -> Any:
    """The value :func:`encode` recorded as ``value`` (read from a file: every tag and type checked, one
    :class:`InputError` line naming where it is wrong)."""
    here = at or "the value"
    if depth > _MAX_DEPTH:
        raise _bad(classes, here, f"nests deeper than {_MAX_DEPTH} levels")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [decode(v, classes, f"{at}[{i}]", depth + 1) for i, v in enumerate(value)]
    if not isinstance(value, Mapping) or not value:
        raise _bad(classes, here, f"is a {type(value).__name__}, not a value nanhunt records")
    tag = next(iter(value))
    body = value[tag]
    if tag == "tuple" and len(value) == 1 and type(body) is list:
        return tuple(decode(v, classes, f"{at}[{i}]", depth + 1) for i, v in enumerate(body))
    if tag == "dict" and len(value) == 1 and isinstance(body, Mapping) and all(type(k) is str for k in body):
        return {k: decode(v, classes, f"{at}[{k!r}]", depth + 1) for k, v in body.items()}
    if tag == "dtype" and len(value) == 1 and type(body) is str:
        dt = getattr(torch, body, None) if body.isidentifier() else None
        if not isinstance(dt, torch.dtype):
            raise _bad(classes, here, f"names {body!r}, which is not a torch dtype")
        return dt
    if tag == "dataclass" and set(value) == {"dataclass", "fields"} and type(body) is str:
        return _dataclass(classes.dataclass(body), value["fields"], classes, here, depth)
    if tag == "namespace" and set(value) == {"namespace", "attrs"} and body in _NAMESPACES:
        attrs = value["attrs"]
        if not (isinstance(attrs, Mapping) and all(type(k) is str and k.isidentifier() for k in attrs)):
            raise _bad(classes, here, "holds a namespace whose attributes are not names")
        return _NAMESPACES[body](**{k: decode(v, classes, f"{at}.{k}", depth + 1) for k, v in attrs.items()})
    if tag == "hf_config" and set(value) == {"hf_config", "json"} and type(body) is str:
        return _hf_decoded(body, value["json"], classes, here)
    raise _bad(classes, here, f"holds {{{tag!r}: ...}}, not a value nanhunt records")


def _dataclass(cls: type, fields: Any, classes: Classes, here: str, depth: int) -> Any:
    """``cls(**fields)``, each field one ``cls`` declares for its constructor; a field it lacks is refused."""
    declared = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if not (isinstance(fields, Mapping) and all(type(k) is str for k in fields)):
        raise _bad(classes, here, f"holds a {cls.__name__} whose fields are not named")
    unknown = [k for k in fields if k not in declared]
    if unknown:
        raise _bad(classes, here, f"gives {cls.__name__} a field it does not declare ({unknown[0]!r})")
    missing = [n for n, f in declared.items() if n not in fields and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise _bad(classes, here, f"gives {cls.__name__} no {missing[0]!r}, which it requires")
    values = {k: decode(v, classes, f"{here}.{k}", depth + 1) for k, v in fields.items()}
    try:
        return cls(**values)
    except Exception as e:
        raise InputError(f"{classes.where}: building {cls.__name__} from the capture's fields raised "
                         f"{first_line(e)}") from None


def _hf_decoded(path: str, text: Any, classes: Classes, here: str) -> Any:
    """A transformers config class (exported by the package, defined in it) built from its JSON, which may ask
    to fetch nothing (as a transformers model in a capture is built: ``_hf``)."""
    import sys

    from ._hf import _fetching, _transformers_class

    transformers, base = sys.modules.get("transformers"), _hf_base()
    qual = path.rpartition(":")[2]
    cls = getattr(transformers, qual, None) if transformers is not None and qual.isidentifier() else None
    if base is None or not _transformers_class(cls, base) or callable_name(cls) != path:
        raise _bad(classes, here, f"names {path!r}, which is not a transformers config class")
    try:
        config = json.loads(text) if type(text) is str else None
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise _bad(classes, here, f"holds a {qual} whose config is not a JSON object")
    fetching = _fetching(config)
    if fetching:
        raise _bad(classes, here, f"holds a {qual} that asks to fetch something ({fetching})")
    try:
        return cls.from_dict(config)  # type: ignore[union-attr]
    except Exception as e:
        raise _bad(classes, here, f"holds a {qual} its class refuses ({first_line(e)})") from None


def callable_name(cls: Any) -> str | None:
    return f"{cls.__module__}:{cls.__qualname__}" if isinstance(cls, type) else None


def _bad(classes: Classes, here: str, why: str) -> InputError:
    return InputError(f"{classes.where}: field 'model_init' (the model's constructor arguments): {here} {why}; "
                      "save the capture again, or write a function that builds the model and pass it as --model")
