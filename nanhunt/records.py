"""Plain result data: phases, per-tensor records, occurrences, reports, comparisons, guard events.

Nothing here imports torch or another nanhunt module (but the private ``_serial``, which writes and reads
them as JSON), so reports can be read, written and rendered without a model in sight.
"""

from __future__ import annotations

import enum
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import _serial
from ._serial import JSONData, absent

__all__ = ["SCHEMA_VERSION", "Phase", "Role", "FullStats", "Record", "Occurrence", "Advice", "Report", "TensorSummary", "Inspection", "Verdict", "Repro", "PHASE_ORDER",
           "TensorDiff", "Decision", "Regression", "Comparison", "RangeStats", "RecordView", "GuardEvent", "Rule",
           "Quality", "Failure", "Speed", "CLAUSES", "DTYPE_MAX", "FP16_SMALLEST_NORMAL"]

# The largest finite value of each floating dtype, and float16's smallest normal (2**-14: below it float16 keeps
# fewer bits, below 2**-24 only zero): the one table every report, rule and check reads (no torch here).
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
             "float64": 1.7976931348623157e308}
FP16_SMALLEST_NORMAL = 2.0 ** -14

# Version 1: the first released layout. Version 2 adds ``Report.repro`` (a :class:`Repro` or null).
# ``Report.from_dict`` reads every older version: a missing key takes its default.
SCHEMA_VERSION = 2


class Phase(str, enum.Enum):
    """Where in a step a value was seen, in execution order."""

    INPUT = "input"
    WEIGHTS = "weights"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    UPDATE = "update"

    def __str__(self) -> str:
        return self.value


PHASE_ORDER: tuple[Phase, ...] = tuple(Phase)


class Role(str, enum.Enum):
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

    def __str__(self) -> str:
        return self.value


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


@dataclass(frozen=True)
class Advice(JSONData):
    """A fix beyond float32 for a known pattern (:mod:`nanhunt.advice`): ``pattern`` its id, ``advice`` one
    line, ``fix`` the idiomatic code as a short snippet, ``because`` the measurement of this run that
    triggered it (op, kind, phase, dtype, the inputs' values, the scaler, the optimizer's eps)."""

    pattern: str = field(metadata=absent(""))
    advice: str = ""
    fix: str = ""
    because: str = ""


