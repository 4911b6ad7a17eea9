"""Records of a trace: phases, roles, per-tensor records, occurrences; the dtype table."""

from __future__ import annotations

import enum
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from . import _serial
from ._serial import JSONData, absent


# The largest finite value of each floating dtype, and float16's smallest normal (2**-14: below it float16 keeps
# fewer bits, below 2**-24 only zero): the one table every report, rule and check reads (no torch here).
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
             "float64": 1.7976931348623157e308}
FP16_SMALLEST_NORMAL = 2.0 ** -14


class TextEnum(str, enum.Enum):
    """An enum whose members are their text: ``str()``, f-strings and JSON give the value."""

    def __str__(self) -> str:
        return str.__str__(self)  # the member's text is its value


class Phase(TextEnum):
    """Where in a step a value was seen, in execution order."""

    INPUT = "input"
    WEIGHTS = "weights"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    UPDATE = "update"


PHASE_ORDER: tuple[Phase, ...] = tuple(Phase)


class Role(TextEnum):
    """What a recorded tensor was to the op or module that produced or consumed it."""

    INPUT = "input"  # entered the step from outside (batch, target, ...)
    OUTPUT = "output"  # produced by an op or returned by a module
    GRAD_INPUT = "grad_input"
    GRAD_OUTPUT = "grad_output"  # gradient w.r.t. a module's output
    PARAM = "param"
    BUFFER = "buffer"
    GRAD = "grad"  # a parameter's .grad after backward
    STATE = "state"  # from before the step: optimizer state first seen in the update, a .grad backward adds into
    REMEASURED = "remeasured"  # a known tensor measured again after an in-place change or view write
    # memory allocated uninitialised (torch.empty), written only in part (through views), read: its unwritten
    # part is whatever the memory held; non-finite with nothing non-finite written since, it is an origin
    UNWRITTEN = "unwritten"
    RECEIVED = "received"  # arrived from another rank through a collective (all-reduce, ...): never an origin here


class Level(TextEnum):
    """What a trace records: every aten op, or module boundaries and gradients only (for speed)."""

    OP = "op"
    MODULE = "module"


# JSON (``to_dict`` / ``from_dict``, see ``_serial``): one key per field, in field order. ``field(metadata=absent(x))``
# is what a file without that key (an older layout) reads as; a field with neither a default nor ``absent`` is
# required in every file.


@dataclass(frozen=True)
class FullStats(JSONData):
    """The expensive statistics, computed only for the tensors that matter."""

    nan: int = field(metadata=absent(0))
    posinf: int = field(metadata=absent(0))
    neginf: int = field(metadata=absent(0))
    zeros: int = field(metadata=absent(0))
    numel: int = field(metadata=absent(0))
    # smallest non-zero finite magnitude; None when there is none
    min_nonzero_abs: float | None = field(metadata=absent(None))
    over_fp16: int = field(metadata=absent(0))  # finite values with |x| > 65504
    over_bf16: int = field(metadata=absent(0))  # finite values with |x| > bfloat16 max
    subnormal: int = field(metadata=absent(0))  # non-zero values below the smallest normal of the tensor's dtype


