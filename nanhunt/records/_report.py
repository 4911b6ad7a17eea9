"""A replay's report: its advice, verdict, repro, and what ``nanhunt inspect`` reads."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypedDict

from . import _serial
from ._serial import JSONData, absent
from ._comparison import Comparison
from ._guard import GuardEvent, HeadroomHistory
from ._trace import DTYPE_MAX, Occurrence, Record, TextEnum


# Version 1: the first released layout. Version 2 adds ``Report.repro`` (a :class:`Repro` or null).
# ``Report.from_dict`` reads every older version: a missing key takes its default.
SCHEMA_VERSION = 2


class Status(TextEnum):
    """A report's outcome: a replay's (see :class:`Report`) or a comparison's (``nanhunt compare``)."""

    CLEAN = "clean"
    NONFINITE = "nonfinite"
    NOT_REPRODUCIBLE = "not-reproducible"
    COMPILE_INDUCED = "compile-induced"
    REFERENCE_NONFINITE = "reference-nonfinite"  # compare: the float32 reference itself went non-finite
    DIVERGED = "diverged"  # compare: both runs finite, another clause of the rule failed


class VerdictKind(TextEnum):
    """What the float32 bisection proved (see :class:`Verdict`)."""

    PRECISION = "precision"
    NOT_PRECISION = "not-precision"
    SCALE_INDUCED = "scale-induced"
    COMPILE_INDUCED = "compile-induced"
    FLOAT8_INDUCED = "float8-induced"
    NOT_REPRODUCIBLE = "not-reproducible"
    CLEAN = "clean"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Advice(JSONData):
    """A fix beyond float32 for a known pattern (:mod:`nanhunt.hunt.advice`): ``pattern`` its id, ``advice`` one
    line, ``fix`` the idiomatic code as a short snippet, ``because`` the measurement of this run that
    triggered it (op, kind, phase, dtype, the inputs' values, the scaler, the optimizer's eps)."""

    pattern: str = field(metadata=absent(""))
    advice: str = ""
    fix: str = ""
    because: str = ""


class BackwardUnderflow(TypedDict):
    """``ReportConfig.fp16_backward_underflow``: ``tensors`` float16 tensors of the backward lie wholly below
    float16's smallest normal, ``of`` those the backward holds; ``largest`` the largest |x| among them, ``at``
    where it is."""

    tensors: int
    of: int
    largest: float
    at: str


class OptimizerSettings(TypedDict, total=False):
    """``ReportConfig.optimizer_settings``: the optimizer's class, how many parameter groups it has, and its
    hyper-parameters (``lr``, ``weight_decay``, ``momentum``, ``betas``, ``eps``...) as the step began: one value
    when every group holds the same, else the list of each group's."""

    optimizer: str
    groups: int
    hyper: dict[str, Any]


class LastUpdate(TypedDict):
    """``ReportConfig.last_update``: the optimizer's last update before the step, measured from its state
    (``how``: which state, e.g. Adam's moments): ``ratio`` the largest ``||update|| / ||weight||`` over the
    ``params`` parameters it could tell, at the parameter ``at``, and their ``median``."""

    ratio: float
    at: str
    median: float
    params: int
    how: str


class ReportConfig(TypedDict, total=False):
    """``Report.config``: what the step ran with and a few measurements of it, each key present only when its
    writer set it (a plain dict at run time, written in the order it was filled).

    Written by a replay (``nanhunt.hunt``): ``dtype``, ``device_type``, ``level``, ``train``, ``loss_fn`` and
    ``optimizer`` (their class names), with a GradScaler ``scaler_scale`` and ``scaler_growth_tracker`` (None:
    disabled); after it, ``grads_finite``, ``scaler_would_skip`` (with a GradScaler), ``optimizer_eps`` (the
    smallest eps of its groups), ``optimizer_settings`` and ``last_update`` (its hyper-parameters and the size of its
    last update, :mod:`nanhunt.hunt._update`), ``fp16_backward_underflow`` and, for a compiled model, ``compiled_rungs``
    (backend -> ``"1/2 non-finite"`` or ``"could not run"``). Written by ``nanhunt compare``: ``dtype`` (the
    compared dtypes, comma-separated), ``device_type``, ``train``, ``loss_fn``, ``scaler_scale`` and its rule's
    ``task``, ``rtol``, ``atol``, ``max_flips``, ``fail_on_tolerance``, ``metric``, with ``batches`` and
    ``speed_repeats`` (None: a single batch, no timing)."""

    dtype: str
    device_type: str
    level: str  # a records.Level's value
    train: bool
    loss_fn: str | None
    optimizer: str | None
    scaler_scale: float | None
    scaler_growth_tracker: int | None
    grads_finite: bool
    scaler_would_skip: bool
    optimizer_eps: float
    optimizer_settings: OptimizerSettings
    last_update: LastUpdate
    fp16_backward_underflow: BackwardUnderflow
    compiled_rungs: dict[str, str]
    task: str
    rtol: float | None
    atol: float | None
    max_flips: int
    fail_on_tolerance: bool
    metric: str | None
    batches: int | None
    speed_repeats: int | None


