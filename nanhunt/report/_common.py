"""Private: the words and numbers every text renderer shares, as plain, unescaped strings: a replay's report
here, a comparison's (``nanhunt compare``) in :mod:`._compare_text`.

Text that names user things (modules, ops, source lines) comes as ``Span`` lists so
that each format can set them as code and escape them its own way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .._util._limits import squared_inputs, squared_limit
from .._util._text import cut
from ..records import (DTYPE_MAX, HeadroomHistory, HeadroomSeries, Occurrence, Record, Report, ReportConfig, Status,
                       Verdict, VerdictKind, role_text)

__all__ = ["Span", "num", "label", "limit_of", "headroom", "sentence", "verdict_text", "scaler_text",
           "environment_rows", "birth_rows", "tensor_rows", "tensor_levels", "tensor_note", "TENSOR_COLUMNS",
           "repro_text", "occurrence_spans",
           "path_label", "ADVICE_TITLE", "ADVICE_INTRO", "GUARD_TITLE", "BORN_TITLE", "TENSORS_TITLE", "PATH_TITLE",
           "BISECTION_TITLE", "bisection_title", "SCALER_TITLE", "ENVIRONMENT_TITLE", "REPRODUCE_TITLE", "guard_rows", "guard_text",
           "origin_alone", "HEADROOM_TITLE", "HEADROOM_COLUMNS", "headroom_intro", "headroom_rows",
           "headroom_warnings", "series_label", "limit_name", "HEADROOM_CAPTION", "NOT_MEASURED", "CASTS_TITLE",
           "CAST_COLUMNS", "cast_rows", "cast_sentence", "operand_name", "share"]

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


SQUARED_MARK = " (x²)"  # a headroom judged against where the value's square overflows


def _room(r: Record, squared: bool) -> tuple[float, bool] | None:
    """What ``r``'s largest magnitude is judged against, and whether that is where its square overflows (an
    input the op squares, of a dtype judged so: :func:`nanhunt._util._limits.squared_limit`, the Guard's rule);
    None for a dtype without a known limit."""
    limit = LIMITS.get(r.dtype)
    if limit is None:
        return None
    room = squared_limit(limit) if squared else limit
    return room, room != limit


def headroom(r: Record, squared: bool = False) -> str:
    """How many times larger the values could grow before the dtype overflows; ``squared`` (an input the op
    squares on its way: a norm's variance): before their square does, marked ``(x²)``."""
    judged = _room(r, squared)
    if judged is None:
        return "-"
    if not r.finite:
        return "overflowed" if r.has_inf else "-"
    a = r.absmax
    room, of_square = judged
    return "inf" if a == 0 else f"{room / a:.3g}x" + (SQUARED_MARK if of_square else "")


NOT_MEASURED = "not measured"  # a tensor subclass whose values the trace could not read


def _kind(kind: str) -> str:
    return "NaN" if kind == "nan" else "Inf"


def sentence(report: Report) -> list[Span]:
    """The verdict in one sentence."""
    if report.status == Status.NOT_REPRODUCIBLE:
        e, v = report.guard_event, report.verdict
        if e is not None and v is not None and v.kind == VerdictKind.NOT_REPRODUCIBLE and not any(report.runs):
            n = f"{v.replays} replay{'s' if v.replays != 1 else ''}"
            return [Span(f"Not reproducible: the Guard saw step {e.step} fail ({e.detail}), but the replay of its "
                         f"capture stayed finite ({n}).")]
        return [Span("Not reproducible: two replays of the same step disagree on where the first non-finite "
                     "value is born.")]
    if report.status == Status.COMPILE_INDUCED and report.verdict is not None:
        return compiled_sentence(report.verdict)
    occ = report.first
    if occ is None:
        if report.status == Status.CLEAN:
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
    if v is not None and v.kind == VerdictKind.PRECISION and v.culprits:
        out.append(Span("; running "))
        out += _culprits(v.culprits)
        gone = "makes its origin go away" if v.silent else "makes the step finite"
        out.append(Span(f" in float32 {gone}" + ("" if v.confirmed else " (not confirmed)")))
    elif v is not None and v.kind == VerdictKind.FLOAT8_INDUCED and v.culprits:
        out.append(Span("; running "))
        out += _culprits(v.culprits)
        gone = "makes its origin go away" if v.silent else "makes the step finite"
        out.append(Span(f" out of float8 (as nn.Linear) {gone}" + ("" if v.confirmed else " (not confirmed)")))
    elif v is not None and v.kind == VerdictKind.NOT_PRECISION:
        out.append(Span("; it fails in float32 too: not a precision problem"))
    elif v is not None and v.kind == VerdictKind.SCALE_INDUCED:
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
    if v.kind == VerdictKind.PRECISION:
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
    if v.kind == VerdictKind.FLOAT8_INDUCED:
        return _float8_text(v)
    if v.kind == VerdictKind.NOT_PRECISION:
        out = [Span("Not a precision problem: the step fails in float32 too")]
        if v.float32_first is not None:
            f = v.float32_first
            out.append(Span(f"; in float32 {_kind(f.kind)} is born "))
            out += [Span("outside the model")] if f.module is None else [Span("in "), Span(label(f.module), True)]
            if f.op:
                out += [Span(" at "), Span(f.op, True)]
        out.append(Span("."))
        return out
    if v.kind == VerdictKind.SCALE_INDUCED:
        return [Span("Scale-induced: the gradients overflow only because of the loss scale; GradScaler backs off "
                     "and skips this step (a bug only if it keeps happening).")]
    if v.kind == VerdictKind.COMPILE_INDUCED:
        return compiled_verdict(v)
    if v.kind == VerdictKind.NOT_REPRODUCIBLE:
        e = report.guard_event
        if e is not None and not any(report.runs):
            return [Span(_not_reproduced(e.step, e.captured_step, e.pre_update, v.replays))]
        return [Span("Not reproducible: the original configuration ran finite when replayed again.")]
    if v.kind == VerdictKind.INTERRUPTED:
        return [Span(f"Interrupted after {v.replays} replays ({v.seconds:.1f} s), before any culprit was found.")]
    return [Span("Clean: nothing to bisect.")]


def _float8_text(v: Verdict) -> list[Span]:
    """A float8-induced verdict: the layers taken out, what the rowwise recipe did on them, the fix's replay."""
    out = [Span("Float8-induced: running ")]
    out += _culprits(v.culprits)
    state = "confirmed" if v.confirmed else "NOT confirmed"
    gone = "makes the silent origin go away" if v.silent else "makes the step finite"
    out.append(Span(f" as nn.Linear on the same weights, out of float8, {gone} ({state}; {v.candidates} float8 "
                    f"layers, {v.replays} replays, {v.seconds:.1f} s{', interrupted' if v.interrupted else ''})."))
    rowwise = v.rowwise_fixes
    if rowwise is not None:
        out.append(Span(" With the rowwise recipe (a scale per row) instead, the step "
                        + ("is finite too: they can stay in float8." if rowwise else "still fails.")))
    if v.remaining is not None:
        fix = "rowwise" if rowwise else "out of float8"
        left = (f"{len(v.remaining)} origin{'s' if len(v.remaining) != 1 else ''} still born"
                if v.remaining else "no origin left")
        out.append(Span(f" The suggested fix ({fix}), measured in a traced replay: {left}."))
    return out


def compiled_sentence(v: Verdict) -> list[Span]:
    """A compile-induced step in one sentence: where the compiled graph first goes non-finite."""
    failed = next((r for r in v.rungs if r.nonfinite), None)
    backend = failed.backend if failed is not None else "the compiled backend"
    n = v.graph_node
    if n is None:
        return [Span(f"Non-finite only when compiled: eager stays finite, {backend} does not.")]
    return [Span(f"{_kind(n.kind)} born only when compiled ({backend}), "),
            *([Span("in "), Span(label(n.module), True)] if n.module is not None else [Span("outside any module")]),
            Span(f" at graph node {n.node} ({n.target}).")]


def compiled_verdict(v: Verdict) -> list[Span]:
    """The ladder's rungs, how often each failed, and the node with the user's line."""
    rungs = ", ".join(f"{r.backend} {r.nonfinite}/{r.runs} non-finite" for r in v.rungs)
    out = [Span(f"Compile-induced: the eager step is finite, a compiled one is not ({rungs}).")]
    n = v.graph_node
    if n is not None:
        where = f" at {n.source}" + (f": {n.source_text}" if n.source_text else "") if n.source else ""
        out.append(Span(f" First non-finite node of forward graph {n.graph} of {n.graphs}: {n.node} ({n.target})"
                        f"{where} (found in {n.compiles} compiles of its {n.nodes} nodes' prefixes)."))
    elif v.graph_note:
        out.append(Span(f" Not located: {v.graph_note}."))
    return out


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


def scaler_text(config: ReportConfig) -> str:
    if "scaler_scale" not in config:
        return "No GradScaler in this step (backward ran unscaled)."
    # typed: a misspelt key is a mypy error (.get of a key ReportConfig lacks gives an object)
    scale: float | None = config.get("scaler_scale")
    if scale is None:
        return "GradScaler present but disabled."
    tracker: int | None = config.get("scaler_growth_tracker")
    skip: bool | None = config.get("scaler_would_skip")
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
    rows += optimizer_rows(cfg)
    rows += [(k, v) for k, v in env.items() if k not in {r[0] for r in rows} and k != "device_type"]
    return rows


def optimizer_rows(cfg: ReportConfig) -> list[tuple[str, str]]:
    """The optimizer's hyper-parameters and its last update's size, as the replay measured them."""
    rows: list[tuple[str, str]] = []
    settings = cfg.get("optimizer_settings")
    hyper = settings.get("hyper") if isinstance(settings, dict) else None
    if isinstance(hyper, dict) and hyper:
        shown = ", ".join(f"{k}={_hyper(v)}" for k, v in hyper.items() if k in _HYPER_SHOWN)
        if shown:
            rows.append(("optimizer settings", shown))
    u = cfg.get("last_update")
    if isinstance(u, dict) and isinstance(u.get("ratio"), (int, float)):
        rows.append(("last update", f"{float(u['ratio']):.3g} x the weight at {label(str(u.get('at', '?')))} "
                                    f"(median {float(u.get('median', math.nan)):.3g} over {u.get('params', '?')} "
                                    f"parameters; {u.get('how', '')})"))
    return rows


_HYPER_SHOWN = ("lr", "momentum", "betas", "eps", "weight_decay")


def _hyper(v: object) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_hyper(x) for x in v) + "]"
    return "?"


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
        *(("float8 cast", cast_sentence(r)) for r in occ.casts if r.cast is not None),
    ]