@dataclass(frozen=True)
class Report(JSONData):
    """Everything one replay found, as plain data; renderers only format it.

    ``status`` is ``"clean"`` (the step stayed finite), ``"nonfinite"`` or
    ``"not-reproducible"`` (two replays of the same step disagreed, or a Guard's capture
    whose event says the step failed replayed finite: see :class:`Verdict`).

    JSON layout (``to_json``; key names are stable, numbers stay numbers, and
    NaN/Inf are the strings ``"nan"``/``"inf"``/``"-inf"`` so files are strict
    JSON): ``schema_version``, ``status``, ``first`` (an occurrence or null),
    ``origins``, ``path`` (records), ``runs``, ``loss``, ``config`` (dtype,
    device_type, level, train, loss_fn, optimizer, scaler_scale,
    scaler_growth_tracker, grads_finite, scaler_would_skip), ``modules``
    (module -> "finite" / "nan in backward" ...), ``module_classes``,
    ``environment``, ``command``, ``notes``, ``n_records``, ``verdict``,
    ``timeline`` (``[index, phase, max |x| or "nan", "finite"|"nan"|"inf"]``
    per record) and, from version 2, ``repro``; ``advice`` and ``guard_event`` only
    when present (optional keys: an older file without them reads as none). An
    occurrence holds ``phase``, ``module``, ``module_class``, ``call_index``, ``op``,
    ``kind``, ``source``, ``output`` and ``inputs`` (records), ``reached``,
    ``allowed``, ``path``, ``source_text``, ``forward_ops``; a record the fields of
    :class:`Record`.
    """

    status: str = field(metadata=absent("clean"))
    first: Occurrence | None = field(metadata=absent(None))
    origins: tuple[Occurrence, ...] = ()
    path: tuple[Record, ...] = ()
    runs: tuple[Occurrence | None, ...] = ()
    loss: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # module -> "nan" / "inf" / "finite"
    module_classes: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    command: str | None = None
    notes: tuple[str, ...] = ()
    n_records: int = 0
    verdict: Verdict | None = None
    # One point per record, in execution order: (index, phase, largest finite |x| or NaN, "finite"/"nan"/"inf").
    timeline: tuple[tuple[int, str, float, str], ...] = ()
    repro: Repro | None = None  # the origin op alone, as a standalone script (``nanhunt.repro``)
    schema_version: int = SCHEMA_VERSION
    # ``nanhunt compare``: float32 reference vs autocast. Written under "comparison" only when present, so the
    # JSON of a replay is unchanged; read back with ``.get`` (absent in older files).
    comparison: Comparison | None = None
    # Fixes beyond float32 derived from the measured origins (``nanhunt.advice``), and the Guard's event when
    # the capture came from a Guard (read from the ``-event.json`` beside it: the failing step, kind, detail,
    # rank). Written only when present, like ``comparison``.
    advice: tuple[Advice, ...] = ()
    guard_event: GuardEvent | None = None

    def to_dict(self) -> dict[str, Any]:
        d = _serial.to_dict(self)
        for key in ("comparison", "guard_event"):
            if d[key] is None:
                del d[key]
        if not d["advice"]:
            del d["advice"]
        return {"schema_version": d.pop("schema_version"), **d}  # first, as every version wrote it

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        # Read in any older layout, held in the current one (schema_version is the default): written back, it
        # is a current file. A null among the origins is dropped.
        current = {k: v for k, v in d.items() if k != "schema_version"}
        if "origins" in current:
            current["origins"] = [o for o in current["origins"] if o is not None]
        return _serial.from_dict(cls, current)

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Report:
        import json

        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class TensorSummary:
    """One stored tensor of a checkpoint (a parameter, buffer or optimizer moment)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nan: int
    inf: int
    absmax: float  # largest finite magnitude
    min_nonzero: float | None = None  # smallest finite non-zero magnitude; None: there is none
    below_fp16_normal: int = 0  # finite non-zero values below float16's smallest normal (6.1e-05)
    numel: int = 0
    eps: float | None = None  # an optimizer second moment: the eps of its parameter group, when the state has one
    below_eps: int = 0  # a second moment v with eps: elements with sqrt(v) < eps (eps sets the update's size there)

    @property
    def fp16_headroom(self) -> float:
        return math.inf if self.absmax == 0 else DTYPE_MAX["float16"] / self.absmax

    @property
    def bf16_headroom(self) -> float:
        return math.inf if self.absmax == 0 else 3.3895313892515355e38 / self.absmax  # bfloat16's max


@dataclass(frozen=True)
class Inspection:
    """What ``nanhunt inspect`` found in a checkpoint.

    ``flagged``: non-finite, or within 16x of the float16 max. For a checkpoint that holds none (and beside the
    ones it holds), ``largest`` are the other tensors closest to the dtype limits (largest magnitude first),
    ``tiniest`` those holding non-zero values below float16's smallest normal (most first), ``moments`` the
    optimizer's second moments (Adam's ``exp_avg_sq``...) with their eps, largest first; each at most 10."""

    path: str
    n_tensors: int
    flagged: tuple[TensorSummary, ...]
    scaler: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    largest: tuple[TensorSummary, ...] = ()
    tiniest: tuple[TensorSummary, ...] = ()
    moments: tuple[TensorSummary, ...] = ()
    n_elements: int = 0
    scaler_meaning: tuple[str, ...] = ()  # what the GradScaler state means for the next steps, one sentence each

    @property
    def scaler_nonfinite(self) -> bool:
        """The GradScaler's saved scale is NaN or Inf (every later step scales by it)."""
        s = self.scaler.get("scale")
        return isinstance(s, (int, float)) and not math.isfinite(s)

    @property
    def nonfinite(self) -> bool:
        return self.scaler_nonfinite or any(t.nan or t.inf for t in self.flagged)