@dataclass(frozen=True)
class Report(JSONData):
    """Everything one replay found, as plain data; renderers only format it.

    ``status`` (a :class:`Status`) is ``"clean"`` (the step stayed finite), ``"nonfinite"``,
    ``"not-reproducible"`` (two replays of the same step disagreed, or a Guard's capture
    whose event says the step failed replayed finite: see :class:`Verdict`) or
    ``"compile-induced"`` (a compiled model's step finite eager, non-finite compiled).

    JSON layout (``to_json``; key names are stable, numbers stay numbers, and
    NaN/Inf are the strings ``"nan"``/``"inf"``/``"-inf"`` so files are strict
    JSON): ``schema_version``, ``status``, ``first`` (an occurrence or null),
    ``origins``, ``path`` (records), ``runs``, ``loss``, ``config`` (a
    :class:`ReportConfig`: dtype, device_type, level, train, loss_fn, optimizer,
    scaler_scale, scaler_growth_tracker, grads_finite, scaler_would_skip ...), ``modules``
    (module -> "finite" / "nan in backward" ...), ``module_classes``,
    ``environment``, ``command``, ``notes``, ``n_records``, ``verdict``,
    ``timeline`` (``[index, phase, max |x| or "nan", "finite"|"nan"|"inf"]``
    per record) and, from version 2, ``repro``; ``advice``, ``guard_event`` and ``headroom`` only
    when present (optional keys: an older file without them reads as none). An
    occurrence holds ``phase``, ``module``, ``module_class``, ``call_index``, ``op``,
    ``kind``, ``source``, ``output`` and ``inputs`` (records), ``reached``,
    ``allowed``, ``path``, ``source_text``, ``forward_ops``; a record the fields of
    :class:`Record`.
    """

    status: Status = field(metadata=absent(Status.CLEAN))
    first: Occurrence | None = field(metadata=absent(None))
    origins: tuple[Occurrence, ...] = ()
    path: tuple[Record, ...] = ()
    runs: tuple[Occurrence | None, ...] = ()
    loss: float | None = None
    config: ReportConfig = field(default_factory=ReportConfig)
    modules: dict[str, str] = field(default_factory=dict)  # module -> "nan" / "inf" / "finite"
    module_classes: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    command: str | None = None
    notes: tuple[str, ...] = ()
    n_records: int = 0
    verdict: Verdict | None = None
    # One point per record, in execution order: (index, phase, largest finite |x| or NaN, "finite"/"nan"/"inf").
    timeline: tuple[tuple[int, str, float, str], ...] = ()
    repro: Repro | None = None  # the origin op alone, as a standalone script (``nanhunt.hunt.repro``)
    schema_version: int = SCHEMA_VERSION
    # ``nanhunt compare``: float32 reference vs autocast. Written under "comparison" only when present, so the
    # JSON of a replay is unchanged; read back with ``.get`` (absent in older files).
    comparison: Comparison | None = None
    # Fixes beyond float32 derived from the measured origins (``nanhunt.hunt.advice``), and the Guard's event when
    # the capture came from a Guard (read from the ``-event.json`` beside it: the failing step, kind, detail,
    # rank). Written only when present, like ``comparison``.
    advice: tuple[Advice, ...] = ()
    guard_event: GuardEvent | None = None
    # The Guard's headroom history up to its event (from the same file): the modules nearest their dtype's limit
    # and its warnings. Written only when present.
    headroom: HeadroomHistory | None = None

    def __post_init__(self) -> None:
        # given as its text (``Report("clean", None)``): held as the member, so it is written and compared alike,
        # and a status no version writes is refused here rather than in a file
        object.__setattr__(self, "status", Status(self.status))

    def to_dict(self) -> dict[str, Any]:
        d = _serial.to_dict(self)
        for key in ("comparison", "guard_event", "headroom"):
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
        return _serial.from_dict(cls, current)._first_shared()

    def _first_shared(self) -> Report:
        """This report with ``first`` the very origin it is, as a replay makes it. Read from a file, ``first`` and
        its origin are two copies, which compare unequal where a value is NaN (NaN != NaN): a renderer leaving
        the leading origin out of "the other origins" would list it again, and a re-rendered report would differ
        from the one its replay wrote. Matched as the file writes them (NaN as "nan")."""
        if self.first is None:
            return self
        written = _serial.to_dict(self.first)
        same = next((o for o in self.origins if o.output.index == self.first.output.index
                     and _serial.to_dict(o) == written), None)
        return self if same is None else replace(self, first=same)

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
class Rung(JSONData):
    """One rung of a compiled model's replay ladder: the step run by ``backend`` (``eager``: not compiled;
    ``aot_eager``: dynamo and AOTAutograd's graphs run by eager kernels; the recorded backend), ``runs`` times
    from the same state, ``nonfinite`` of them with a non-finite loss, gradient or update; ``error``: why it could
    not run (the compilation failed), the ladder stopping there."""

    backend: str = field(metadata=absent(""))
    runs: int = 0
    nonfinite: int = 0
    error: str | None = None