TENSOR_COLUMNS = ("tensor", "dtype", "shape", "min", "max", "max |x|", "dtype max", "headroom", "nan", "+inf",
                  "-inf", "zeros")


def _squared(occ: Occurrence) -> frozenset[int]:
    """The positions of the inputs the origin's op squares (:func:`nanhunt._util._limits.squared_inputs`)."""
    return squared_inputs(occ.op, tuple(r.index for r in occ.inputs))


def tensor_rows(occ: Occurrence) -> list[tuple[str, ...]]:
    """The op's inputs and output against the limits of their dtype (an input the op squares: against where its
    square overflows, as the Guard judges it)."""
    rows: list[tuple[str, ...]] = []
    seen = occ.output.input_shapes  # as the op saw them (a record may be a view's base)
    squared = _squared(occ)
    named = [(f"input {i}", r, seen[i] if seen is not None and i < len(seen) else r.shape, i in squared)
             for i, r in enumerate(occ.inputs)] + [("output", occ.output, occ.output.shape, False)]
    for name, r, shape, sq in named:
        f = r.full
        limit = limit_of(r.dtype)
        values = (num(r.min), num(r.max), num(r.absmax)) if r.measured else (NOT_MEASURED,) * 3
        rows.append((
            name, r.dtype, str(list(shape)), *values,
            "-" if limit is None else f"{limit:.6g}", headroom(r, sq) if r.measured else NOT_MEASURED,
            *(("-",) * 4 if f is None else (str(f.nan), str(f.posinf), str(f.neginf), str(f.zeros))),
        ))
    return rows