@dataclass(frozen=True)
class Verdict(JSONData):
    """What the float32 bisection proved.

    ``kind``: ``precision`` (``culprits`` in float32 make the step finite),
    ``not-precision`` (it fails in float32 too), ``scale-induced`` (only the loss
    scale overflows the gradients), ``not-reproducible``, ``clean``, ``interrupted``
    (Ctrl-C before any culprit was found; ``interrupted`` is also set on a partial
    ``precision`` verdict). ``not-reproducible`` is also the verdict (and the report's status)
    of a Guard's capture whose event says its step failed, on that rank alone, and whose
    ``replays`` (``hunt(repeat=)``, ``--repeat``) all stayed finite.

    A step is *fixed* when its loss, every gradient and what the update wrote (parameters,
    buffers, optimizer state) are finite and no origin is born in it (the silent ones
    included; harmless and allowed ones do not count).

    ``culprits``: a minimal set of modules (and ``<loss>`` / ``<update>``) whose float32 makes
    the step finite; when every origin is silent, makes the leading origin no longer born.
    ``origin_alone_fixes``: the same question for the leading origin's module (or region)
    alone, one replay: True when that replay was finite (and, every origin silent, the leading
    one was not born again); it says nothing of the other origins (see ``remaining``). None:
    the origin is in no module or region that can run in float32.

    The proposed fix (``precision``): ``fix_regions`` run in float32, the culprits extended
    while origins remain (their modules added, or, when two or more of them and most of a
    class's modules hold origins, every module of that class: ``fix_classes``, as
    ``"package.module:Class"``), at most three rounds; ``fix`` is its code to paste.
    ``remaining``: the origins born in a traced replay with ``fix_regions`` in float32 (an
    extension is kept only when that replay is finite): ``()`` with ``confirmed`` means the fix
    fixes the step. None: not measured (no fix, or Ctrl-C first).
    """

    kind: str = field(metadata=absent("clean"))
    culprits: tuple[str, ...] = ()
    origin_alone_fixes: bool | None = None
    confirmed: bool = False
    replays: int = 0
    seconds: float = 0.0
    alternatives: dict[str, bool] = field(default_factory=dict)  # e.g. {"bfloat16": True, "scale 1": False}
    fix: str | None = None
    float32_first: Occurrence | None = None  # where the step fails in float32 (not-precision)
    interrupted: bool = False
    candidates: int = 0  # modules (and the loss) bisection chose among
    # precision, for a step that stays finite: the culprits make its only (silent) origin go away
    silent: bool = False
    corrupted: tuple[str, ...] = ()  # silent: the values that took the origin's non-finite values in
    fix_regions: tuple[str, ...] = ()
    fix_classes: tuple[str, ...] = ()
    remaining: tuple[Occurrence, ...] | None = None


@dataclass(frozen=True)
class Repro(JSONData):
    """The origin op alone: its saved inputs and a standalone ``repro.py`` (needs only torch).

    ``call`` is the op call as the script writes it; ``inputs`` the ``(dtype,
    shape)`` of each saved tensor. ``sliced`` says the inputs were narrowed to
    fit the size cap (``original_shapes`` were the shapes as the op ran).
    ``verified`` is True only when a fresh Python process ran the script and its
    output was non-finite of the same kind; ``result`` is what that run printed.
    """

    op: str = field(metadata=absent(""))
    overload: str = "default"
    device_type: str = "cpu"
    autocast_dtype: str | None = None  # None: the op ran with autocast off
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    call: str = ""
    nbytes: int = 0
    sliced: bool = False
    original_shapes: tuple[tuple[int, ...], ...] = ()
    files: tuple[str, ...] = ()
    verified: bool = False
    result: str = ""
    command: str = "python repro.py"


