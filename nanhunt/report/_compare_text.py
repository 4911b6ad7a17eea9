"""Private: the words and numbers of a comparison report (``nanhunt compare``) every text renderer shares, as
plain, unescaped strings; a replay report's are in :mod:`._common`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..records import Comparison, Decision, Quality, Regression, Report, Speed, TensorDiff
from ._common import Span, num

__all__ = ["compare_verdict", "compare_summary", "compare_title", "RULE_LABEL", "NOTHING_COMPARED",
           "ERROR_DEFINITION", "error_definition", "error_scale", "NO_RANKING", "pct", "diff_headroom", "indices", "amp_state", "run_rows",
           "RANKING_COLUMNS", "ranking_cells", "carrier", "carrier_text", "decisions_head", "decisions_counts",
           "decision_columns", "decision_cells", "DIFF_COLUMNS", "diff_cells", "diff_text", "extremes_text",
           "worst_text", "gradients_head", "ordered_grads", "module_class_text", "RULE_HASH_LABEL",
           "rule_hash_text", "violation_lines", "allowed_lines", "absorbed_lines", "ABSORBED_HEAD",
           "CANDIDATE_COLUMNS", "candidate_cells", "batch_columns", "batch_cells", "quality_text", "SPEED_COLUMNS",
           "speed_cells", "speed_rows", "sample_list", "candidate_head", "decision_categories", "decision_kind",
           "decision_rows", "worst_decisions", "DECISIONS_SHOWN", "speed_memory_lines", "rule_warning_lines",
           "RUNS_TITLE", "BATCHES_TITLE", "QUALITY_TITLE", "INTRODUCED_TITLE", "DECISIONS_TITLE", "OUTPUT_TITLE",
           "CANDIDATES_TITLE", "SPEED_TITLE", "CONFIG_TITLE"]

# The sections of a comparison's report, titled alike in Markdown and HTML (the console titles only its tables;
# the last section, Reproduce, is titled as a replay's)
RUNS_TITLE = "Runs"
BATCHES_TITLE = "Batches"
QUALITY_TITLE = "Quality"
INTRODUCED_TITLE = "Where the error is introduced"
DECISIONS_TITLE = "Decisions"
OUTPUT_TITLE = "Output and loss"
CANDIDATES_TITLE = "Candidates against one float32 reference"
SPEED_TITLE = "Speed, after validation"
CONFIG_TITLE = "Configuration and environment"

RULE_LABEL = "rule (fixed before the run)"
NOTHING_COMPARED = "nothing was compared: a non-finite float32 run is no reference for precision"
ERROR_DEFINITION = ("err = max |amp - ref| / max |ref| of a value; introduced = output err - input err - what the "
                    "call's sub-calls introduced")
_ROW_DEFINITION = ("err = the largest over a value's rows (vectors along its last dimension) of max |amp - ref| / "
                   "max |ref| in the row; introduced = output err - input err - what the call's sub-calls introduced")


def error_definition(c: Comparison) -> str:
    """How ``err`` is measured: against the value's largest magnitude, or per row (a float8 model's comparison)."""
    return _ROW_DEFINITION if c.per_row else ERROR_DEFINITION


def error_scale(c: Comparison) -> str:
    """What an error is a fraction of, in words."""
    return "the largest float32 magnitude of its row" if c.per_row else "the value's largest float32 magnitude"
NO_RANKING = "no module call introduces error"
RANKING_COLUMNS = ("#", "module call", "introduced", "output err", "input err", "max abs", "max rel", "out of tol",
                   "headroom", "underflow")
DIFF_COLUMNS = ("value", "dtype", "shape", "max abs", "max rel", "err", "out of tol", "headroom", "underflow")


def _verdict(c: Comparison) -> str:
    if not c.reference_finite:
        return "REFERENCE NON-FINITE"
    return "ACCEPTED" if c.accepted else "REJECTED"


def compare_verdict(c: Comparison) -> str:
    """One word (or two) for the result: ``ACCEPTED`` (by every candidate dtype), ``REJECTED`` or
    ``REFERENCE NON-FINITE``."""
    verdicts = {_verdict(x) for x in c.candidates()}
    return verdicts.pop() if len(verdicts) == 1 else "REJECTED"


def _violations(c: Comparison) -> str:
    n = len(c.violations)
    return f"{n} violation{'s' if n != 1 else ''}"


def _set_text(c: Comparison) -> str:
    if not c.batches:
        return ""
    return f" on {len(c.batches)} batch{'es' if len(c.batches) != 1 else ''} ({c.n_samples} samples)"


def compare_summary(report: Report) -> str:
    """The status line, first in every rendering of a comparison."""
    c = report.comparison
    assert c is not None, "not a comparison report"
    if not c.reference_finite:
        return f"REFERENCE NON-FINITE: the float32 reference is non-finite, first at {c.reference_first_nonfinite}"
    named = any(x.variant for x in c.candidates())  # a float8 run: every run by its name
    if c.alternatives:
        each = ", ".join(f"{x.run_name() if named else x.dtype} {_verdict(x)}"
                         + ("" if x.accepted else f" ({_violations(x)})") for x in c.candidates())
        return f"{compare_verdict(c)}: {'' if named else 'autocast '}{each} against the float32 reference{_set_text(c)}"
    tail = "" if c.accepted else f" ({_violations(c)})"
    return f"{compare_verdict(c)}: {c.run_name()} against the float32 reference{tail}{_set_text(c)}"


RULE_HASH_LABEL = "rule sha256"


def rule_hash_text(c: Comparison) -> str | None:
    """``<sha256> of <the rule's canonical JSON>``, or None for a comparison written without it."""
    if not c.rule_sha256:
        return None
    return c.rule_sha256 + (f" of {c.acceptance.canonical()}" if c.acceptance is not None else "")