NEAR = 16.0  # a headroom below this is near the limit (marked in the HTML table)


def tensor_levels(occ: Occurrence) -> list[str]:
    """Each row of :func:`tensor_rows`'s headroom: ``"over"`` (it overflowed; an input whose square passed the
    limit), ``"near"`` (within :data:`NEAR` times of it) or ``""``."""
    squared = _squared(occ)
    out = []
    for i, r in enumerate((*occ.inputs, occ.output)):
        judged = _room(r, i in squared)  # the output's position is past every input's
        if judged is None:
            out.append("")
        elif not r.finite:
            out.append("over" if r.has_inf else "")
        else:
            factor = math.inf if r.absmax == 0 else judged[0] / r.absmax
            out.append("over" if factor < 1 else "near" if factor < NEAR else "")
    return out


def tensor_note(occ: Occurrence) -> str | None:
    """What ``(x²)`` in the headroom column means, when a row holds it; else None."""
    at = TENSOR_COLUMNS.index("headroom")
    if not any(row[at].endswith(SQUARED_MARK) for row in tensor_rows(occ)):
        return None
    return (f"{SQUARED_MARK.strip()}: the op squares this input on its way (a norm's variance, a sum of squares, "
            "x * x), so its headroom is how many times larger it could grow before its square overflows: against "
            "the square root of its dtype's max (1.84e+19 for float32 and bfloat16), as the Guard judges it.")


