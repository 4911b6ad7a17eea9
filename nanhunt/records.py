"""Plain result data: phases, per-tensor records, occurrences.

Nothing here imports torch or another nanhunt module, so reports can be read,
written and rendered without a model in sight.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["SCHEMA_VERSION", "Phase", "Role", "FullStats", "Record", "Occurrence", "Report", "TensorSummary", "Inspection", "Verdict", "Repro", "PHASE_ORDER",
           "TensorDiff", "Decision", "Regression", "Comparison", "RangeStats", "RecordView"]

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
    STATE = "state"  # optimizer or other long-lived state first seen in the update
    REMEASURED = "remeasured"  # a known tensor measured again after an in-place change or view write

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FullStats:
    """The expensive statistics, computed only for the tensors that matter."""

    nan: int
    posinf: int
    neginf: int
    zeros: int
    numel: int
    min_nonzero_abs: float | None  # smallest non-zero finite magnitude; None when there is none
    over_fp16: int  # finite values with |x| > 65504
    over_bf16: int  # finite values with |x| > bfloat16 max
    subnormal: int  # non-zero values below the smallest normal of the tensor's dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FullStats:
        return cls(
            nan=int(d.get("nan", 0)),
            posinf=int(d.get("posinf", 0)),
            neginf=int(d.get("neginf", 0)),
            zeros=int(d.get("zeros", 0)),
            numel=int(d.get("numel", 0)),
            min_nonzero_abs=_opt_float(d.get("min_nonzero_abs")),
            over_fp16=int(d.get("over_fp16", 0)),
            over_bf16=int(d.get("over_bf16", 0)),
            subnormal=int(d.get("subnormal", 0)),
        )


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
class Record(RangeStats):
    """Statistics of one floating tensor seen at one point of the step.

    ``min``/``max`` come from one on-device ``aminmax``: both are NaN when the
    tensor holds a NaN, and an Inf shows up in one of them. ``inputs`` are the
    indices of the records this one was computed from (the dataflow edges).
    """

    index: int
    phase: Phase
    module: str | None
    call_index: int
    op: str | None
    role: Role
    dtype: str
    shape: tuple[int, ...]
    min: float
    max: float
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phase"] = self.phase.value
        d["role"] = self.role.value
        d["shape"] = list(self.shape)
        d["inputs"] = list(self.inputs)
        d["min"] = _json_float(self.min)
        d["max"] = _json_float(self.max)
        d["full"] = None if self.full is None else self.full.to_dict()
        d["input_shapes"] = None if self.input_shapes is None else [list(x) for x in self.input_shapes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        full = d.get("full")
        return cls(
            index=int(d["index"]),
            phase=Phase(d["phase"]),
            module=d.get("module"),
            call_index=int(d.get("call_index", 0)),
            op=d.get("op"),
            role=Role(d.get("role", "output")),
            dtype=str(d.get("dtype", "")),
            shape=tuple(int(s) for s in d.get("shape", ())),
            min=_from_json_float(d.get("min")),
            max=_from_json_float(d.get("max")),
            inputs=tuple(int(i) for i in d.get("inputs", ())),
            source=d.get("source"),
            nonfinite_scalar=d.get("nonfinite_scalar"),
            full=None if full is None else FullStats.from_dict(full),
            input_shapes=None if d.get("input_shapes") is None else tuple(
                tuple(int(n) for n in x) for x in d["input_shapes"]),
        )


@dataclass(frozen=True)
class Occurrence:
    """Where the first non-finite value of a step was born.

    ``kind`` is ``"nan"`` or ``"inf"``. ``output`` is the record of the value
    that went non-finite; ``inputs`` the records of the op's tensor inputs.
    ``reached`` says whether the value got to the loss or the gradients;
    ``silent`` is True when later ops absorbed it.
    """

    phase: Phase
    module: str | None
    module_class: str | None
    call_index: int
    op: str | None
    kind: str
    source: str | None
    output: Record
    inputs: tuple[Record, ...] = ()
    reached: tuple[str, ...] | None = ()  # None: not measured (stop_at_first stops before)
    allowed: bool = False
    path: tuple[int, ...] = field(default=())
    harmless: bool = False  # its values fed only integer / index / boolean results (never the culprit)
    absorbed: tuple[int, ...] = ()  # the first finite records that took its non-finite values in

    @property
    def silent(self) -> bool:
        return self.reached == ()

    def describe(self) -> str:
        where = "outside the model" if self.module is None else f"module {self.module or '<root>'!s}"
        if self.module is not None and self.module_class:
            where += f" ({self.module_class}, call {self.call_index})"
        op = f"op {self.op}" if self.op else f"role {self.output.role.value}"
        what = "NaN" if self.kind == "nan" else "Inf"
        tail = (" [harmless: it fed only integer / index / boolean results]" if self.harmless else
                " [silent: absorbed before the loss and gradients]" if self.silent else "")
        return f"{what} born in phase {self.phase.value}, {where}, {op}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "module": self.module,
            "module_class": self.module_class,
            "call_index": self.call_index,
            "op": self.op,
            "kind": self.kind,
            "source": self.source,
            "output": self.output.to_dict(),
            "inputs": [r.to_dict() for r in self.inputs],
            "reached": None if self.reached is None else list(self.reached),
            "allowed": self.allowed,
            "path": list(self.path),
            "harmless": self.harmless,
            "absorbed": list(self.absorbed),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Occurrence:
        return cls(
            phase=Phase(d["phase"]),
            module=d.get("module"),
            module_class=d.get("module_class"),
            call_index=int(d.get("call_index", 0)),
            op=d.get("op"),
            kind=str(d.get("kind", "nan")),
            source=d.get("source"),
            output=Record.from_dict(d["output"]),
            inputs=tuple(Record.from_dict(r) for r in d.get("inputs", ())),
            reached=None if d.get("reached", ()) is None else tuple(d.get("reached", ())),
            allowed=bool(d.get("allowed", False)),
            path=tuple(int(i) for i in d.get("path", ())),
            harmless=bool(d.get("harmless", False)),
            absorbed=tuple(int(i) for i in d.get("absorbed", ())),
        )


def _json_float(x: float) -> float | str:
    # JSON has no NaN/Inf: keep them as strings so the files stay strict JSON.
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _json_floats(obj: Any) -> Any:
    """``obj`` (dicts, lists, scalars) with every non-finite float kept as a string, as above."""
    if isinstance(obj, float):
        return _json_float(obj)
    if isinstance(obj, dict):
        return {k: _json_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_floats(v) for v in obj]
    return obj


def _from_json_float(x: Any) -> float:
    if x is None:
        return math.nan
    return float(x)


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class Report:
    """Everything one replay found, as plain data; renderers only format it.

    ``status`` is ``"clean"`` (the step stayed finite), ``"nonfinite"`` or
    ``"not-reproducible"`` (two replays of the same step disagreed).

    JSON layout (``to_json``; key names are stable, numbers stay numbers, and
    NaN/Inf are the strings ``"nan"``/``"inf"``/``"-inf"`` so files are strict
    JSON): ``schema_version``, ``status``, ``first`` (an occurrence or null),
    ``origins``, ``path`` (records), ``runs``, ``loss``, ``config`` (dtype,
    device_type, level, train, loss_fn, optimizer, scaler_scale,
    scaler_growth_tracker, grads_finite, scaler_would_skip), ``modules``
    (module -> "finite" / "nan in backward" ...), ``module_classes``,
    ``environment``, ``command``, ``notes``, ``n_records``, ``verdict``,
    ``timeline`` (``[index, phase, max |x| or "nan", "finite"|"nan"|"inf"]``
    per record) and, from version 2, ``repro``. An occurrence holds ``phase``,
    ``module``, ``module_class``, ``call_index``, ``op``, ``kind``, ``source``,
    ``output`` and ``inputs`` (records), ``reached``, ``allowed``, ``path``; a
    record the fields of :class:`Record`.
    """

    status: str
    first: Occurrence | None
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "status": self.status,
            "first": None if self.first is None else self.first.to_dict(),
            "origins": [o.to_dict() for o in self.origins],
            "path": [r.to_dict() for r in self.path],
            "runs": [None if o is None else o.to_dict() for o in self.runs],
            "loss": None if self.loss is None else _json_float(self.loss),
            "config": _json_floats(self.config),
            "modules": dict(self.modules),
            "module_classes": dict(self.module_classes),
            "environment": dict(self.environment),
            "command": self.command,
            "notes": list(self.notes),
            "n_records": self.n_records,
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "timeline": [[i, ph, _json_float(m), k] for i, ph, m, k in self.timeline],
            "repro": None if self.repro is None else self.repro.to_dict(),
        } | ({} if self.comparison is None else {"comparison": self.comparison.to_dict()})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        def occ(x: Any) -> Occurrence | None:
            return None if x is None else Occurrence.from_dict(x)

        loss = d.get("loss")
        return cls(
            status=str(d.get("status", "clean")),
            first=occ(d.get("first")),
            origins=tuple(o for o in (occ(x) for x in d.get("origins", ())) if o is not None),
            path=tuple(Record.from_dict(r) for r in d.get("path", ())),
            runs=tuple(occ(x) for x in d.get("runs", ())),
            loss=None if loss is None else float(loss),
            config=dict(d.get("config", {})),
            modules=dict(d.get("modules", {})),
            module_classes=dict(d.get("module_classes", {})),
            environment=dict(d.get("environment", {})),
            command=d.get("command"),
            notes=tuple(d.get("notes", ())),
            n_records=int(d.get("n_records", 0)),
            verdict=None if d.get("verdict") is None else Verdict.from_dict(d["verdict"]),
            timeline=tuple((int(i), str(ph), _from_json_float(m), str(k)) for i, ph, m, k in d.get("timeline", ())),
            repro=None if d.get("repro") is None else Repro.from_dict(d["repro"]),
            comparison=None if d.get("comparison") is None else Comparison.from_dict(d["comparison"]),
            # Read in any older layout, held in the current one: written back, it is a current file.
            schema_version=SCHEMA_VERSION,
        )

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

    @property
    def fp16_headroom(self) -> float:
        return math.inf if self.absmax == 0 else 65504.0 / self.absmax


@dataclass(frozen=True)
class Inspection:
    """What ``nanhunt inspect`` found in a checkpoint."""

    path: str
    n_tensors: int
    flagged: tuple[TensorSummary, ...]  # non-finite, or within 16x of the float16 max
    scaler: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def scaler_nonfinite(self) -> bool:
        """The GradScaler's saved scale is NaN or Inf (every later step scales by it)."""
        s = self.scaler.get("scale")
        return isinstance(s, (int, float)) and not math.isfinite(s)

    @property
    def nonfinite(self) -> bool:
        return self.scaler_nonfinite or any(t.nan or t.inf for t in self.flagged)


