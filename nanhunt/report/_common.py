"""Private: the words and numbers every text renderer shares, as plain, unescaped strings.

Text that names user things (modules, ops, source lines) comes as ``Span`` lists so
that each format can set them as code and escape them its own way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..records import (DTYPE_MAX, Comparison, Decision, Occurrence, Quality, Record, Regression, Report, Speed,
                       TensorDiff, Verdict, role_text)

__all__ = ["Span", "num", "label", "limit_of", "headroom", "sentence", "verdict_text", "scaler_text",
           "environment_rows", "birth_rows", "tensor_rows", "TENSOR_COLUMNS", "repro_text", "occurrence_spans", "path_label",
           "compare_verdict", "compare_summary", "compare_title", "RULE_LABEL", "NOTHING_COMPARED", "ERROR_DEFINITION",
           "NO_RANKING", "pct", "diff_headroom", "indices", "amp_state", "run_rows", "RANKING_COLUMNS", "ranking_cells",
           "carrier", "carrier_text", "decisions_head", "decisions_counts", "decision_columns", "decision_cells", "DIFF_COLUMNS",
           "diff_cells", "diff_text", "extremes_text", "worst_text", "gradients_head", "ordered_grads",
           "module_class_text", "RULE_HASH_LABEL", "rule_hash_text", "violation_lines", "allowed_lines", "absorbed_lines",
           "ABSORBED_HEAD",
           "CANDIDATE_COLUMNS", "candidate_cells", "batch_columns", "batch_cells", "quality_text", "SPEED_COLUMNS",
           "speed_cells", "speed_rows", "sample_list", "candidate_head", "decision_categories", "decision_kind",
           "decision_rows", "worst_decisions", "DECISIONS_SHOWN", "speed_memory_lines", "rule_warning_lines",
           "ADVICE_TITLE", "ADVICE_INTRO", "guard_rows", "guard_text", "origin_alone"]

LIMITS = DTYPE_MAX


class Span(NamedTuple):
    text: str
    code: bool = False  # a user name (module, op, source): set as code and escaped by the format


def num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def label(module: str | None) -> str:
    if module is None:
        return "outside the model"
    return module or "<root>"


def limit_of(dtype: str) -> float | None:
    return LIMITS.get(dtype)


def headroom(r: Record) -> str:
    """How many times larger the values could grow before the dtype overflows."""
    limit = LIMITS.get(r.dtype)
    if limit is None:
        return "-"
    if not r.finite:
        return "overflowed" if r.has_inf else "-"
    a = r.absmax
    return "inf" if a == 0 else f"{limit / a:.3g}x"


def _kind(kind: str) -> str:
    return "NaN" if kind == "nan" else "Inf"


def sentence(report: Report) -> list[Span]:
    """The verdict in one sentence."""
    if report.status == "not-reproducible":
        e, v = report.guard_event, report.verdict
        if e is not None and v is not None and v.kind == "not-reproducible" and not any(report.runs):
            n = f"{v.replays} replay{'s' if v.replays != 1 else ''}"
            return [Span(f"Not reproducible: the Guard saw step {e.step} fail ({e.detail}), but the replay of its "
                         f"capture stayed finite ({n}).")]
        return [Span("Not reproducible: two replays of the same step disagree on where the first non-finite "
                     "value is born.")]
    occ = report.first
    if occ is None:
        if report.status == "clean":
            return [Span("The step stayed finite: loss, activations and gradients.")]
        return [Span("Non-finite values, but every origin is allowed or none could be located.")]
    out = [Span(f"{_kind(occ.kind)} born in phase {occ.phase.value}, ")]
    if occ.module is None:
        out.append(Span("outside the model"))
    else:
        out += [Span("in "), Span(label(occ.module), True)]
        if occ.module_class:
            out.append(Span(f" ({occ.module_class}, call {occ.call_index})"))
    if occ.op:
        out += [Span(" at "), Span(occ.op, True)]
    else:
        out.append(Span(f" ({role_text(occ.output)})"))
    v = report.verdict
    if v is not None and v.kind == "precision" and v.culprits:
        out.append(Span("; running "))
        out += _culprits(v.culprits)
        gone = "makes its origin go away" if v.silent else "makes the step finite"
        out.append(Span(f" in float32 {gone}" + ("" if v.confirmed else " (not confirmed)")))
    elif v is not None and v.kind == "not-precision":
        out.append(Span("; it fails in float32 too: not a precision problem"))
    elif v is not None and v.kind == "scale-induced":
        out.append(Span("; only the loss scale makes the gradients overflow (GradScaler skips this step)"))
    if occ.silent:
        out.append(Span(" (silent: absorbed before the loss and the gradients)"))
    out.append(Span("."))
    return out


def _culprits(names: tuple[str, ...]) -> list[Span]:
    out: list[Span] = []
    for i, c in enumerate(names):
        out += ([Span(", ")] if i else []) + [Span(label(c), True)]
    return out


def verdict_text(report: Report) -> list[Span]:
    """The bisection's verdict, longer than the sentence."""
    v = report.verdict
    if v is None:
        return [Span("No bisection was run (--no-bisect).")]
    if v.kind == "precision":
        out = [Span("Precision problem: running ")]
        out += _culprits(v.culprits)
        state = "confirmed" if v.confirmed else "NOT confirmed"
        gone = "makes the silent origin go away" if v.silent else "makes the step finite"
        out.append(Span(f" in float32 {gone} ({state}; {v.replays} replays, {v.seconds:.1f} s"
                        f"{', interrupted' if v.interrupted else ''})."))
        if v.silent:
            out.append(Span(" The step stayed finite, but with wrong values: the non-finite value was absorbed"
                            + (f" into {'; '.join(v.corrupted)}." if v.corrupted else ".")))
        return out + _fix_spans(v)
    if v.kind == "not-precision":
        out = [Span("Not a precision problem: the step fails in float32 too")]
        if v.float32_first is not None:
            f = v.float32_first
            out.append(Span(f"; in float32 {_kind(f.kind)} is born "))
            out += [Span("outside the model")] if f.module is None else [Span("in "), Span(label(f.module), True)]
            if f.op:
                out += [Span(" at "), Span(f.op, True)]
        out.append(Span("."))
        return out
    if v.kind == "scale-induced":
        return [Span("Scale-induced: the gradients overflow only because of the loss scale; GradScaler backs off "
                     "and skips this step (a bug only if it keeps happening).")]
    if v.kind == "not-reproducible":
        e = report.guard_event
        if e is not None and not any(report.runs):
            return [Span(_not_reproduced(e.step, e.captured_step, e.pre_update, v.replays))]
        return [Span("Not reproducible: the original configuration ran finite when replayed again.")]
    if v.kind == "interrupted":
        return [Span(f"Interrupted after {v.replays} replays ({v.seconds:.1f} s), before any culprit was found.")]
    return [Span("Clean: nothing to bisect.")]


