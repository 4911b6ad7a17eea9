"""Private: the words and numbers every text renderer shares, as plain, unescaped strings.

Text that names user things (modules, ops, source lines) comes as ``Span`` lists so
that each format can set them as code and escape them its own way.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..records import Occurrence, Record, Report

__all__ = ["Span", "num", "label", "limit_of", "headroom", "sentence", "verdict_text", "scaler_text",
           "environment_rows", "birth_rows", "tensor_rows", "TENSOR_COLUMNS", "repro_text", "path_label"]

LIMITS = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
          "float64": 1.7976931348623157e308}


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
        out.append(Span(f" ({occ.output.role.value})"))
    v = report.verdict
    if v is not None and v.kind == "precision" and v.culprits:
        out.append(Span("; running "))
        for i, c in enumerate(v.culprits):
            out += ([Span(", ")] if i else []) + [Span(label(c), True)]
        out.append(Span(" in float32 makes the step finite" + ("" if v.confirmed else " (not confirmed)")))
    elif v is not None and v.kind == "not-precision":
        out.append(Span("; it fails in float32 too: not a precision problem"))
    elif v is not None and v.kind == "scale-induced":
        out.append(Span("; only the loss scale makes the gradients overflow (GradScaler skips this step)"))
    if occ.silent:
        out.append(Span(" (silent: absorbed before the loss and the gradients)"))
    out.append(Span("."))
    return out


def verdict_text(report: Report) -> list[Span]:
    """The bisection's verdict, longer than the sentence."""
    v = report.verdict
    if v is None:
        return [Span("No bisection was run (--no-bisect).")]
    if v.kind == "precision":
        out = [Span("Precision problem: running ")]
        for i, c in enumerate(v.culprits):
            out += ([Span(", ")] if i else []) + [Span(label(c), True)]
        state = "confirmed" if v.confirmed else "NOT confirmed"
        out.append(Span(f" in float32 makes the step finite ({state}; {v.replays} replays, {v.seconds:.1f} s"
                        f"{', interrupted' if v.interrupted else ''})."))
        return out
    if v.kind == "not-precision":
        out = [Span("Not a precision problem: the step fails in float32 too")]
        if v.float32_first is not None:
            f = v.float32_first
            out += [Span(f"; in float32 {_kind(f.kind)} is born in "), Span(label(f.module), True)]
            if f.op:
                out += [Span(" at "), Span(f.op, True)]
        out.append(Span("."))
        return out
    if v.kind == "scale-induced":
        return [Span("Scale-induced: the gradients overflow only because of the loss scale; GradScaler backs off "
                     "and skips this step (a bug only if it keeps happening).")]
    if v.kind == "not-reproducible":
        return [Span("Not reproducible: the original configuration ran finite when replayed again.")]
    return [Span("Clean: nothing to bisect.")]


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
