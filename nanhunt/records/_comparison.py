"""A comparison's report: per-tensor differences, decisions, the acceptance rule, quality, speed."""

from __future__ import annotations

import enum
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import _serial
from ._serial import JSONData, absent


@dataclass(frozen=True)
class TensorDiff(JSONData):
    """One value of the step in the autocast run against the same value in the float32 reference.

    ``kind`` is ``"module"`` (the outputs of one module call, matched by ``name`` and
    ``call_index``), ``"output"`` (the model's return value), ``"loss"`` or ``"grad"``
    (a parameter's gradient). Errors: ``max_abs`` = max |amp - ref|; ``max_rel`` = max
    |amp - ref| / |ref| over the elements with |ref| > atol; ``scaled`` = max_abs /
    max(max |ref|, atol), the error as a fraction of the tensor's own magnitude (what the
    ranking compares; per row, the largest over its rows, when the comparison's ``per_row``); ``out_of_tol`` the fraction of elements with |amp - ref| > atol +
    rtol * |ref|. A non-finite value where the other run has a different one counts as an
    infinite error. ``headroom`` = the autocast dtype's max / the largest finite magnitude
    in either run (inf when all zero; None when the autocast value is non-finite).
    ``underflow`` counts elements non-zero in float32 that are zero in the autocast run.
    For module calls, ``input_scaled`` is the largest ``scaled`` error among the call's
    floating inputs and ``introduced`` the error the call adds beyond its inputs and beyond
    what its own sub-module calls already introduced (see :mod:`nanhunt.comparison.engine`).
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
    # A run other than plain autocast, by name: "float8 (tensorwise) on proj, text_proj" for a model's torchao
    # float8 layers run in float8 (``dtype`` "float8"); "" for autocast ``dtype``. Written only when set.
    variant: str = ""
    # Errors measured per row (each vector along the last dimension) rather than per tensor: a comparison of a
    # model holding float8 layers, whose tensorwise scaling can zero every row but the largest. Written only when set.
    per_row: bool = False
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

    def run_name(self) -> str:
        """The compared run as the report names it: ``"autocast float16"``, or the variant's name."""
        return self.variant or f"autocast {self.dtype}"

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
        if any(r.variant for r in runs):
            names = [r.run_name() for r in runs]
            ran = f"{names[0]} run finite" if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]} runs finite"
        else:
            ran = f"autocast {runs[0].dtype if len(runs) == 1 else '(' + ', '.join(r.dtype for r in runs) + ')'} run finite"
        parts = ["float32 reference finite", ran]
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
        items = [(k, v) for k, v in _serial.to_dict(self).items() if k not in ("absorbed", "variant", "per_row") or v]
        at = [k for k, _ in items].index("tie_rule") + 1
        return dict(items[:at] + [("rule", self.rule_text())] + items[at:])  # written for readers; never read