def _not_reproduced(step: int, captured: int | None, pre_update: bool, replays: int) -> str:
    """Why a Guard's capture may replay finite although its step failed, and how to check."""
    head = f"Not reproducible: {replays} replay{'s' if replays != 1 else ''} of the capture stayed finite. "
    if captured is not None and captured != step and not pre_update:
        return head + (f"The capture is the Guard's last good snapshot, the start of step {captured}: a replay "
                       f"runs that one step, not the steps up to step {step}'s failure. With the Guard's "
                       f"snapshot_every=1 the capture is the start of the failing step itself.")
    return head + ("The capture holds the weights, buffers, optimizer and GradScaler state, torch's RNG (CUDA's "
                   "too) and the batch as the step received it. It cannot hold what else the step read: state "
                   "outside them (a global, a module attribute that is not a buffer, Python's or NumPy's random "
                   "generators), the results of non-deterministic kernels, the device's RNG when replayed on another "
                   "device. To check: --repeat N replays it up to N times and reports the first replay that is not "
                   "finite; make such state a buffer or part of the batch; with the Guard's snapshot_every=1 a "
                   "capture is the start of the failing step even when an update wrote non-finite weights.")


def origin_alone(v: Verdict) -> tuple[str, str] | None:
    """``origin_alone_fixes`` as what its one replay measured (other origins may remain: the fix says), and the
    answer; None when not measured."""
    if v.origin_alone_fixes is None:
        return None
    what = "makes it no longer born" if v.silent else "makes the step finite (loss, gradients, update)"
    return f"The leading origin's module alone in float32 {what}", "yes" if v.origin_alone_fixes else "no"


def _fix_spans(v: Verdict) -> list[Span]:
    """What the suggested fix runs in float32 and what a traced replay with it left; nothing when not measured."""
    if v.remaining is None:
        return []
    out = [Span(" The suggested fix (")]
    if v.fix_classes:  # its own modules are in fix_regions; the code to paste names the rest
        for i, path in enumerate(v.fix_classes):
            out += [Span(", " if i else ""), Span("every "), Span(path.partition(":")[2], True)]
        out.append(Span(f"; {len(v.fix_regions)} in float32 in all"))
    else:
        out += _culprits(v.fix_regions)
        out.append(Span(" in float32"))
    out.append(Span("), measured in a traced replay: "))
    if not v.remaining:
        return out + [Span("no origin is left.")]
    out.append(Span(f"{len(v.remaining)} origin(s) left: "))
    for i, o in enumerate(v.remaining[:5]):
        out += ([Span("; ")] if i else []) + occurrence_spans(o)
    return out + [Span("; ...." if len(v.remaining) > 5 else ".")]