def rule_warning_lines(c: Comparison) -> list[str]:
    """The rules this checkpoint failed under before the current one (``nanhunt compare --report``'s history)."""
    return list(c.rule_warnings)


def violation_lines(c: Comparison) -> list[str]:
    """Every violation of every candidate, with the clause it fails (and the dtype, for several candidates)."""
    out: list[str] = []
    for x in c.candidates():
        head = f"{x.run_name()}: " if c.alternatives else ""
        if x.failures:
            out += [f"{head}{f.message} (clause {f.clause})" for f in x.failures]
        else:
            out += [head + v for v in x.violations]
    return out


def allowed_lines(c: Comparison) -> list[str]:
    return [a for x in c.candidates() for a in x.allowed]


ABSORBED_HEAD = "born non-finite and absorbed before the loss and gradients (silent origins)"


def absorbed_lines(c: Comparison) -> list[str]:
    """The silent origins of every candidate's finite autocast run (``Comparison.absorbed``)."""
    return [a for x in c.candidates() for a in x.absorbed]


def _absorbed_text(c: Comparison) -> str:
    n = len(c.absorbed)
    return f", but {n} non-finite value{'s were' if n != 1 else ' was'} born and absorbed (silent)" if n else ""


def candidate_head(c: Comparison) -> str:
    """The heading of one candidate's details, when there are several."""
    return f"{c.run_name()}: {_verdict(c)}" + ("" if c.accepted else f" ({_violations(c)})")


CANDIDATE_COLUMNS = ("candidate", "verdict", "failed clauses", "samples", "quality float32", "quality autocast",
                     "speed ratio")


def _clauses(c: Comparison) -> str:
    return ", ".join(dict.fromkeys(f.clause for f in c.failures)) or ("-" if c.accepted else "see violations")


def candidate_cells(c: Comparison) -> tuple[str, ...]:
    q, sp = c.quality, c.speed
    ratio = "-" if sp is None or sp.ratio_median is None else f"{sp.ratio_median:.3g}x"
    samples = list(dict.fromkeys(s for f in c.failures for s in f.samples))
    return (c.dtype, _verdict(c), _clauses(c), ", ".join(samples[:10]) + (" ..." if len(samples) > 10 else "") or "-",
            num(q.ref) if q else "-", num(q.amp) if q else "-", ratio)