@dataclass(frozen=True)
class Verdict:
    """What the float32 bisection proved.

    ``kind``: ``precision`` (``culprits`` in float32 make the step finite),
    ``not-precision`` (it fails in float32 too), ``scale-induced`` (only the loss
    scale overflows the gradients), ``not-reproducible``, ``clean``, ``interrupted``
    (Ctrl-C before any culprit was found; ``interrupted`` is also set on a partial
    ``precision`` verdict).
    """

    kind: str
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["culprits"] = list(self.culprits)
        d["corrupted"] = list(self.corrupted)
        d["float32_first"] = None if self.float32_first is None else self.float32_first.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        f = d.get("float32_first")
        return cls(
            kind=str(d.get("kind", "clean")),
            culprits=tuple(d.get("culprits", ())),
            origin_alone_fixes=d.get("origin_alone_fixes"),
            confirmed=bool(d.get("confirmed", False)),
            replays=int(d.get("replays", 0)),
            seconds=float(d.get("seconds", 0.0)),
            alternatives={str(k): bool(v) for k, v in d.get("alternatives", {}).items()},
            fix=d.get("fix"),
            float32_first=None if f is None else Occurrence.from_dict(f),
            interrupted=bool(d.get("interrupted", False)),
            candidates=int(d.get("candidates", 0)),
            silent=bool(d.get("silent", False)),
            corrupted=tuple(str(c) for c in d.get("corrupted", ())),
        )