def alternatives(report: Report) -> list[tuple[str, str]]:
    v = report.verdict
    if v is None:
        return []
    return [(k, "finite" if ok else "still non-finite") for k, ok in v.alternatives.items()]


def scaler_text(config: dict[str, Any]) -> str:
    if "scaler_scale" not in config:
        return "No GradScaler in this step (backward ran unscaled)."
    scale = config.get("scaler_scale")
    if scale is None:
        return "GradScaler present but disabled."
    tracker = config.get("scaler_growth_tracker")
    skip = config.get("scaler_would_skip")
    head = f"scale {num(float(scale))}, growth tracker {tracker if tracker is not None else '-'}"
    if skip:
        return head + ": the gradients hold inf/NaN, so GradScaler would skip this optimizer step and halve the scale."
    if skip is False:
        return head + ": the gradients are finite, so this step would update the weights."
    return head + "."


def environment_rows(report: Report) -> list[tuple[str, str]]:
    env = report.environment
    cfg = report.config
    rows: list[tuple[str, str]] = [(k, env[k]) for k in ("nanhunt", "torch", "python", "os", "device", "cuda", "rocm")
                                   if k in env]
    if cfg.get("dtype") is not None:
        on = cfg.get("dtype") != "float32"
        rows.append(("autocast", f"{cfg.get('device_type', env.get('device_type', '?'))} {cfg['dtype']}"
                     if on else "off (float32)"))
    for k in ("train", "loss_fn", "optimizer", "level"):
        if cfg.get(k) is not None:
            rows.append((k, str(cfg[k])))
    rows += [(k, v) for k, v in env.items() if k not in {r[0] for r in rows} and k != "device_type"]
    return rows


def reached_text(occ: Occurrence) -> str:
    if occ.reached is None:
        return "not measured"
    if not occ.reached:
        return "nothing (silent: absorbed before the loss and the gradients)"
    return ", ".join(occ.reached)


def birth_rows(occ: Occurrence) -> list[tuple[str, list[Span]]]:
    f = occ.output.full
    kind = _kind(occ.kind)
    if f is not None:
        kind += f" ({f.nan} NaN, {f.posinf} +Inf, {f.neginf} -Inf of {f.numel})"
    module = [Span(label(occ.module), occ.module is not None)]
    if occ.module is not None and occ.module_class:
        module.append(Span(f" ({occ.module_class})"))
    return [
        ("phase", [Span(occ.phase.value)]),
        ("module", module),
        ("call index", [Span(str(occ.call_index))]),
        ("op", [Span(occ.op, True)] if occ.op else [Span(f"- ({occ.output.role.value})")]),
        ("value", [Span(kind)]),
        ("output", [Span(f"{occ.output.dtype} {list(occ.output.shape)}")]),
        ("source", [Span(occ.source, True)] if occ.source else [Span("-")]),
        *([("line", [Span(occ.source_text, True)])] if occ.source_text else []),
        ("reached", [Span(reached_text(occ))]),
    ]


TENSOR_COLUMNS = ("tensor", "dtype", "shape", "min", "max", "max |x|", "dtype max", "headroom", "nan", "+inf",
                  "-inf", "zeros")


def tensor_rows(occ: Occurrence) -> list[tuple[str, ...]]:
    """The op's inputs and output against the limits of their dtype."""
    rows: list[tuple[str, ...]] = []
    seen = occ.output.input_shapes  # as the op saw them (a record may be a view's base)
    named = [(f"input {i}", r, seen[i] if seen is not None and i < len(seen) else r.shape)
             for i, r in enumerate(occ.inputs)] + [("output", occ.output, occ.output.shape)]
    for name, r, shape in named:
        f = r.full
        limit = limit_of(r.dtype)
        rows.append((
            name, r.dtype, str(list(shape)), num(r.min), num(r.max), num(r.absmax),
            "-" if limit is None else f"{limit:.6g}", headroom(r),
            *(("-",) * 4 if f is None else (str(f.nan), str(f.posinf), str(f.neginf), str(f.zeros))),
        ))
    return rows


def path_label(r: Record) -> list[Span]:
    out = [Span(f"{r.phase.value} ")]
    if r.module is not None:
        out += [Span(f"{label(r.module)}#{r.call_index}", True), Span(" ")]
    if r.op is not None:
        out += [Span(r.op, True), Span(" ")]
    state = "finite" if r.finite else ("NaN" if r.has_nan else "Inf")
    out.append(Span(f"{r.role.value} ({r.dtype} {list(r.shape)}, {state})"))
    return out


