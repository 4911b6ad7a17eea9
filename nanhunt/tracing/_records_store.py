"""The records of one trace: made while the step runs with their statistics still on the device,
read back in bulk, and turned into :class:`Record` objects only for what someone looks at.

A copy (clone, cast, ``copy_``) is not measured: its min/max are derived from its source's when
the statistics are read back, casts emulated exactly (:func:`cast_value`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import torch

from ._casts import PendingCast, cast_stats, read_casts
from ._tensors import DTYPE_NAMES, TensorMap, storage_key
from ..records import FullStats, Phase, RangeStats, Record, Role
from .stats import PendingStats, full_stats

__all__ = ["Source", "Raw", "RecordStore", "cast_value", "cast_pair", "format_source", "STALE", "EXACT_DTYPES",
           "EXACT_CASTS"]

Source = tuple[str, int, str]  # (file, line, function) of the user's code that ran an op
STALE = -2  # a version no tensor has: the record must be measured again when read
# Casts among these are derived exactly by cast_value (one rounding, overflow to inf).
EXACT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
EXACT_CASTS = frozenset({"float16", "bfloat16", "float32"})
_LOSS = Phase.LOSS


def cast_value(x: float, dtype: str) -> float:
    """``x`` rounded to ``dtype`` as a tensor cast does it (nearest even; overflow to inf)."""
    if x != x or x in (math.inf, -math.inf) or dtype in ("float64", ""):
        return x
    try:
        if dtype == "float16":
            return float(struct.unpack("<e", struct.pack("<e", x))[0])
        if dtype == "float32":
            return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)
    if dtype == "bfloat16":
        try:
            bits = struct.unpack("<I", struct.pack("<f", x))[0]
        except OverflowError:
            return math.copysign(math.inf, x)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return float(struct.unpack("<f", struct.pack("<I", bits))[0])
    return x


def cast_pair(lo: float, hi: float, dtype: str) -> tuple[float, float]:
    """min/max of a tensor cast to ``dtype``: casting is monotone (rounding, overflow to inf),
    so they are the cast of the source's min/max."""
    return cast_value(lo, dtype), cast_value(hi, dtype)


def format_source(src: Source | None) -> str | None:
    if src is None:
        return None
    return f"{src[0]}:{src[1]} in {src[2]}"


class Raw(RangeStats):
    """A record under construction: its statistics stay on the device until the trace
    reads them back (``min``/``max`` NaN until then). The locator reads these directly;
    a :class:`Record` is made only for what a user or a report looks at."""

    __slots__ = ("index", "phase", "module", "call_index", "op", "role", "dtype", "shape", "inputs", "source",
                 "nonfinite_scalar", "alias_of", "full", "blank", "in_shapes", "min", "max", "constant",
                 "unmeasured", "cast")

    def __init__(
        self,
        phase: Phase,
        module: str | None,
        call: int,
        op: str | None,
        role: Role,
        t: torch.Tensor,
        inputs: tuple[int, ...],
        source: Source | None,
        scalar: str | None = None,
        alias_of: int | None = None,
    ) -> None:
        self.index = -1  # set when appended
        self.min = self.max = math.nan
        self.phase = phase
        self.module = module
        self.call_index = call
        self.op = op
        self.role = role
        self.dtype = DTYPE_NAMES[t.dtype]
        self.shape = t.shape
        self.inputs = inputs
        self.source = source
        self.nonfinite_scalar = scalar
        self.alias_of = alias_of
        self.full: FullStats | None = None
        self.blank = False  # uninitialised memory: no value to measure, counts as finite
        self.in_shapes: tuple[tuple[int, ...], ...] | None = None
        self.constant = False  # a tensor literal: its non-finite value counts as a scalar argument's
        # a tensor subclass whose values could not be read: its class name (min/max 0, judged finite)
        self.unmeasured: str | None = None
        self.cast: PendingCast | None = None  # a float8 cast's output: what the cast lost (see _casts)