@dataclass(frozen=True)
class CastStats(JSONData):
    """A cast to a float8 format, measured on its input and its output: what the cast lost.

    The input is the value as the cast reads it, already multiplied by its scale (torchao's float8 training:
    ``x * scale``, clamped to the format's range). ``zeros``: values non-zero before the cast and zero after
    (underflow, to exactly 0); ``saturated``: values at or beyond the format's largest finite value
    (``|x * scale| >= format_max``). ``gemm_input``: the GEMM operand it became (``input``, ``weight``,
    ``grad_output``), ``recipe`` its scaling (``tensorwise``, ``rowwise``), ``amax`` the largest magnitude of the
    high-precision value before scaling (rowwise: over every row), ``scale_min``/``scale_max`` the scale's range
    (one value when tensorwise); each None where the trace did not see it. ``source``: the record of that
    high-precision value.
    """

    format: str = field(metadata=absent(""))
    numel: int = field(metadata=absent(0))
    zeros: int = field(metadata=absent(0))
    saturated: int = field(metadata=absent(0))
    format_max: float = field(metadata=absent(math.nan))
    gemm_input: str | None = None
    recipe: str | None = None
    amax: float | None = None
    scale_min: float | None = None
    scale_max: float | None = None
    source: int | None = None

    # A cast is part of an origin's story when it lost at least this share of its values, to zero or to the
    # maximum: dynamic scaling sends the amax itself to the maximum, and a few tiny values to zero, in every cast.
    STORY_SHARE: ClassVar[float] = 0.01

    @property
    def zero_share(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def saturated_share(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0


class RangeStats:
    """What ``min``/``max`` of one ``aminmax`` say: both NaN when the tensor holds a NaN,
    an Inf shows up in one of them. Shared by :class:`Record` and the tracer's records
    under construction, so the locator reads either."""

    __slots__ = ()
    min: float
    max: float

    @property
    def has_nan(self) -> bool:
        return math.isnan(self.min) or math.isnan(self.max)

    @property
    def has_inf(self) -> bool:
        """An Inf is certainly present (a NaN may hide one: see ``full``)."""
        return not self.has_nan and (math.isinf(self.min) or math.isinf(self.max))

    @property
    def finite(self) -> bool:
        return math.isfinite(self.min) and math.isfinite(self.max)

    @property
    def absmax(self) -> float:
        if self.has_nan:
            return math.nan
        return max(abs(self.min), abs(self.max))


class RecordView(Protocol):
    """The part of a record the locator and the graph read."""

    @property
    def index(self) -> int: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def module(self) -> str | None: ...
    @property
    def call_index(self) -> int: ...
    @property
    def op(self) -> str | None: ...
    @property
    def role(self) -> Role: ...
    @property
    def inputs(self) -> tuple[int, ...]: ...
    @property
    def nonfinite_scalar(self) -> str | None: ...
    @property
    def min(self) -> float: ...
    @property
    def max(self) -> float: ...
    @property
    def finite(self) -> bool: ...
    @property
    def has_nan(self) -> bool: ...


@dataclass(frozen=True)
class Record(RangeStats, JSONData):
    """Statistics of one floating tensor seen at one point of the step.

    ``min``/``max`` come from one on-device ``aminmax``: both are NaN when the
    tensor holds a NaN, and an Inf shows up in one of them. ``inputs`` are the
    indices of the records this one was computed from (the dataflow edges).
    """

    index: int
    phase: Phase
    module: str | None = field(metadata=absent(None))
    call_index: int = field(metadata=absent(0))
    op: str | None = field(metadata=absent(None))
    role: Role = field(metadata=absent(Role.OUTPUT))
    dtype: str = field(metadata=absent(""))
    shape: tuple[int, ...] = field(metadata=absent(()))
    min: float = field(metadata=absent(math.nan))
    max: float = field(metadata=absent(math.nan))
    inputs: tuple[int, ...] = ()
    source: str | None = None
    nonfinite_scalar: str | None = None  # "nan" / "inf" when a Python scalar argument was non-finite
    full: FullStats | None = None
    # Shapes of the op's tensor inputs as the op saw them (an input record may be the
    # view's base); measured for the origin op only.
    input_shapes: tuple[tuple[int, ...], ...] | None = None
    # A tensor subclass whose values could not be read (its class name): min/max say nothing (0, judged finite).
    unmeasured: str | None = None
    cast: CastStats | None = None  # the output of a cast to float8: what that cast lost

    @property
    def measured(self) -> bool:
        return self.unmeasured is None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def where(self) -> str:
        """Short human label: ``phase module#call op``."""
        parts = [str(self.phase.value)]
        if self.module is not None:
            parts.append(f"{self.module or '<root>'}#{self.call_index}")
        if self.op is not None:
            parts.append(self.op)
        parts.append(str(self.role.value))
        return " ".join(parts)


def role_text(r: Record) -> str:
    """An origin's role, as its description names it when no op made it: state says where it came from (the
    step's backward adds into a ``.grad`` no ``zero_grad`` cleared; the optimizer's state)."""
    if r.role is not Role.STATE:
        return str(r.role)
    return "state: " + ("a .grad from before the step, not zeroed" if r.phase is Phase.BACKWARD
                        else "from before the step")


@dataclass(frozen=True)
class Occurrence(JSONData):
    """Where the first non-finite value of a step was born.

    ``kind`` is ``"nan"`` or ``"inf"``. ``output`` is the record of the value
    that went non-finite; ``inputs`` the records of the op's tensor inputs.
    ``reached`` says whether the value got to the loss or the gradients;
    ``silent`` is True when later ops absorbed it.
    """

    phase: Phase
    module: str | None = field(metadata=absent(None))
    module_class: str | None = field(metadata=absent(None))
    call_index: int = field(metadata=absent(0))
    op: str | None = field(metadata=absent(None))
    kind: str = field(metadata=absent("nan"))
    source: str | None = field(metadata=absent(None))
    output: Record
    inputs: tuple[Record, ...] = ()
    reached: tuple[str, ...] | None = ()  # None: not measured (stop_at_first stops before)
    allowed: bool = False
    path: tuple[int, ...] = field(default=())
    harmless: bool = False  # its values fed only integer / index / boolean results (never the culprit)
    absorbed: tuple[int, ...] = ()  # the first finite records that took its non-finite values in
    # The text of the source line (``source``'s file and line), read when the report was made; None: no file.
    source_text: str | None = None
    # A backward origin: the ops of the nearest forward records its inputs came from, what its derivative
    # was taken of (``aten::sqrt`` for the division in sqrt's backward).
    forward_ops: tuple[str, ...] = ()
    # The float8 casts nearest upstream of the op on its inputs' paths that lost a share of their values (to
    # zero or to the format's maximum): records with ``cast`` set, the most lost first.
    casts: tuple[Record, ...] = ()

    @property
    def silent(self) -> bool:
        return self.reached == ()

    def describe(self) -> str:
        where = "outside the model" if self.module is None else f"module {self.module or '<root>'!s}"
        if self.module is not None and self.module_class:
            where += f" ({self.module_class}, call {self.call_index})"
        op = (f"op {self.op}" if self.op else
              "a read of memory no op wrote (allocated uninitialised, written in part)"
              if self.output.role is Role.UNWRITTEN else f"role {role_text(self.output)}")
        what = "NaN" if self.kind == "nan" else "Inf"
        tail = (" [harmless: it fed only integer / index / boolean results]" if self.harmless else
                " [silent: absorbed before the loss and gradients]" if self.silent else "")
        return f"{what} born in phase {self.phase.value}, {where}, {op}{tail}"