def occurrence_spans(o: Occurrence) -> list[Span]:
    """One origin in a line: ``NaN in phase forward, <module> at <op> (allowed) (silent)``."""
    spans = [Span(f"{_kind(o.kind)} in phase {o.phase.value}, "), Span(label(o.module), o.module is not None)]
    if o.op:
        spans += [Span(" at "), Span(o.op, True)]
    if o.allowed:
        spans.append(Span(" (allowed)"))
    if o.silent:
        spans.append(Span(" (silent)"))
    return spans


def repro_text(report: Report) -> list[Span]:
    rp = report.repro
    if rp is None:
        return [Span("No repro bundle (write one with --bundle DIR).")]
    ins = ", ".join(f"{dt} {list(shape)}" for dt, shape in rp.inputs) or "no tensors"
    ac = f"under autocast {rp.device_type} {rp.autocast_dtype}" if rp.autocast_dtype else "with autocast off"
    out = [Span(rp.op, True), Span(f" alone on its saved inputs ({ins}), {ac}, on {rp.device_type}.")]
    if rp.sliced:
        was = ", ".join(str(list(s)) for s in rp.original_shapes)
        out.append(Span(f" The inputs (as the op ran: {was}) were narrowed to the smallest slice that still reproduces."))
    if rp.verified:
        out.append(Span(f" Repro verified: a fresh Python process ran it and got {_kind(rp.result)}."))
    else:
        out.append(Span(f" Repro NOT verified: {rp.result or 'it was not run'}."))
    return out


ADVICE_TITLE = "Suggested fixes"
ADVICE_INTRO = "beyond float32, each with the measurement of this replay that calls for it"


def guard_rows(report: Report) -> list[tuple[str, str]]:
    """The Guard's event the capture came with: the failing step, the kind of detection, what it said, the
    rank; [] when the capture came from elsewhere."""
    e = report.guard_event
    if e is None:
        return []
    rows = [("failing step", str(e.step)), ("kind", e.kind), ("detail", e.detail)]
    if e.rank is not None:
        seen = f" (seen first by rank(s) {', '.join(map(str, e.ranks))})" if e.ranks else ""
        rows.append(("rank", f"{e.rank}{seen}"))
    if e.captured_step is not None and e.captured_step != e.step:
        rows.append(("capture", f"the last good snapshot, the start of step {e.captured_step}"))
    elif e.captured_step is not None:
        rows.append(("capture", f"the state step {e.step} began with" if e.pre_update else
                     "the state with the weights already non-finite"))
    if e.iterations:
        rows.append(("steps run", f"{e.iterations} ({e.updates} updates, {e.skipped} skipped by GradScaler)"))
    if e.scale is not None:
        rows.append(("GradScaler scale", num(e.scale)))
    return rows


def guard_text(report: Report) -> str | None:
    """The Guard's event in one line, or None."""
    e = report.guard_event
    if e is None:
        return None
    rank = f", rank {e.rank}" if e.rank is not None else ""
    return f"the Guard stopped at step {e.step} ({e.kind}{rank}): {e.detail}"


# ------------------------------------------------------------------ nanhunt compare
#
# The sentences and table cells of a comparison report, shared by the console, Markdown and HTML. A module
# call's label (``TensorDiff.label()``) and class are user names: the renderers set and escape them.

RULE_LABEL = "rule (fixed before the run)"
NOTHING_COMPARED = "nothing was compared: a non-finite float32 run is no reference for precision"
ERROR_DEFINITION = ("err = max |amp - ref| / max |ref| of a value; introduced = output err - input err - what the "
                    "call's sub-calls introduced")
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
    if c.alternatives:
        each = ", ".join(f"{x.dtype} {_verdict(x)}" + ("" if x.accepted else f" ({_violations(x)})")
                         for x in c.candidates())
        return f"{compare_verdict(c)}: autocast {each} against the float32 reference{_set_text(c)}"
    tail = "" if c.accepted else f" ({_violations(c)})"
    return f"{compare_verdict(c)}: autocast {c.dtype} against the float32 reference{tail}{_set_text(c)}"


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
        head = f"autocast {x.dtype}: " if c.alternatives else ""
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
    return f"autocast {c.dtype}: {_verdict(c)}" + ("" if c.accepted else f" ({_violations(c)})")


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
    text = (f"quality ({q.metric}, {_quality_sense(q)}) on {q.n} samples: float32 {num(q.ref)}, autocast {c.dtype} "
            f"{num(q.amp)}: {how}")
    if q.ref_max_error is not None or q.amp_max_error is not None:
        text += f"; largest error float32 {num(q.ref_max_error)}, {c.dtype} {num(q.amp_max_error)}"
    if q.worse:
        text += f"; worse under autocast: {sample_list(c, q.worse)}"
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
                untimed.append(f"speed of autocast {x.dtype} {x.speed.reason}")
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
        rows.append((f"autocast {c.dtype}", "not run"))
    else:
        rows.append((f"autocast {c.dtype}", f"{amp_state(c)}, loss {num(c.amp_loss)}"))
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