@dataclass(frozen=True)
class TensorDiff(JSONData):
    """One value of the step in the autocast run against the same value in the float32 reference.

    ``kind`` is ``"module"`` (the outputs of one module call, matched by ``name`` and
    ``call_index``), ``"output"`` (the model's return value), ``"loss"`` or ``"grad"``
    (a parameter's gradient). Errors: ``max_abs`` = max |amp - ref|; ``max_rel`` = max
    |amp - ref| / |ref| over the elements with |ref| > atol; ``scaled`` = max_abs /
    max(max |ref|, atol), the error as a fraction of the tensor's own magnitude (what the
    ranking compares); ``out_of_tol`` the fraction of elements with |amp - ref| > atol +
    rtol * |ref|. A non-finite value where the other run has a different one counts as an
    infinite error. ``headroom`` = the autocast dtype's max / the largest finite magnitude
    in either run (inf when all zero; None when the autocast value is non-finite).
    ``underflow`` counts elements non-zero in float32 that are zero in the autocast run.
    For module calls, ``input_scaled`` is the largest ``scaled`` error among the call's
    floating inputs and ``introduced`` the error the call adds beyond its inputs and beyond
    what its own sub-module calls already introduced (see :mod:`nanhunt.compare`).
    """

    name: str = field(metadata=absent(""))
    kind: str = field(metadata=absent("module"))
    call_index: int = 0
    module_class: str | None = None
    dtype: str = ""  # the dtype of the value in the autocast run (the first tensor's, for several outputs)
    shape: tuple[int, ...] = ()
    numel: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    scaled: float = 0.0
    out_of_tol: float = 0.0
    headroom: float | None = None
    underflow: int = 0
    ref_nonfinite: int = 0
    amp_nonfinite: int = 0
    ref_absmax: float = 0.0
    input_scaled: float | None = None
    introduced: float | None = None
    depth: int = 0  # nesting depth of the call (0: the model itself)

    def label(self) -> str:
        if self.kind == "module":
            return f"{self.name or '<root>'}#{self.call_index}"
        if self.kind == "grad":
            return f"{self.name}.grad"
        return f"<{self.kind}>"


@dataclass(frozen=True)
class Decision(JSONData):
    """The top-1 class of one sample in both runs. ``-1``: no decision (the scores hold a NaN).

    Margins are top-1 minus top-2 score in each run (inf with one class)."""

    index: int
    ref_class: int = field(metadata=absent(-1))
    amp_class: int = field(metadata=absent(-1))
    ref_runner_up: int = field(metadata=absent(-1))
    ref_margin: float = field(metadata=absent(math.nan))
    amp_margin: float = field(metadata=absent(math.nan))
    ref_score: float = field(metadata=absent(math.nan))
    amp_score: float = field(metadata=absent(math.nan))
    flipped: bool = field(metadata=absent(False))
    near_boundary: bool = field(metadata=absent(False))


@dataclass(frozen=True)
class Regression(JSONData):
    """``--task regress``: the output's error per sample and its extreme values in both runs."""

    ref_min: float = field(metadata=absent(math.nan))
    ref_max: float = field(metadata=absent(math.nan))
    amp_min: float = field(metadata=absent(math.nan))
    amp_max: float = field(metadata=absent(math.nan))
    worst: tuple[tuple[int, float], ...] = ()  # (sample, max |amp - ref| in it), largest first


# The clauses of an acceptance rule, by the name a failure gives (``Failure.clause``).
CLAUSES = ("reference_finite", "amp_finite", "max_flips", "tolerance", "max_quality_drop", "min_quality")