def path_label(r: Record) -> list[Span]:
    out = [Span(f"{r.phase.value} ")]
    if r.module is not None:
        out += [Span(f"{label(r.module)}#{r.call_index}", True), Span(" ")]
    if r.op is not None:
        out += [Span(r.op, True), Span(" ")]
    state = NOT_MEASURED if not r.measured else "finite" if r.finite else ("NaN" if r.has_nan else "Inf")
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


# The sections of a replay's report, titled alike in Markdown and HTML (the console titles only its tables)
GUARD_TITLE = "Guard event"
BORN_TITLE = "Where it was born"
TENSORS_TITLE = "The op's tensors against their dtype's limits"
PATH_TITLE = "Propagation path"
BISECTION_TITLE = "Bisection by local float32"
FLOAT8_BISECTION_TITLE = "Bisection by taking layers out of float8"


def bisection_title(report: Report) -> str:
    """The bisection section's title: what its trials changed (local float32, or layers taken out of float8)."""
    v = report.verdict
    return FLOAT8_BISECTION_TITLE if v is not None and v.kind == VerdictKind.FLOAT8_INDUCED else BISECTION_TITLE
SCALER_TITLE = "GradScaler"
ENVIRONMENT_TITLE = "Environment"
REPRODUCE_TITLE = "Reproduce"
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


HEADROOM_TITLE = "Headroom before the Guard's event"
HEADROOM_COLUMNS = ("module", "condition", "last max", "headroom", "growth per 100 steps", "overflow forecast")
HEADROOM_CAPTION = ("x: the training steps the Guard sampled; y: the largest magnitude of each module's output or "
                    "output gradient (unscaled), on a log scale. Dashed lines: the float16 and bfloat16 maxima where "
                    "they fall in range. A rising series goes on, dashed, from its last sample to the step its "
                    "trend meets the limit (its overflow forecast). Triangles at the top: the steps of the Guard's "
                    "warnings (hover for the text); the dotted line: the step of this capture's event. Under the "
                    "chart, where the Guard kept them: the loss, the gradient norm and the GradScaler's scale on the "
                    "same steps.")


def limit_name(limit: float) -> str:
    """``float16`` for 65504, and so on; for the square root of a dtype's limit (what the Guard judges a bfloat16
    or float32 value against), the number and where its square overflows; the number itself for another limit."""
    return next((name for name, v in DTYPE_MAX.items() if v == limit),
                next((f"{limit:.3g}, where its square overflows {name}" for name, v in DTYPE_MAX.items()
                      if math.sqrt(v) == limit), f"{limit:.3g}"))


def series_label(s: HeadroomSeries) -> str:
    """A series in a legend: ``fc1 output``."""
    return f"{label(s.module)} {s.condition}"


