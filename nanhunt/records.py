"""Plain result data: phases, per-tensor records, occurrences.

Nothing here imports torch or another nanhunt module, so reports can be read,
written and rendered without a model in sight.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SCHEMA_VERSION", "Phase", "Role", "FullStats", "Record", "Occurrence", "Report", "TensorSummary", "Inspection", "Verdict", "PHASE_ORDER"]

SCHEMA_VERSION = 1


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


@dataclass(frozen=True)
class Record:
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

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

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

    @property
    def silent(self) -> bool:
        return self.reached == ()

    def describe(self) -> str:
        where = "outside the model" if self.module is None else f"module {self.module or '<root>'!s}"
        if self.module is not None and self.module_class:
            where += f" ({self.module_class}, call {self.call_index})"
        op = f"op {self.op}" if self.op else f"role {self.output.role.value}"
        what = "NaN" if self.kind == "nan" else "Inf"
        tail = " [silent: absorbed before the loss and gradients]" if self.silent else ""
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
        )


def _json_float(x: float) -> float | str:
    # JSON has no NaN/Inf: keep them as strings so the files stay strict JSON.
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


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
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "status": self.status,
            "first": None if self.first is None else self.first.to_dict(),
            "origins": [o.to_dict() for o in self.origins],
            "path": [r.to_dict() for r in self.path],
            "runs": [None if o is None else o.to_dict() for o in self.runs],
            "loss": None if self.loss is None else _json_float(self.loss),
            "config": dict(self.config),
            "modules": dict(self.modules),
            "module_classes": dict(self.module_classes),
            "environment": dict(self.environment),
            "command": self.command,
            "notes": list(self.notes),
            "n_records": self.n_records,
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "timeline": [[i, ph, _json_float(m), k] for i, ph, m, k in self.timeline],
        }

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
            schema_version=int(d.get("schema_version", 1)),
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
    def nonfinite(self) -> bool:
        return any(t.nan or t.inf for t in self.flagged)


@dataclass(frozen=True)
class Verdict:
    """What the float32 bisection proved.

    ``kind``: ``precision`` (``culprits`` in float32 make the step finite),
    ``not-precision`` (it fails in float32 too), ``scale-induced`` (only the loss
    scale overflows the gradients), ``not-reproducible``, ``clean``.
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["culprits"] = list(self.culprits)
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
        )
