"""Frozen dataclasses of plain values to JSON-ready dicts and back, driven by their fields and type hints.

Written: one key per field, in field order; enums by value; tuples as lists; a nested dataclass through its own
``to_dict`` (so a class that adds a key adds it wherever it is nested); ``float`` NaN/Inf as ``"nan"``/``"inf"``/
``"-inf"`` (JSON has neither: the files stay strict JSON), also anywhere inside an ``Any`` value. A ``TypedDict``
is written and read as the ``dict[str, Any]`` it is at run time.

Read: the inverse, converting each value to its field's type (``int(...)``, ``str(...)``, ``Phase(...)``, a null
``float`` is NaN). A key the file lacks, as in a file an older version wrote, takes the field's default; a field
the constructor requires takes the value its metadata names with :func:`absent` (``field(metadata=absent(0))``),
and without one the key is required (``KeyError``). Keys the class does not know are ignored.

Nothing here imports torch or another nanhunt module.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["JSONData", "absent", "to_dict", "from_dict", "prepare", "json_float", "json_floats"]

T = TypeVar("T")
_Convert = Callable[[Any], Any]
_ABSENT = "nanhunt.absent"  # the metadata key of absent()


def absent(value: Any) -> dict[str, Any]:
    """Field metadata: a file without this field's key reads as ``value`` (an older layout lacked it)."""
    return {_ABSENT: value}


def json_float(x: float) -> float | str:
    # JSON has no NaN/Inf: keep them as strings so the files stay strict JSON.
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def json_floats(obj: Any) -> Any:
    """``obj`` (dicts, lists, scalars) with every non-finite float kept as a string, as above."""
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, dict):
        return {k: json_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_floats(v) for v in obj]
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """The dataclass instance ``obj`` as a dict of JSON values, one key per field."""
    return {name: write(getattr(obj, name)) for name, write, _, _ in _plan(type(obj))}


def from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
    """An instance of the dataclass ``cls`` from ``d`` (see the module docstring for absent keys)."""
    kwargs: dict[str, Any] = {}
    for name, _, read, missing in _plan(cls):
        if name in d:
            kwargs[name] = read(d[name])
        elif missing is not None:
            kwargs[name] = missing()
        else:
            raise KeyError(name)
    return cls(**kwargs)


# field name, writer, reader, and what an absent key reads as (a factory; None: the key is required)
_FieldPlan = tuple[str, _Convert, _Convert, Callable[[], Any] | None]


_PLANS: dict[type, tuple[_FieldPlan, ...]] = {}


def prepare(classes: Iterable[type]) -> None:
    """Resolve the fields and type hints of ``classes`` now rather than at their first use (which then runs the
    same lines as every later one: a Guard writes its first event on a path Ctrl-C tests replay line by line)."""
    for cls in classes:
        _plan(cls)


def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _make_plan(cls)
    return plan


def _make_plan(cls: type) -> tuple[_FieldPlan, ...]:
    hints = typing.get_type_hints(cls)
    steps: list[_FieldPlan] = []
    for f in dataclasses.fields(cls):
        missing: Callable[[], Any] | None = None
        if f.default is not dataclasses.MISSING:
            missing = functools.partial(_identity, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            missing = f.default_factory
        elif _ABSENT in f.metadata:
            missing = functools.partial(_identity, f.metadata[_ABSENT])
        hint = hints[f.name]
        steps.append((f.name, _writer(hint), _reader(hint), missing))
    return tuple(steps)


def _identity(x: Any) -> Any:
    return x


def _float_in(x: Any) -> float:
    return math.nan if x is None else float(x)


def _optional(hint: Any) -> Any | None:
    """``X`` for ``X | None`` (or ``Optional[X]``), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {hint!r}: only X | None")
        return args[0]
    return None


def _items(hint: Any) -> tuple[tuple[Any, ...], bool]:
    """The item types of a ``tuple[...]``/``list[X]`` hint and whether they repeat (``tuple[X, ...]``, lists)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return args, True
    if len(args) == 2 and args[1] is Ellipsis:
        return args[:1], True
    return args, False


@functools.cache
def _writer(hint: Any) -> _Convert:
    if typing.is_typeddict(hint):  # a plain dict at run time, its keys checked by mypy alone
        return _writer(dict[str, Any])
    inner = _optional(hint)
    if inner is not None:
        w = _writer(inner)
        return lambda x: None if x is None else w(x)
    origin = typing.get_origin(hint)
    if hint is Any:
        return json_floats
    if hint is float:
        return json_float
    if hint in (int, str, bool):
        return _identity
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda x: x.value
    if origin in (tuple, list):
        args, repeated = _items(hint)
        if repeated:
            w = _writer(args[0])
            return lambda xs: [w(x) for x in xs]
        ws = tuple(_writer(a) for a in args)
        return lambda xs: [w(x) for w, x in zip(ws, xs, strict=True)]
    if origin is dict:
        w = _writer(typing.get_args(hint)[1])
        return lambda m: {k: w(v) for k, v in m.items()}
    if dataclasses.is_dataclass(hint):
        return lambda x: x.to_dict() if hasattr(x, "to_dict") else to_dict(x)
    raise TypeError(f"no JSON form for {hint!r}")


@functools.cache
def _reader(hint: Any) -> _Convert:
    if typing.is_typeddict(hint):  # as a dict[str, Any]: a file's values are not checked against its keys' types
        return _reader(dict[str, Any])
    inner = _optional(hint)
    if inner is not None:
        r = _reader(inner)
        return lambda x: None if x is None else r(x)
    origin = typing.get_origin(hint)
    if hint is Any:
        return _identity
    if hint is float:
        return _float_in  # a null (an older writer's NaN) reads as NaN
    if hint in (int, str, bool) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return typing.cast(_Convert, hint)
    if origin in (tuple, list):
        args, repeated = _items(hint)
        made: type = origin
        if repeated:
            r = _reader(args[0])
            return lambda xs: made(r(x) for x in xs)
        rs = tuple(_reader(a) for a in args)
        return lambda xs: tuple(r(x) for r, x in zip(rs, xs, strict=True))
    if origin is dict:
        rk, rv = (_reader(a) for a in typing.get_args(hint))
        return lambda m: {rk(k): rv(v) for k, v in m.items()}
    if dataclasses.is_dataclass(hint):
        cls: Any = hint
        read = getattr(cls, "from_dict", None)
        return (lambda x: read(x)) if read is not None else (lambda x: from_dict(cls, x))
    raise TypeError(f"no JSON form for {hint!r}")


_J = TypeVar("_J", bound="JSONData")


class JSONData:
    """Base of a frozen dataclass written by :func:`to_dict` and read by :func:`from_dict`; a class that writes
    more (or reads older files specially) overrides these two and calls the functions."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls: type[_J], d: Mapping[str, Any]) -> _J:
        return from_dict(cls, d)