class RecordStore:
    """Every record of one trace, in execution order, and which record holds each live tensor's
    values.

    ``add`` queues a record's statistics on the device (:class:`PendingStats`); ``read_back``
    reads what is queued in one copy per (device, dtype) and fills the records in; ``record``
    makes the :class:`Record` of an index on first use. ``zoom``: indices whose full statistics
    are measured when they are made (a second pass that knows its culprit). Beside the records, the
    facts ``locate`` reads with them: module classes, the model's outputs, module-level calls.
    """

    __slots__ = ("raws", "pending", "zoom", "known", "kd", "writes", "fresh", "made", "last_loss", "not_masks",
                 "negated", "index_uses", "checked", "classes", "root_outputs", "spans", "calls", "casts")

    def __init__(self, zoom: Iterable[int] = ()) -> None:
        self.raws: list[Raw] = []
        self.pending = PendingStats()
        self.zoom = frozenset(zoom)
        self.known: TensorMap[tuple[int, int]] = TensorMap()  # tensor -> (record index, version)
        self.kd = self.known.entries  # the same, read directly on the op path
        self.writes: dict[int, int] = {}  # storage data_ptr -> last record that wrote into it
        # memory allocated uninitialised (torch.empty): storage data_ptr -> every record written into it since
        self.fresh: dict[int, list[int]] = {}
        self.made: dict[int, Record] = {}
        self.last_loss = -1  # the last record made in phase loss
        self.not_masks: set[int] = set()  # records that cannot be -inf masks (running statistics)
        # records of ops whose factor may be negative (alpha, beta, a mul / div operand): see locate.factor_negative
        self.negated: set[int] = set()
        self.index_uses: set[int] = set()  # records an op with no floating output took in (a cast to long)
        self.checked = 0  # records read back and searched for an origin while the step ran
        self.classes: dict[str, str] = {}  # module name -> class name
        self.root_outputs: set[int] = set()  # records the model returned
        self.spans: dict[int, int] = {}  # module level: a call's output record -> the call's first record
        self.calls: list[tuple[int, int, str, int]] = []  # module level: (start, end, module, call) per call
        self.casts: list[PendingCast] = []  # the float8 casts measured (their counts read with the statistics)

    def add(self, raw: Raw, t: torch.Tensor) -> int:
        """Append ``raw``, the record of ``t``'s values now, and queue their statistics."""
        idx = raw.index = len(self.raws)
        self.raws.append(raw)
        if raw.blank:
            self.pending.values[idx] = (0.0, 0.0)
        elif raw.alias_of is None and not self.pending.add(idx, t):
            raw.unmeasured = type(t).__name__
        if idx in self.zoom:
            raw.full = full_stats(t)
        if raw.phase is _LOSS:
            self.last_loss = idx
        return idx

    def unwritten_since(self, t: torch.Tensor, idx: int) -> bool:
        """Inference tensors have no version counter: ask whether an op wrote into the
        storage after record ``idx`` was made (a write through a view, say)."""
        w = self.writes.get(storage_key(t))
        return w is None or w <= idx

    def read_back(self, start: int = 0) -> None:
        """Read every queued statistic back and put it on the records from ``start`` on."""
        self.fill(self.pending.read(), start)
        read_casts(self.casts)

    def fill(self, values: dict[int, tuple[float, float]], start: int) -> None:
        """Put the read-back statistics on the raw records from ``start`` on (copies derived)."""
        raws = self.raws
        for i in range(start, len(raws)):
            r = raws[i]
            if r.alias_of is not None:
                base = raws[r.alias_of]
                lo, hi = base.min, base.max
                if base.dtype != r.dtype:
                    lo, hi = cast_pair(lo, hi, r.dtype)
                r.unmeasured = base.unmeasured
            else:
                lo, hi = values.get(i, (math.nan, math.nan))
            r.min, r.max = lo, hi
            if r.constant and not r.finite:
                r.nonfinite_scalar = "nan" if r.has_nan else "inf"

    def record(self, i: int) -> Record:
        """The :class:`Record` of index ``i``, made on first use."""
        rec = self.made.get(i)
        if rec is None:
            r = self.raws[i]
            rec = self.made[i] = Record(
                index=i, phase=r.phase, module=r.module, call_index=r.call_index, op=r.op, role=r.role,
                dtype=r.dtype, shape=tuple(r.shape), min=r.min, max=r.max, inputs=r.inputs,
                source=format_source(r.source), nonfinite_scalar=r.nonfinite_scalar, full=r.full,
                input_shapes=r.in_shapes, unmeasured=r.unmeasured,
                cast=None if r.cast is None else cast_stats(r.cast, self.raws),
            )
        return rec

    def forget(self, i: int) -> None:
        """Record ``i``'s raw changed (phase, full statistics): make its :class:`Record` again."""
        self.made.pop(i, None)

    def release(self) -> None:
        """Let go of the tensors' identities (the raws hold no tensor)."""
        self.known.entries.clear()