@dataclass(frozen=True)
class Rule(JSONData):
    """The acceptance rule of ``nanhunt compare`` as data, fixed (printed and hashed) before any autocast run.

    What is measured: ``task`` (``"classify"``, ``"regress"`` or ``"none"``) and ``metric``, the quality of both
    runs against the targets (``"accuracy"``, ``"mse"`` or the user's ``"package.module:fn"``; None: none), which
    improves upwards when ``higher_is_better``. The clauses (names as in :data:`CLAUSES`): both runs finite
    (``reference_finite``, ``amp_finite``), except non-finite values introduced inside a module named in
    ``allow_nonfinite`` (its subtree; ``"<root>"``: the model's own code, ``"<input>"``: the batch), which the
    loss and the gradients must not hold; at most ``max_flips`` decision flips (``task="classify"``); with
    ``fail_on_tolerance``, the model's output and the loss within ``rtol``/``atol`` (None: the dtype's default,
    float16 1e-3/1e-5, bfloat16 1e-2/1e-5); the autocast run's quality at most ``max_quality_drop`` worse than
    the reference's, and at least ``min_quality`` (at most, when lower is better).

    :meth:`sha256` hashes :meth:`canonical` (this JSON, keys sorted, no spaces): a rule changed after a failing
    run, a tolerance widened, has another hash.
    """

    task: str = "none"
    metric: str | None = None
    higher_is_better: bool | None = None  # None: the metric's own way (accuracy up, mse down)
    rtol: float | None = None
    atol: float | None = None
    fail_on_tolerance: bool = False
    max_flips: int = 0
    max_quality_drop: float | None = None
    min_quality: float | None = None
    allow_nonfinite: tuple[str, ...] = ()

    def canonical(self) -> str:
        import json

        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def sha256(self) -> str:
        import hashlib

        return hashlib.sha256(self.canonical().encode("utf-8")).hexdigest()

    def quality_text(self) -> str:
        """The quality clauses, or "" when there are none."""
        if self.metric is None:
            return ""
        parts = []
        if self.max_quality_drop is not None:
            parts.append(f"{self.metric} at most {self.max_quality_drop:g} worse than float32")
        if self.min_quality is not None:
            parts.append(f"{self.metric} {'at most' if self.higher_is_better is False else 'at least'} "
                         f"{self.min_quality:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Quality(JSONData):
    """The quality ``metric`` of both runs against the targets: ``ref`` (float32) and ``amp`` (autocast), over
    ``n`` samples. For ``"mse"`` also the largest |output - target| of each run. ``worse`` are the samples
    (indices, as :meth:`Comparison.sample` names them) the autocast run got wrong and the reference right
    (accuracy) or whose squared error grew most (mse, at most 5); a user metric names none."""

    metric: str = field(metadata=absent(""))
    higher_is_better: bool = True
    ref: float = math.nan
    amp: float = math.nan
    n: int = 0
    ref_max_error: float | None = None
    amp_max_error: float | None = None
    worse: tuple[int, ...] = ()

    def drop(self) -> float:
        """How much worse the autocast run is (negative: better)."""
        return self.ref - self.amp if self.higher_is_better else self.amp - self.ref


@dataclass(frozen=True)
class Failure(JSONData):
    """One clause of the rule that failed (``clause``, see :data:`CLAUSES`), why, and on which samples
    (``"file:index"`` in a set of batch files, the index alone for one batch)."""

    clause: str = field(metadata=absent(""))
    message: str = ""
    samples: tuple[str, ...] = ()


@dataclass(frozen=True)
class Speed(JSONData):
    """``--speed``: the plain step (``mode`` ``"train"``: forward, loss, backward; ``"eval"``: forward and loss
    without gradients) timed with no nanhunt hook, float32 and autocast interleaved ``repeats`` times over the
    whole set. ``ratio_*``: autocast time / float32 time per repetition (below 1: autocast is faster), its
    median and quartiles. Peak memory, per pass over the set (the largest batch): on CUDA the bytes allocated
    above the level before the batch; on CPU the growth of the process's peak resident set (Linux VmHWM, reset
    through /proc/self/clear_refs) above its resident size before the batch; None where it cannot be measured
    (``peak_memory`` says how, or why not). ``reason`` says why nothing was measured (a candidate that failed the rule is never timed)."""

    mode: str = "train"
    repeats: int = 0
    ref_median_s: float | None = None
    amp_median_s: float | None = None
    ratio_median: float | None = None
    ratio_q1: float | None = None
    ratio_q3: float | None = None
    ref_peak_bytes: int | None = None
    amp_peak_bytes: int | None = None
    reason: str = ""
    # How the peaks were measured ("cuda max_memory_allocated", "peak RSS growth (VmHWM)"), or why they were not
    # ("not measured: ..."); each peak comes from one extra pass per run after the timed ones.
    peak_memory: str = ""


@dataclass(frozen=True)
class Comparison(JSONData):
    """What ``nanhunt compare`` found: the acceptance rule, fixed before the run, and the result.

    The rule: the float32 reference is finite, the autocast run is finite, at most
    ``max_flips`` decisions change and, with ``fail_on_tolerance``, no element of the
    model's output or of the loss is out of tolerance (|amp - ref| > atol + rtol * |ref|).
    Otherwise the tolerances only rank modules and pick the near-boundary samples.
    ``accepted`` is whether the rule held; ``violations`` says why not, one line each.

    JSON (under the report's ``"comparison"`` key): the fields below; ``flipped`` and
    ``near_boundary`` are lists of sample indices; ``modules`` lists module calls in the
    order they started and ``ranking`` indexes into it, most introduced error first.
    ``reference_first_nonfinite`` / ``amp_first_nonfinite`` name where a run first went
    non-finite (``"module fc#0 (forward)"``, ``"loss"``, ``"gradient of fc.weight"``...).
    With a non-finite reference the autocast run is not made: nothing is compared and the
    comparison lists stay empty.

    ``acceptance`` is the rule as data (:class:`Rule`, with its quality and non-finite clauses)
    and ``rule_sha256`` its hash; ``failures`` name the clause each violation fails and its samples.
    On a set of batches, ``batches`` holds one comparison per batch (named by ``batch``) and the
    fields above are the totals (:meth:`sample` names a sample ``file:index``); with several
    autocast dtypes, ``alternatives`` holds the others', each against the same reference.
    """

    dtype: str = field(metadata=absent("float16"))
    device_type: str = field(metadata=absent("cpu"))
    rtol: float = field(metadata=absent(0.0))
    atol: float = field(metadata=absent(0.0))
    task: str = "none"
    max_flips: int = 0
    fail_on_tolerance: bool = False
    tie_rule: str = ""
    accepted: bool = True
    violations: tuple[str, ...] = ()
    reference_finite: bool = True
    reference_first_nonfinite: str | None = None
    amp_finite: bool | None = None  # None: not run (the reference was non-finite)
    amp_first_nonfinite: str | None = None
    ref_loss: float | None = None
    amp_loss: float | None = None
    modules: tuple[TensorDiff, ...] = ()
    ranking: tuple[int, ...] = ()
    output: TensorDiff | None = None
    loss: TensorDiff | None = None
    grads: tuple[TensorDiff, ...] = ()
    n_samples: int = 0
    flipped: tuple[int, ...] = ()
    near_boundary: tuple[int, ...] = ()
    # Samples whose autocast output holds a NaN/Inf where the reference's is finite: no decision, never a flip.
    nonfinite: tuple[int, ...] = ()
    decisions: tuple[Decision, ...] = ()  # the flipped, non-finite and near-boundary samples, by index
    regression: Regression | None = None
    unmatched: tuple[str, ...] = ()  # module calls or gradients present in one run only
    # The rule as data and the sha256 of its canonical JSON (absent from reports written before them).
    acceptance: Rule | None = None
    rule_sha256: str = ""
    # The same checkpoint compared earlier under another rule that failed (``nanhunt compare --report``'s
    # history): one line each, "the rule changed after a failing run (was <hash> failing clause X, now <hash>)".
    rule_warnings: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = ()  # the failed clauses, one per violation, in the same order
    quality: Quality | None = None
    allowed: tuple[str, ...] = ()  # non-finite values the rule allowed: where, in which run
    # Non-finite values a finite autocast run made and absorbed before the loss and the gradients (its silent
    # origins, op level): which run, then "Inf born in phase forward, module norm (RMSNorm, call 0), op aten::pow,
    # at file:line in function: <the line>". Written to JSON only when there is one.
    absorbed: tuple[str, ...] = ()
    batch: str = ""  # the batch's name (its file) in a set
    # A set of batches: one comparison each, in order (the rule applied to that batch alone); the fields above
    # are then the totals: errors the largest over the batches, samples numbered across the set.
    batches: tuple[Comparison, ...] = ()
    # The other autocast dtypes run against the same reference under the same rule, in the order given.
    alternatives: tuple[Comparison, ...] = ()
    speed: Speed | None = None

    def candidates(self) -> tuple[Comparison, ...]:
        """Every autocast dtype compared: this one and its alternatives."""
        return (self, *self.alternatives)

    def sample(self, i: int) -> str:
        """Sample ``i`` by name: ``"file:index"`` in a set (``i`` counts across it) or in a named batch, else ``"i"``."""
        if self.batches:
            for b in self.batches:
                if i < b.n_samples:
                    return b.sample(i)
                i -= b.n_samples
        return f"{self.batch}:{i}" if self.batch else str(i)

    def rule_text(self) -> str:
        """The acceptance rule in one sentence, printed with every result."""
        runs = self.candidates()
        dtypes = f"{self.dtype}" if len(runs) == 1 else f"({', '.join(r.dtype for r in runs)})"
        parts = ["float32 reference finite", f"autocast {dtypes} run finite"]
        rule = self.acceptance
        if rule is not None and rule.allow_nonfinite:
            parts[-1] += (f" but for values introduced inside {', '.join(rule.allow_nonfinite)} "
                          "(never in the loss or a gradient)")
        if self.task == "classify":
            parts.append(f"at most {self.max_flips} decision flip{'s' if self.max_flips != 1 else ''}")
        if rule is not None and rule.quality_text():
            parts.append(rule.quality_text())
        tols = list(dict.fromkeys(f"rtol={r.rtol:g} atol={r.atol:g}" for r in runs))
        tol = tols[0] if len(tols) == 1 else ", ".join(f"{r.dtype} rtol={r.rtol:g} atol={r.atol:g}" for r in runs)
        if self.fail_on_tolerance:
            parts.append(f"output and loss within {tol}")
            tail = ""
        else:
            tail = f"; tolerance {tol} ranks modules and marks near-boundary samples, does not fail"
        if self.task == "classify" and self.tie_rule:
            tail += f"; ties: {self.tie_rule}"
        return ", ".join(parts) + tail

    def to_dict(self) -> dict[str, Any]:
        items = [(k, v) for k, v in _serial.to_dict(self).items() if k != "absorbed" or v]
        at = [k for k, _ in items].index("tie_rule") + 1
        return dict(items[:at] + [("rule", self.rule_text())] + items[at:])  # written for readers; never read


@dataclass(frozen=True)
class GuardEvent(JSONData):
    """One detection of :class:`nanhunt.Guard`: what went wrong, at which step, and where the capture is.

    ``step`` is the guard's 0-based iteration index. ``ranks`` are the ranks whose
    check saw it at that step (the first to see it); ``rank`` is this process's
    rank (both empty/None outside ``torch.distributed``). ``captured_step`` is the
    step whose starting state the capture holds: the failing step itself, or an
    earlier last-good snapshot. ``pre_update`` is True when the capture's weights
    are those the failing step started from.

    :meth:`nanhunt.Guard.rollback` appends events of two more kinds. ``"rollback"``: the detection of ``step``
    (its ``detail`` and capture) was undone, back to the state ``restored_step`` began with, ``rollbacks`` so
    far; or, with ``rollback_error``, it could not be. ``"change"``: ``changes`` of policy made before the
    loop resumed at ``step`` (a float32 region, the autocast dtype, a note), an experiment to judge, not a fix.
    ``updates`` and ``skipped`` are then the counters after the rollback.
    """

    step: int
    kind: str  # "loss", "grads", "params" or "skips"; "rollback" or "change"
    detail: str
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    checkpoint: str | None = None
    batch: str | None = None
    captured_step: int | None = None
    pre_update: bool = False
    capture_error: str | None = None
    iterations: int = 0
    updates: int = 0
    skipped: int = 0
    scale: float | None = None
    # what `nanhunt replay` needs besides the two files to work as printed: --model / --loss confirmations of
    # the user's own code, and notes for names no flag confirms (defined in a notebook)
    replay_args: tuple[str, ...] = ()
    replay_notes: tuple[str, ...] = ()
    restored_step: int | None = None  # "rollback": the step whose starting state was restored
    changes: tuple[str, ...] = ()  # "rollback", "change": changes of policy recorded before resuming
    rollbacks: int = 0  # "rollback": rollbacks done so far, this one included
    rollback_error: str | None = None  # "rollback": why it was refused (nothing was restored)

    def replay_command(self) -> str | None:
        """``nanhunt replay CKPT BATCH [--model ...] [--loss ...]``, quoted for a POSIX shell; None without a capture.
        A capture directory (FSDP2: ``batch`` is None) is replayed alone: ``nanhunt replay DIR``."""
        if not self.checkpoint:
            return None
        files = (self.checkpoint,) if self.batch is None else (self.checkpoint, self.batch)
        return " ".join(shlex.quote(a) for a in ("nanhunt", "replay", *files, *self.replay_args))

    def describe(self) -> str:
        where = f"step {self.step}"
        if self.rank is not None:
            seen = ", ".join(map(str, self.ranks)) or "none"
            where += f" (rank {self.rank}; seen first by rank(s) {seen})"
        if self.kind == "change":
            return f"nanhunt.Guard: change of policy before {where} (an experiment): {'; '.join(self.changes)}"
        text = f"nanhunt.Guard: {self.detail} at {where}"
        if self.kind == "rollback":
            if self.rollback_error is not None:
                text += f"; cannot roll back: {self.rollback_error}"
            else:
                first = self.step if self.restored_step is None else self.restored_step
                undone = f"step {first}" if first == self.step else f"steps {first} to {self.step}"
                text += (f"; rolled back (#{self.rollbacks}) to the state step {first} began with, "
                         f"{undone} undone and skipped")
                if self.changes:
                    text += f"; changes before resuming (an experiment): {'; '.join(self.changes)}"
            if self.checkpoint:
                text += f"; capture: {self.replay_command()}"
            return text
        if self.checkpoint:
            what = "the pre-update state"
            if self.captured_step is not None and self.captured_step != self.step:
                what = f"the last good snapshot (start of step {self.captured_step}"
                what += ", before the update that wrote them)" if self.pre_update else f"; re-run to step {self.step})"
            elif not self.pre_update:
                what = "the state with the weights already non-finite (pass snapshot_every=1 for the state before)"
            text += f"; capture of {what}: {self.replay_command()}"
            text += "".join(f" ({n})" for n in self.replay_notes)
        elif self.capture_error:
            text += f"; no capture: {self.capture_error}"
        return text


_serial.prepare(JSONData.__subclasses__())  # every class above, resolved once at import