@dataclass(frozen=True)
class Repro:
    """The origin op alone: its saved inputs and a standalone ``repro.py`` (needs only torch).

    ``call`` is the op call as the script writes it; ``inputs`` the ``(dtype,
    shape)`` of each saved tensor. ``sliced`` says the inputs were narrowed to
    fit the size cap (``original_shapes`` were the shapes as the op ran).
    ``verified`` is True only when a fresh Python process ran the script and its
    output was non-finite of the same kind; ``result`` is what that run printed.
    """

    op: str
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "overload": self.overload,
            "device_type": self.device_type,
            "autocast_dtype": self.autocast_dtype,
            "inputs": [[dt, list(shape)] for dt, shape in self.inputs],
            "call": self.call,
            "nbytes": self.nbytes,
            "sliced": self.sliced,
            "original_shapes": [list(s) for s in self.original_shapes],
            "files": list(self.files),
            "verified": self.verified,
            "result": self.result,
            "command": self.command,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Repro:
        return cls(
            op=str(d.get("op", "")),
            overload=str(d.get("overload", "default")),
            device_type=str(d.get("device_type", "cpu")),
            autocast_dtype=d.get("autocast_dtype"),
            inputs=tuple((str(dt), tuple(int(x) for x in shape)) for dt, shape in d.get("inputs", ())),
            call=str(d.get("call", "")),
            nbytes=int(d.get("nbytes", 0)),
            sliced=bool(d.get("sliced", False)),
            original_shapes=tuple(tuple(int(x) for x in s) for s in d.get("original_shapes", ())),
            files=tuple(str(f) for f in d.get("files", ())),
            verified=bool(d.get("verified", False)),
            result=str(d.get("result", "")),
            command=str(d.get("command", "python repro.py")),
        )