def batch_columns(c: Comparison) -> tuple[str, ...]:
    return ("batch", "samples", "float32", c.dtype, "flips", "quality float32", f"quality {c.dtype}",
            "top introduced error", "rule alone")


def batch_cells(b: Comparison) -> tuple[str, ...]:
    ref = "finite" if b.reference_finite else "NON-FINITE"
    amp = "not run" if b.amp_finite is None else (
        ("finite" + (f" ({len(b.absorbed)} absorbed)" if b.absorbed else "")) if b.amp_finite else "NON-FINITE")
    flips = str(len(b.flipped)) + (f" ({sample_list(b, b.flipped, 5)})" if b.flipped else "")
    q = b.quality
    top = f"{b.modules[b.ranking[0]].label()} ({num(b.modules[b.ranking[0]].introduced)})" if b.ranking else "-"
    rule = "holds" if b.accepted else "fails: " + _clauses(b)
    return (b.batch, str(b.n_samples), ref, amp, flips, num(q.ref) if q else "-", num(q.amp) if q else "-", top,
            rule)


def _quality_sense(q: Quality) -> str:
    return "higher is better" if q.higher_is_better else "lower is better"


def quality_text(c: Comparison) -> str | None:
    """The quality of both runs in one sentence (None when none was measured)."""
    q = c.quality
    if q is None:
        return None
    drop = q.drop()
    how = "no worse" if drop <= 0 else f"{num(drop)} worse"
    text = (f"quality ({q.metric}, {_quality_sense(q)}) on {q.n} samples: float32 {num(q.ref)}, {c.run_name()} "
            f"{num(q.amp)}: {how}")
    if q.ref_max_error is not None or q.amp_max_error is not None:
        text += f"; largest error float32 {num(q.ref_max_error)}, {c.dtype} {num(q.amp_max_error)}"
    if q.worse:
        text += f"; worse {'in ' + c.dtype if c.variant else 'under autocast'}: {sample_list(c, q.worse)}"
    return text


SPEED_COLUMNS = ("candidate", "step", "repeats", "float32 s", "autocast s", "ratio (median)", "ratio q1-q3",
                 "peak float32", "peak autocast")


def _bytes(n: int | None) -> str:
    if n is None:
        return "not measured"
    return f"{n / 2 ** 20:.1f} MiB"


def speed_memory_lines(c: Comparison) -> list[str]:
    """How the timed candidates' peak memory was measured, or why it was not (once per distinct way)."""
    hows = dict.fromkeys(x.speed.peak_memory for x in c.candidates()
                         if x.speed is not None and not x.speed.reason and x.speed.peak_memory)
    return [f"peak memory: {h}" + ("" if h.startswith("not measured") else ", in one untimed pass per run")
            for h in hows]


def speed_rows(c: Comparison) -> tuple[list[tuple[str, ...]], list[str]]:
    """The timed candidates' rows of ``SPEED_COLUMNS``, and a line for each one not timed (and why)."""
    rows: list[tuple[str, ...]] = []
    untimed: list[str] = []
    for x in c.candidates():
        if x.speed is not None:
            if x.speed.reason:
                untimed.append(f"speed of {x.run_name()} {x.speed.reason}")
            else:
                rows.append(speed_cells(x, x.speed))
    return rows, untimed


def speed_cells(c: Comparison, sp: Speed) -> tuple[str, ...]:
    """One candidate's timing (taken only after it passed the rule)."""
    q = f"{num(sp.ratio_q1)}-{num(sp.ratio_q3)}"
    return (c.dtype, sp.mode, str(sp.repeats), num(sp.ref_median_s), num(sp.amp_median_s),
            "-" if sp.ratio_median is None else f"{sp.ratio_median:.3g}x", q, _bytes(sp.ref_peak_bytes),
            _bytes(sp.amp_peak_bytes))


def sample_list(c: Comparison, xs: tuple[int, ...], limit: int = 20) -> str:
    """Samples by name (``file:index`` in a set), at most ``limit`` of them."""
    head = ", ".join(c.sample(i) for i in xs[:limit])
    return head + (f", ... ({len(xs) - limit} more)" if len(xs) > limit else "")