def headroom_intro(h: HeadroomHistory) -> str:
    """What the headroom table and chart show, in a sentence."""
    n, w = len(h.series), len(h.warnings)
    return (f"The Guard's headroom history up to step {h.step}, on the steps it sampled: the largest magnitude of "
            f"the {n} module output{'s' if n != 1 else ''} or output gradient{'s' if n != 1 else ''} nearest their "
            f"dtype's limit (those warned about first), and {w} warning{'s' if w != 1 else ''} given.")


def headroom_rows(h: HeadroomHistory) -> list[tuple[str, ...]]:
    """One row per series, cells as ``HEADROOM_COLUMNS``; the module (the first cell) is a user name."""
    rows: list[tuple[str, ...]] = []
    for s in h.series:
        last = 2.0 ** s.log2max[-1]
        rows.append((label(s.module), s.condition, f"{last:.3g}", f"{s.limit / last:.3g}x to {limit_name(s.limit)}",
                     "-" if s.growth is None else f"{s.growth:.3g}x",
                     "-" if s.forecast_step is None else f"step {s.forecast_step}"))
    return rows


def headroom_warnings(h: HeadroomHistory) -> list[str]:
    """The Guard's warnings, one line each: ``step 120: fc1 output: max ...``."""
    return [f"step {w.step}: {w.detail}" for w in h.warnings]


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


# ------------------------------------------------------------------ float8 casts
CASTS_TITLE = "Float8 casts feeding the op"
CAST_COLUMNS = ("value", "phase", "format", "recipe", "amax", "scale", "to zero", "at max")
_OPERANDS = {"input": "input", "weight": "weight", "grad_output": "output gradient"}


def operand_name(r: Record) -> str:
    """``proj's input``: the GEMM operand a float8 cast made, by its module (``value`` when not known)."""
    c = r.cast
    what = _OPERANDS.get(c.gemm_input or "", "value") if c is not None else "value"
    return f"{cut(label(r.module))}'s {what}"


def share(n: int, of: int) -> str:
    """``94%`` of ``of``; a share under 1% with two digits (``0.2%``), none ``0%``."""
    if not of or not n:
        return "0%"
    p = 100 * n / of
    return f"{p:.0f}%" if p >= 1 else f"{p:.2g}%"


def _scale_text(lo: float | None, hi: float | None) -> str:
    if lo is None or hi is None:
        return "-"
    return num(lo) if lo == hi else f"{num(lo)} to {num(hi)}"


def cast_sentence(r: Record) -> list[Span]:
    """``proj's input lost 94% of its values to zero in its float8 cast (float8_e4m3fn, tensorwise scale 0.01367
    from amax 3.277e+04)``."""
    c = r.cast
    if c is None:
        return []
    what = _OPERANDS.get(c.gemm_input or "", "value")
    lost = []
    if c.zeros and (c.zero_share >= c.STORY_SHARE or c.saturated_share < c.STORY_SHARE):
        lost.append(f"lost {share(c.zeros, c.numel)} of its values to zero")
    if c.saturated_share >= c.STORY_SHARE:
        lost.append(f"had {share(c.saturated, c.numel)} at the format's maximum ({num(c.format_max)})")
    how = [cut(c.format)]  # a report's words, read from a file: bounded like a name
    scale = _scale_text(c.scale_min, c.scale_max)
    if scale != "-" or c.recipe:
        how.append(" ".join(x for x in (cut(c.recipe or ""), "scale", None if scale == "-" else scale) if x))
    if c.amax is not None:
        how[-1] += f" from amax {num(c.amax)}"
    return [Span(label(r.module), r.module is not None),
            Span(f"'s {what} {' and '.join(lost) or 'lost nothing'} in its float8 cast ({', '.join(how)})")]


def cast_rows(occ: Occurrence) -> list[tuple[str, ...]]:
    """The casts :attr:`Occurrence.casts` names, one row each."""
    rows: list[tuple[str, ...]] = []
    for r in occ.casts:
        c = r.cast
        if c is None:
            continue
        rows.append((operand_name(r), r.phase.value, cut(c.format), cut(c.recipe or "-"), num(c.amax),
                     _scale_text(c.scale_min, c.scale_max), f"{c.zeros} of {c.numel} ({share(c.zeros, c.numel)})",
                     f"{c.saturated} ({share(c.saturated, c.numel)})"))
    return rows