@dataclass(frozen=True)
class GraphNode(JSONData):
    """The first node of a compiled step's forward graph whose value the failing backend makes non-finite:
    ``node`` its name in the graph, ``target`` the function or method it calls, ``module`` the user's module
    it runs in (``named_modules()`` name; None: outside any), ``module_class``, ``source`` the user's line
    (``"file:line in function"``) and ``source_text`` its text; ``graph`` which of ``graphs`` (dynamo splits
    a step at graph breaks), ``nodes`` how many candidate nodes the graph holds, ``compiles`` how many
    prefixes of it were compiled to find the node, ``kind`` ``"nan"`` or ``"inf"``."""

    node: str = field(metadata=absent(""))
    target: str = ""
    module: str | None = None
    module_class: str | None = None
    source: str | None = None
    source_text: str | None = None
    kind: str = "nan"
    graph: int = 0
    graphs: int = 1
    nodes: int = 0
    compiles: int = 0


@dataclass(frozen=True)
class Verdict(JSONData):
    """What the float32 bisection proved.

    ``kind`` (a :class:`VerdictKind`): ``precision`` (``culprits`` in float32 make the step finite),
    ``not-precision`` (it fails in float32 too), ``scale-induced`` (only the loss
    scale overflows the gradients), ``compile-induced`` (a ``torch.compile``d model
    whose eager step is finite and whose compiled step is not: ``rungs``, ``graph_node``),
    ``float8-induced`` (``culprits``: torchao float8 layers whose running as ``nn.Linear`` on the
    same weights makes the step finite; ``rowwise_fixes`` whether the rowwise recipe on them
    alone does, one replay; ``fix`` the conversion to paste, rowwise where that fixes the step,
    ``remaining`` what a traced replay with it left; ``candidates`` the float8 layers),
    ``not-reproducible``, ``clean``, ``interrupted``
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
    alone in float32, one replay, whatever the verdict: True when that replay was finite (and,
    every origin silent, the leading one was not born again); it says nothing of the other
    origins (see ``remaining``). A backward origin outside every module (a scaled gradient
    cast to float16) is in the loss's backward: its region is ``<loss>``, else the model,
    whose output is the loss. None: the origin is in no module or region that can run in
    float32, or the bisection stopped first.

    The proposed fix (``precision``): ``fix_regions`` run in float32, the culprits extended
    while origins remain (their modules added, or, when two or more of them and most of a
    class's modules hold origins, every module of that class: ``fix_classes``, as
    ``"package.module:Class"``), at most three rounds; ``fix`` is its code to paste.
    ``remaining``: the origins born in a traced replay with ``fix_regions`` in float32 (an
    extension is kept only when that replay is finite): ``()`` with ``confirmed`` means the fix
    fixes the step. None: not measured (no fix, or Ctrl-C first).
    """

    kind: VerdictKind = field(metadata=absent(VerdictKind.CLEAN))
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
    # a compiled model's step: the ladder's rungs (eager first), and where the failing backend's forward graph
    # first goes non-finite (compile-induced; None: not located, see ``graph_note``)
    rungs: tuple[Rung, ...] = ()
    graph_node: GraphNode | None = None
    graph_note: str | None = None
    # float8-induced: the rowwise recipe on the culprits alone makes the step finite (None: not measured)
    rowwise_fixes: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", VerdictKind(self.kind))  # as Report.status

    def to_dict(self) -> dict[str, Any]:
        # a compiled step's keys only where there is one, a float8 step's likewise (the files of every other step
        # are as before)
        d = _serial.to_dict(self)
        for key in ("rungs", "graph_node", "graph_note", "rowwise_fixes"):
            if not d[key]:
                del d[key]
        return d


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