def _opt_json_float(x: float | None) -> float | str | None:
    return None if x is None else _json_float(x)


def _opt_from_json_float(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class TensorDiff:
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

    name: str
    kind: str
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        for k in ("max_abs", "max_rel", "scaled", "out_of_tol", "ref_absmax"):
            d[k] = _json_float(getattr(self, k))
        for k in ("headroom", "input_scaled", "introduced"):
            d[k] = _opt_json_float(getattr(self, k))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorDiff:
        return cls(
            name=str(d.get("name", "")),
            kind=str(d.get("kind", "module")),
            call_index=int(d.get("call_index", 0)),
            module_class=d.get("module_class"),
            dtype=str(d.get("dtype", "")),
            shape=tuple(int(s) for s in d.get("shape", ())),
            numel=int(d.get("numel", 0)),
            max_abs=float(d.get("max_abs", 0.0)),
            max_rel=float(d.get("max_rel", 0.0)),
            scaled=float(d.get("scaled", 0.0)),
            out_of_tol=float(d.get("out_of_tol", 0.0)),
            headroom=_opt_from_json_float(d.get("headroom")),
            underflow=int(d.get("underflow", 0)),
            ref_nonfinite=int(d.get("ref_nonfinite", 0)),
            amp_nonfinite=int(d.get("amp_nonfinite", 0)),
            ref_absmax=float(d.get("ref_absmax", 0.0)),
            input_scaled=_opt_from_json_float(d.get("input_scaled")),
            introduced=_opt_from_json_float(d.get("introduced")),
            depth=int(d.get("depth", 0)),
        )


@dataclass(frozen=True)
class Decision:
    """The top-1 class of one sample in both runs. ``-1``: no decision (the scores hold a NaN).

    Margins are top-1 minus top-2 score in each run (inf with one class)."""

    index: int
    ref_class: int
    amp_class: int
    ref_runner_up: int
    ref_margin: float
    amp_margin: float
    ref_score: float
    amp_score: float
    flipped: bool
    near_boundary: bool

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("ref_margin", "amp_margin", "ref_score", "amp_score"):
            d[k] = _json_float(getattr(self, k))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        return cls(
            index=int(d["index"]),
            ref_class=int(d.get("ref_class", -1)),
            amp_class=int(d.get("amp_class", -1)),
            ref_runner_up=int(d.get("ref_runner_up", -1)),
            ref_margin=_from_json_float(d.get("ref_margin")),
            amp_margin=_from_json_float(d.get("amp_margin")),
            ref_score=_from_json_float(d.get("ref_score")),
            amp_score=_from_json_float(d.get("amp_score")),
            flipped=bool(d.get("flipped", False)),
            near_boundary=bool(d.get("near_boundary", False)),
        )


@dataclass(frozen=True)
class Regression:
    """``--task regress``: the output's error per sample and its extreme values in both runs."""

    ref_min: float
    ref_max: float
    amp_min: float
    amp_max: float
    worst: tuple[tuple[int, float], ...] = ()  # (sample, max |amp - ref| in it), largest first

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref_min": _json_float(self.ref_min),
            "ref_max": _json_float(self.ref_max),
            "amp_min": _json_float(self.amp_min),
            "amp_max": _json_float(self.amp_max),
            "worst": [[i, _json_float(e)] for i, e in self.worst],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Regression:
        return cls(
            ref_min=_from_json_float(d.get("ref_min")),
            ref_max=_from_json_float(d.get("ref_max")),
            amp_min=_from_json_float(d.get("amp_min")),
            amp_max=_from_json_float(d.get("amp_max")),
            worst=tuple((int(i), _from_json_float(e)) for i, e in d.get("worst", ())),
        )


@dataclass(frozen=True)
class Comparison:
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
    """

    dtype: str
    device_type: str
    rtol: float
    atol: float
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
    decisions: tuple[Decision, ...] = ()  # the flipped and near-boundary samples, by index
    regression: Regression | None = None
    unmatched: tuple[str, ...] = ()  # module calls or gradients present in one run only

    def rule_text(self) -> str:
        """The acceptance rule in one sentence, printed with every result."""
        parts = ["float32 reference finite", f"autocast {self.dtype} run finite"]
        if self.task == "classify":
            parts.append(f"at most {self.max_flips} decision flip{'s' if self.max_flips != 1 else ''}")
        tol = f"rtol={self.rtol:g} atol={self.atol:g}"
        if self.fail_on_tolerance:
            parts.append(f"output and loss within {tol}")
            tail = ""
        else:
            tail = f"; tolerance {tol} ranks modules and marks near-boundary samples, does not fail"
        if self.task == "classify" and self.tie_rule:
            tail += f"; ties: {self.tie_rule}"
        return ", ".join(parts) + tail

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "device_type": self.device_type,
            "rtol": self.rtol,
            "atol": self.atol,
            "task": self.task,
            "max_flips": self.max_flips,
            "fail_on_tolerance": self.fail_on_tolerance,
            "tie_rule": self.tie_rule,
            "rule": self.rule_text(),
            "accepted": self.accepted,
            "violations": list(self.violations),
            "reference_finite": self.reference_finite,
            "reference_first_nonfinite": self.reference_first_nonfinite,
            "amp_finite": self.amp_finite,
            "amp_first_nonfinite": self.amp_first_nonfinite,
            "ref_loss": _opt_json_float(self.ref_loss),
            "amp_loss": _opt_json_float(self.amp_loss),
            "modules": [m.to_dict() for m in self.modules],
            "ranking": list(self.ranking),
            "output": None if self.output is None else self.output.to_dict(),
            "loss": None if self.loss is None else self.loss.to_dict(),
            "grads": [g.to_dict() for g in self.grads],
            "n_samples": self.n_samples,
            "flipped": list(self.flipped),
            "near_boundary": list(self.near_boundary),
            "decisions": [x.to_dict() for x in self.decisions],
            "regression": None if self.regression is None else self.regression.to_dict(),
            "unmatched": list(self.unmatched),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Comparison:
        def diff(x: Any) -> TensorDiff | None:
            return None if x is None else TensorDiff.from_dict(x)

        amp_finite = d.get("amp_finite")
        return cls(
            dtype=str(d.get("dtype", "float16")),
            device_type=str(d.get("device_type", "cpu")),
            rtol=float(d.get("rtol", 0.0)),
            atol=float(d.get("atol", 0.0)),
            task=str(d.get("task", "none")),
            max_flips=int(d.get("max_flips", 0)),
            fail_on_tolerance=bool(d.get("fail_on_tolerance", False)),
            tie_rule=str(d.get("tie_rule", "")),
            accepted=bool(d.get("accepted", True)),
            violations=tuple(str(v) for v in d.get("violations", ())),
            reference_finite=bool(d.get("reference_finite", True)),
            reference_first_nonfinite=d.get("reference_first_nonfinite"),
            amp_finite=None if amp_finite is None else bool(amp_finite),
            amp_first_nonfinite=d.get("amp_first_nonfinite"),
            ref_loss=_opt_from_json_float(d.get("ref_loss")),
            amp_loss=_opt_from_json_float(d.get("amp_loss")),
            modules=tuple(TensorDiff.from_dict(m) for m in d.get("modules", ())),
            ranking=tuple(int(i) for i in d.get("ranking", ())),
            output=diff(d.get("output")),
            loss=diff(d.get("loss")),
            grads=tuple(TensorDiff.from_dict(g) for g in d.get("grads", ())),
            n_samples=int(d.get("n_samples", 0)),
            flipped=tuple(int(i) for i in d.get("flipped", ())),
            near_boundary=tuple(int(i) for i in d.get("near_boundary", ())),
            decisions=tuple(Decision.from_dict(x) for x in d.get("decisions", ())),
            regression=None if d.get("regression") is None else Regression.from_dict(d["regression"]),
            unmatched=tuple(str(u) for u in d.get("unmatched", ())),
        )