def compare_title(c: Comparison) -> str:
    return f"nanhunt compare: {compare_verdict(c).lower()}"


def pct(x: float) -> str:
    """A fraction of elements as a percentage; ``<0.1%`` rather than a misleading 0."""
    if math.isnan(x):
        return "nan"
    return "0" if x == 0 else f"{x:.1%}" if x >= 0.001 else "<0.1%"


def diff_headroom(d: TensorDiff) -> str:
    if d.headroom is None:
        return "overflowed"
    return "inf" if math.isinf(d.headroom) else f"{d.headroom:.3g}x"


def indices(xs: tuple[int, ...], limit: int = 20) -> str:
    head = ", ".join(map(str, xs[:limit]))
    return head + (f", ... ({len(xs) - limit} more)" if len(xs) > limit else "")


def amp_state(c: Comparison) -> str:
    """``finite`` or ``NON-FINITE (first at ...)``: how the autocast run ended."""
    if c.amp_finite is None:
        return "not run"
    return "finite" + _absorbed_text(c) if c.amp_finite else f"NON-FINITE (first at {c.amp_first_nonfinite})"


def run_rows(c: Comparison) -> list[tuple[str, str]]:
    """The two runs, one row each: (run, how it ended and its loss)."""
    ref = "finite" if c.reference_finite else f"NON-FINITE (first at {c.reference_first_nonfinite})"
    rows = [("float32 reference", f"{ref}, loss {num(c.ref_loss)}")]
    if c.amp_finite is None:
        rows.append((c.run_name(), "not run"))
    else:
        rows.append((c.run_name(), f"{amp_state(c)}, loss {num(c.amp_loss)}"))
    return rows


def module_class_text(d: TensorDiff) -> str:
    return f" ({d.module_class})" if d.module_class else ""


def ranking_cells(d: TensorDiff) -> tuple[str, ...]:
    """The numbers of one module call, the columns of ``RANKING_COLUMNS`` after "module call"."""
    return (num(d.introduced), num(d.scaled), num(d.input_scaled), num(d.max_abs), num(d.max_rel), pct(d.out_of_tol),
            diff_headroom(d), str(d.underflow))


def carrier(c: Comparison) -> TensorDiff | None:
    """The call holding the largest absolute error when it is not the one ranked first: it carries error made
    upstream. On a tie the deepest call (a container's output is its last child's)."""
    if not c.modules or not c.ranking:
        return None
    largest = max(range(len(c.modules)), key=lambda i: (c.modules[i].max_abs, c.modules[i].depth, -i))
    if largest != c.ranking[0] and c.modules[largest].max_abs > 0:
        return c.modules[largest]
    return None


def carrier_text(d: TensorDiff) -> list[Span]:
    return [Span("largest absolute error: "), Span(d.label(), True),
            Span(f" ({num(d.max_abs)}), which introduces {num(d.introduced)} of it: it carries error made upstream")]


def decisions_head(c: Comparison) -> str:
    return "decisions: " + decisions_counts(c)


def decisions_counts(c: Comparison) -> str:
    """How many samples, how many flipped and near the boundary, and which; the non-finite ones (no decision,
    never a flip) when there are any."""
    return (f"{c.n_samples} sample{'s' if c.n_samples != 1 else ''}, {len(c.flipped)} flipped"
            + (f" ({sample_list(c, c.flipped)})" if c.flipped else "")
            + f", {len(c.near_boundary)} near the boundary"
            + (f" ({sample_list(c, c.near_boundary)})" if c.near_boundary else "")
            + (f", {len(c.nonfinite)} non-finite ({sample_list(c, c.nonfinite)})" if c.nonfinite else ""))


def decision_categories(c: Comparison) -> str:
    """Every sample in exactly one category: same class in both runs, flipped, or no autocast decision."""
    agree = c.n_samples - len(c.flipped) - len(c.nonfinite)
    return (f"by category: {agree} agree (same class), {len(c.flipped)} flipped, {len(c.nonfinite)} non-finite "
            "(autocast scores hold NaN/Inf: no decision)")


