"""Float8 casts: what a cast to a float8 format lost, and which GEMM operand it became.

torchao's float8 training casts each GEMM operand (the forward's input and weight, the backward's output
gradient) in plain ops the dispatch mode sees: the amax (``abs``, ``max``), the scale (``fp8_max / amax``),
``x * scale``, a clamp to the format's range, and ``_to_copy`` to the float8 dtype; then it wraps the float8
data and the scale in a ``Float8TrainingTensor`` (no op) that the GEMM reads. A cast to a float8 dtype is
measured where it runs, from its input and output: the values it sent to exactly zero (underflow) and those at
the format's maximum (saturation), counted on the device and read back with the trace's statistics. The first
op that reads the wrapper tells which operand it is, its recipe and its scale's record; the high-precision
value is the scaled product's other factor. Nothing here imports torchao: the wrapper is read by its
attributes.

A model without float8 pays one dtype test per copy op.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .locate import LocateResult
from .._util._dispatch import no_autocast, plain_values
from .._util._subclass import inner_tensors
from ._tensors import DTYPE_NAMES, TensorMap
from ..records import CastStats, Occurrence, Record

__all__ = ["FLOAT8", "PendingCast", "measure_cast", "read_casts", "wrapper_links", "note_operand", "cast_stats",
           "feeding_casts", "with_casts", "STORY_SHARE"]

FLOAT8 = frozenset(d for name, d in vars(torch).items() if isinstance(d, torch.dtype) and name.startswith("float8_"))
_MAX = {d: float(torch.finfo(d).max) for d in FLOAT8}
_CLAMPS = frozenset({"aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::clip", "aten::clamp_"})
_MULS = frozenset({"aten::mul", "aten::mul_"})
STORY_SHARE = CastStats.STORY_SHARE  # what lost share makes a cast part of an origin's story
_STORY_CASTS = 3  # at most this many, the most lost first
_WALK = 4096  # records an origin's upstream walk visits at most


class PendingCast:
    """A cast's measurement while the step runs: its two counts on the device until read back, what the
    wrapper told, and the records of its scale and of the high-precision value."""

    __slots__ = ("counts", "format", "numel", "format_max", "zeros", "saturated", "gemm_input", "recipe", "scale",
                 "source")

    def __init__(self, counts: torch.Tensor, fmt: str, numel: int, format_max: float) -> None:
        self.counts: torch.Tensor | None = counts
        self.format = fmt
        self.numel = numel
        self.format_max = format_max
        self.zeros = 0
        self.saturated = 0
        self.gemm_input: str | None = None
        self.recipe: str | None = None
        self.scale: int | None = None
        self.source: int | None = None

    @property
    def lost_share(self) -> float:
        return max(self.zeros, self.saturated) / self.numel if self.numel else 0.0


def measure_cast(src: torch.Tensor, out: torch.Tensor) -> PendingCast | None:
    """Count, on the device, what casting ``src`` to ``out``'s float8 dtype lost: values non-zero in ``src``
    and zero in ``out``, and values of ``src`` at or beyond the format's maximum. None: a value that cannot be
    read (a tensor subclass without a way to its values)."""
    x, q = plain_values(src), plain_values(out)
    if x is None or q is None or x.shape != q.shape:
        return None
    fmax = _MAX[out.dtype]
    with torch.no_grad(), no_autocast():
        zeros = ((x != 0) & (q.float() == 0)).sum()
        saturated = (x.abs() >= fmax).sum()
        counts = torch.stack([zeros, saturated])
    return PendingCast(counts, DTYPE_NAMES[out.dtype], q.numel(), fmax)


def read_casts(casts: Sequence[PendingCast]) -> None:
    """Read the counts of every cast not read yet: one copy per device."""
    todo = [c for c in casts if c.counts is not None]
    if not todo:
        return
    by_device: dict[torch.device, list[PendingCast]] = {}
    for c in todo:
        assert c.counts is not None
        by_device.setdefault(c.counts.device, []).append(c)
    for group in by_device.values():
        values = torch.stack([c.counts for c in group if c.counts is not None]).tolist()
        for c, (zeros, saturated) in zip(group, values):
            c.zeros, c.saturated, c.counts = int(zeros), int(saturated), None


def wrapper_links(t: torch.Tensor, known: TensorMap[tuple[int, int]]) -> tuple[int, ...]:
    """The records of a tensor subclass's inner tensors the trace knows (a float8 wrapper's data and scale):
    the values it was made from."""
    got = inner_tensors(t)
    if got is None:
        return ()
    links: list[int] = []
    for _, v in got[0]:
        e = known.get(v)
        if e is not None:
            links.append(int(e[0]))
    return tuple(links)


def note_operand(t: torch.Tensor, raws: Sequence[Any], known: TensorMap[tuple[int, int]]) -> None:
    """``t`` wraps float8 data a cast made (torchao's ``Float8TrainingTensor``: ``_data``, ``_scale``): tell
    that cast which GEMM operand it is, its recipe, its scale's record and its high-precision value's."""
    data, scale = getattr(t, "_data", None), getattr(t, "_scale", None)
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return
    e = known.get(data)
    cast: PendingCast | None = raws[e[0]].cast if e is not None else None
    if cast is None or e is None:
        return
    role = getattr(getattr(t, "_gemm_input_role", None), "value", None)
    cast.gemm_input = role if isinstance(role, str) else None
    cast.recipe = "tensorwise" if getattr(t, "_axiswise_dim", None) is None else "rowwise"
    s = known.get(scale)
    if s is not None:
        cast.scale = int(s[0])
        cast.source = _scaled_source(raws, raws[e[0]].inputs, cast.scale)


def _scaled_source(raws: Sequence[Any], inputs: tuple[int, ...], scale: int) -> int | None:
    """The record of the high-precision value a cast's input was scaled from: through clamps, the other
    factor of the product by ``scale``."""
    idx = inputs[0] if inputs else None
    for _ in range(4):
        if idx is None:
            return None
        r = raws[idx]
        if r.op in _CLAMPS and r.inputs:
            idx = r.inputs[0]
        elif r.op in _MULS and len(r.inputs) == 2 and scale in r.inputs:
            other = [i for i in r.inputs if i != scale]
            return other[0] if other else None
        else:
            return None
    return None


def cast_stats(c: PendingCast, raws: Sequence[Any]) -> CastStats:
    """The record's :class:`CastStats`, once the trace's statistics are read back."""
    amax = scale_min = scale_max = None
    if c.source is not None:
        src = raws[c.source]
        amax = src.absmax if src.unmeasured is None else None
    if c.scale is not None:
        s = raws[c.scale]
        scale_min, scale_max = (s.min, s.max) if s.unmeasured is None else (None, None)
    return CastStats(format=c.format, numel=c.numel, zeros=c.zeros, saturated=c.saturated, format_max=c.format_max,
                     gemm_input=c.gemm_input, recipe=c.recipe, amax=_number(amax), scale_min=_number(scale_min),
                     scale_max=_number(scale_max), source=c.source)


def _number(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def feeding_casts(raws: Sequence[Any], inputs: tuple[int, ...]) -> tuple[int, ...]:
    """The float8 casts nearest upstream of an op whose inputs are ``inputs`` that lost at least
    :data:`STORY_SHARE` of their values, the most lost first. The walk stops at the first cast on each path, and
    a value made from a cast (a float8 wrapper, made from its data and its scale) is followed into the cast
    only: its scale was computed from the same high-precision value, whose earlier casts are another story."""
    seen: set[int] = set()
    todo = deque(inputs)
    found: list[int] = []
    while todo and len(seen) < _WALK:
        i = todo.popleft()
        if i in seen or not 0 <= i < len(raws):
            continue
        seen.add(i)
        c = raws[i].cast
        if c is not None:
            if c.lost_share >= STORY_SHARE:
                found.append(i)
            continue
        ins = raws[i].inputs
        from_cast = [j for j in ins if 0 <= j < len(raws) and raws[j].cast is not None]
        todo.extend(from_cast or ins)
    found.sort(key=lambda i: (-raws[i].cast.lost_share, i))
    return tuple(found[:_STORY_CASTS])


def with_casts(found: LocateResult, raws: Sequence[Any], record: Callable[[int], Record]) -> LocateResult:
    """``found`` with each origin's :attr:`~nanhunt.records.Occurrence.casts` (:func:`feeding_casts` of its op's
    inputs); the leading origin stays one of the origins, the same object."""
    if not found.origins:
        return found
    new: dict[int, Occurrence] = {}
    for o in found.origins:
        casts = feeding_casts(raws, o.output.inputs)
        new[id(o)] = dataclasses.replace(o, casts=tuple(record(i) for i in casts)) if casts else o
    first = None if found.first is None else new.get(id(found.first), found.first)
    return dataclasses.replace(found, first=first, origins=tuple(new[id(o)] for o in found.origins))
