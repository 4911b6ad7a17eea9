"""Tensors as the tracer sees them: which dtypes can hold NaN/Inf, a map keyed by identity that
keeps no tensor alive, where a tensor lies in memory, and the tensors inside module arguments."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

from .._util._text import dtype_name

__all__ = ["DTYPE_NAMES", "FLOATISH", "MAX_NEST", "TensorMap", "floatish", "input_shapes", "layout", "storage_key",
           "tensors"]

_V = TypeVar("_V")

DTYPE_NAMES: dict[torch.dtype, str] = {d: dtype_name(d) for d in vars(torch).values()
                                       if isinstance(d, torch.dtype)}
# Tensors whose values can be NaN/Inf: floating (float8 included) and complex.
FLOATISH = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex))
MAX_NEST = 6  # how deep module inputs/outputs are searched for tensors


def floatish(t: torch.Tensor) -> bool:
    return t.dtype in FLOATISH


class TensorMap(Generic[_V]):
    """tensor -> value (a record index and version; an owner's name), keyed by identity without
    keeping the tensor alive.

    A plain dict on ``id`` with a weak reference to check that the id still names the
    same tensor (ids are reused once a tensor dies): cheaper than WeakIdKeyDictionary,
    which builds a reference object on every lookup. The op path reads ``entries`` directly.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref[torch.Tensor], _V]] = {}

    def get(self, t: torch.Tensor) -> _V | None:
        e = self.entries.get(id(t))
        if e is None or e[0]() is not t:
            return None
        return e[1]

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def __setitem__(self, t: torch.Tensor, value: _V) -> None:
        self.entries[id(t)] = (weakref.ref(t), value)


def layout(t: torch.Tensor) -> tuple[Any, ...]:
    """Where and how ``t`` lies in memory (two live tensors with the same layout and version
    counter value hold the same values)."""
    try:
        return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
    except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass, meta)
        return (id(t),)


def storage_key(t: torch.Tensor) -> int:
    """The memory ``t`` and all its views share."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return -id(t)


def tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside module arguments/outputs: tuples, lists, dicts, ModelOutput, dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    _collect(obj, depth, found)
    return found


def _collect(obj: Any, depth: int, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif depth >= MAX_NEST:
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                found.append(o)
            elif o is not None:
                _collect(o, depth + 1, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, depth + 1, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name, None), depth + 1, found)


def input_shapes(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """Shapes of an op's floating tensor inputs, in the order the tracer records them."""
    shapes: list[tuple[int, ...]] = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and floatish(t):
                shapes.append(tuple(t.shape))
    return tuple(shapes)