DECISIONS_SHOWN = 10  # rows of the console's decisions table; the other formats list them all


def decision_kind(c: Comparison, d: Decision) -> str:
    """``nonfinite`` (no autocast decision), ``flip`` or ``near`` (near the boundary, unchanged)."""
    return "nonfinite" if d.index in c.nonfinite else ("flip" if d.flipped else "near")


def worst_decisions(c: Comparison, limit: int = DECISIONS_SHOWN) -> tuple[list[Decision], int]:
    """The ``limit`` worst decisions and how many are left out: the flips first (a wrong answer that looks like
    an answer; the most confident float32 decision first), then the non-finite samples (no decision; the
    ``amp_finite`` violation already names them), then the unchanged near-boundary samples (the smallest float32
    margin first); ties in sample order."""
    bad = set(c.nonfinite)

    def key(d: Decision) -> tuple[int, float, int]:
        if d.index in bad:
            return (1, 0.0, d.index)
        margin = d.ref_margin if math.isfinite(d.ref_margin) else math.inf
        return (0, -margin, d.index) if d.flipped else (2, margin, d.index)

    ordered = sorted(c.decisions, key=key)
    return ordered[:limit], max(0, len(ordered) - limit)


def decision_columns(c: Comparison) -> tuple[str, ...]:
    return ("sample", "float32 class (runner-up)", "float32 margin", f"{c.dtype} class", f"{c.dtype} margin", "")


_KIND_TEXT = {"nonfinite": "NON-FINITE", "flip": "FLIPPED", "near": "near the boundary, unchanged"}


def _cells(c: Comparison, d: Decision, kind: str) -> tuple[str, ...]:
    return (c.sample(d.index), f"{d.ref_class} ({d.ref_runner_up})", num(d.ref_margin), str(d.amp_class),
            num(d.amp_margin), _KIND_TEXT[kind])


def decision_cells(c: Comparison, d: Decision) -> tuple[str, ...]:
    return _cells(c, d, decision_kind(c, d))


def decision_rows(c: Comparison, decisions: Sequence[Decision] | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """``(decision_kind, decision_cells)`` of each decision (default: all, in sample order)."""
    bad = frozenset(c.nonfinite)
    out: list[tuple[str, tuple[str, ...]]] = []
    for d in c.decisions if decisions is None else decisions:
        kind = "nonfinite" if d.index in bad else ("flip" if d.flipped else "near")
        out.append((kind, _cells(c, d, kind)))
    return out


def diff_cells(d: TensorDiff) -> tuple[str, ...]:
    """The columns of ``DIFF_COLUMNS`` after "value" (whose name is the renderer's: a gradient names a parameter)."""
    return (d.dtype or "-", str(list(d.shape)), num(d.max_abs), num(d.max_rel), num(d.scaled), pct(d.out_of_tol),
            diff_headroom(d), str(d.underflow))


def diff_text(d: TensorDiff) -> str:
    return (f"max abs error {num(d.max_abs)}, max rel error {num(d.max_rel)}, out of tolerance {pct(d.out_of_tol)}, "
            f"headroom {diff_headroom(d)}, underflow {d.underflow}")


def extremes_text(c: Comparison, g: Regression) -> str:
    return (f"extremes: float32 [{num(g.ref_min)}, {num(g.ref_max)}], {c.dtype} "
            f"[{num(g.amp_min)}, {num(g.amp_max)}]")


def worst_text(c: Comparison, g: Regression) -> str:
    return "largest error per sample: " + ", ".join(f"{c.sample(i)} ({num(e)})" for i, e in g.worst)


def gradients_head(c: Comparison) -> str:
    under = sum(d.underflow for d in c.grads)
    return f"gradients: {len(c.grads)} tensors, {under} elements underflowed to zero"


def ordered_grads(c: Comparison) -> list[TensorDiff]:
    """The gradients, largest error (``scaled``) first; a stable sort keeps parameter order on ties."""
    return sorted(c.grads, key=lambda d: -d.scaled)
