"""Fixes beyond float32: the idiomatic code fix for the common patterns, derived from what a replay measured.

Local float32 (``keep_fp32_permanently``) makes most precision findings go away, but it is rarely the fix an
engineer would write: a hand-written softmax wants its max subtracted, a ``log`` of a probability wants
``log_softmax``. Each rule here reads only the :class:`~nanhunt.records.Report` (the origin's op, kind, phase
and dtype, its inputs' statistics, the configuration the step ran with) and fires only when the measurement it
names is there; the :class:`~nanhunt.records.Advice` it returns quotes that measurement in ``because``. A
finding that matches no rule gets no advice (the bisection's float32 fix stays the only one).

Pure: imports nothing but ``records`` (no torch), like the renderers.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

from ..records import (DTYPE_MAX, FP16_SMALLEST_NORMAL, Advice, BackwardUnderflow, LastUpdate, Occurrence, Phase,
                       Record, Report, Role, VerdictKind)

__all__ = ["advise", "PATTERNS"]

# The patterns, in the order they are checked: id -> what triggers it (README "How it decides" lists them).
PATTERNS: dict[str, str] = {
    "exp-overflow-softmax": "aten::exp makes +Inf in forward or loss from an input above ln(dtype max) (-Inf where "
                            "masked, or finite), and the next division on its path makes NaN (Inf / Inf: a "
                            "hand-written softmax)",
    "log-of-zero": "aten::log (log2, log10) makes -Inf from an input whose min is exactly 0",
    "grad-at-zero": "a NaN/Inf born in backward that reaches a sink, in the derivative of sqrt, rsqrt, pow or a "
                    "norm, with an input holding zeros",
    "masked-softmax-row": "a softmax (or log_softmax) makes NaN from an input holding -Inf but no +Inf or NaN: a "
                          "row with every key masked",
    "fp16-matmul-overflow": "mm / addmm / bmm / matmul / linear makes Inf in float16 (forward or loss) from finite "
                            "inputs",
    "fp16-optimizer-eps": "a NaN/Inf born in the update in float16 while the optimizer's eps is below float16's "
                          "smallest normal (6.1e-05)",
    "fp16-grad-underflow": "no (enabled) GradScaler, and float16 tensors of the backward whose largest |x| is "
                           "below float16's smallest normal",
    "learning-rate": "the optimizer's last update before the step, measured from its state (Adam's moments, SGD's "
                     "momentum buffer), moved some parameter by at least its own norm (||update|| / ||weight|| >= 1)",
    "uninitialised-read": "the origin is a read of memory allocated uninitialised (torch.empty) and written only in "
                          "part, non-finite while every write into it since was finite",
}

_EXP = frozenset({"aten::exp", "aten::exp_"})
_DIV = frozenset({"aten::div", "aten::div_"})
_LOG = frozenset({"aten::log", "aten::log_", "aten::log2", "aten::log2_", "aten::log10", "aten::log10_"})
_UNDERFLOWS = frozenset({"aten::_softmax", "aten::softmax", "aten::exp", "aten::sigmoid"})
# ops whose derivative is infinite (or 0/0) where their argument is 0
_SINGULAR = frozenset({"aten::sqrt", "aten::sqrt_", "aten::rsqrt", "aten::pow", "aten::pow_",
                       "aten::linalg_vector_norm", "aten::norm", "aten::frobenius_norm", "aten::linalg_norm"})
_SOFTMAX = frozenset({"aten::_softmax", "aten::softmax", "aten::_log_softmax", "aten::log_softmax"})
_MATMUL = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
                     "aten::linear", "aten::mv", "aten::addmv", "aten::_addmm_activation"})


def advise(report: Report) -> tuple[Advice, ...]:
    """The fixes beyond float32 that this report's measurements support, each with the measurement that
    triggered it. The culprit is examined first, then the other origins (harmless and allowed ones never);
    each pattern is given at most once."""
    found: dict[str, Advice] = {}
    for occ in _examined(report):
        for rule in _ORIGIN_RULES:
            a = rule(occ, report)
            if a is not None and a.pattern not in found:
                found[a.pattern] = a
    for step_rule in (_grad_underflow, _learning_rate):
        a = step_rule(report)
        if a is not None:
            found[a.pattern] = a
    return tuple(found.values())


def _examined(report: Report) -> Iterator[Occurrence]:
    if report.first is not None:
        yield report.first
    for o in report.origins:
        if not (o.harmless or o.allowed) and o != report.first:
            yield o


# ------------------------------------------------------------------ words and numbers


def _num(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _kind(occ: Occurrence) -> str:
    if occ.kind == "nan":
        return "NaN"
    out = occ.output
    return "-Inf" if out.min == -math.inf and out.max != math.inf else "+Inf" if out.min != -math.inf else "Inf"


def _tensor(r: Record) -> str:
    return f"{r.op or r.role.value}, {r.dtype} {list(r.shape)}"


def _at(occ: Occurrence) -> str:
    """``aten::exp made +Inf in phase forward (float32, module blocks.0)``."""
    where = "" if occ.module is None else f", module {occ.module or '<root>'}"
    return f"{occ.op} made {_kind(occ)} in phase {occ.phase.value} ({occ.output.dtype}{where})"


def _zeros(r: Record) -> str:
    f = r.full
    if f is not None:
        return f"{f.zeros} zeros of {f.numel}"
    return "zeros"


def _holds_zero(r: Record) -> bool:
    if not r.finite:
        return False
    if r.full is not None:
        return r.full.zeros > 0
    return r.min == 0 or r.max == 0  # without the counts, only a min or max of 0 proves a zero


def _py_name(name: str | None) -> str:
    return repr(name if name is not None else "")


# ------------------------------------------------------------------ one origin


def _exp_softmax(occ: Occurrence, report: Report) -> Advice | None:
    if occ.op not in _EXP or occ.kind != "inf" or occ.phase not in (Phase.FORWARD, Phase.LOSS):
        return None
    limit = DTYPE_MAX.get(occ.output.dtype)
    x = occ.inputs[0] if occ.inputs else None
    # a causal / padding mask's -inf may sit in its input: exp makes 0 of it
    if limit is None or x is None or x.has_nan or not math.log(limit) < x.max < math.inf:
        return None
    div = _normalisation(occ, report)
    if div is None:
        return None
    masked = ", -Inf where masked" if x.min == -math.inf else ""
    return Advice(
        pattern="exp-overflow-softmax",
        advice="Subtract the row max before exp (a hand-written softmax), or call F.softmax / torch.logsumexp, "
               "which do it for you.",
        fix="w = F.softmax(scores, dim=-1)  # instead of e = scores.exp(); w = e / e.sum(-1, keepdim=True)\n"
            "e = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # or by hand: exp(x - max) <= 1",
        because=(f"{_at(occ)}: its input ({_tensor(x)}) has max {_num(x.max)} > {_num(math.log(limit))} = "
                 f"ln({occ.output.dtype} max){masked}; then {div.op} made NaN (Inf / Inf), a softmax's normalisation"),
    )


def _normalisation(occ: Occurrence, report: Report) -> Record | None:
    """The division on the culprit's propagation path, right after it, that made NaN of its Inf."""
    path = report.path
    if report.first is not occ or not path or path[0].index != occ.output.index:
        return None
    return next((r for r in path[1:4] if r.op in _DIV and r.has_nan), None)


def _log_of_zero(occ: Occurrence, report: Report) -> Advice | None:
    if occ.op not in _LOG or occ.kind != "inf":
        return None
    x = occ.inputs[0] if occ.inputs else None
    if x is None or not x.finite or x.min != 0:  # min exactly 0: no negative argument, log(0) = -inf
        return None
    under = x.op in _UNDERFLOWS
    how = f", {x.op} having underflowed to 0" if under else ""
    softmax = x.op in ("aten::_softmax", "aten::softmax")
    lines = ["logp = F.log_softmax(logits, dim=-1)  # instead of torch.log(F.softmax(logits, dim=-1))",
             "logp = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))  # a probability from elsewhere"]
    return Advice(
        pattern="log-of-zero",
        advice=("Take the log in log space: F.log_softmax instead of log(softmax(...)); or clamp the argument "
                "above 0 with clamp_min."),
        fix="\n".join(lines if softmax else lines[::-1]),
        because=f"{_at(occ)}: its input ({_tensor(x)}) has min 0 ({_zeros(x)}){how}: log(0) = -inf",
    )


def _grad_at_zero(occ: Occurrence, report: Report) -> Advice | None:
    if occ.phase is not Phase.BACKWARD or occ.silent:  # silent: the backward itself absorbed it (norm's 0/0)
        return None
    of = [op for op in (occ.op, *occ.forward_ops) if op in _SINGULAR]
    zeros = [(i, r) for i, r in enumerate(occ.inputs) if _holds_zero(r)]
    if not of or not zeros:
        return None
    held = "; ".join(f"input {i} ({_tensor(r)}) holds {_zeros(r)}" for i, r in zeros)
    return Advice(
        pattern="grad-at-zero",
        advice="Put an epsilon inside the root (sqrt(x + eps)), or normalise with F.normalize(x, eps=...): the "
               "derivative of sqrt, pow(x, p < 1) and norm is infinite at 0.",
        fix="eps = torch.finfo(x.dtype).eps\n"
            "r = torch.sqrt(x + eps)  # instead of torch.sqrt(x): finite gradient at x = 0\n"
            "u = F.normalize(v, dim=-1, eps=torch.finfo(v.dtype).tiny)  # instead of v / v.norm(dim=-1, keepdim=True)",
        because=f"{_at(occ)}, in the derivative of {of[0]}: {held}",
    )


def _masked_row(occ: Occurrence, report: Report) -> Advice | None:
    if occ.op not in _SOFTMAX or occ.kind != "nan" or not occ.inputs:
        return None
    x = occ.inputs[0]
    if x.has_nan or x.min != -math.inf or x.max == math.inf:
        return None
    f = x.full
    count = f" ({f.neginf} of {f.numel})" if f is not None else ""
    return Advice(
        pattern="masked-softmax-row",
        advice="Keep at least one key per row in the mask (e.g. the token itself), or replace the NaN of fully "
               "masked rows after the softmax (nan_to_num).",
        fix="keep = keep | torch.eye(keep.shape[-1], dtype=torch.bool, device=keep.device)  # one key per row\n"
            "w = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # or: a fully masked row attends to nothing",
        because=(f"{_at(occ)}: its input ({_tensor(x)}) holds -Inf{count} and no +Inf or NaN, so a row of only "
                 "-Inf (every key masked): 0/0"),
    )


def _fp16_matmul(occ: Occurrence, report: Report) -> Advice | None:
    if (occ.op not in _MATMUL or occ.kind != "inf" or occ.output.dtype != "float16"
            or occ.phase not in (Phase.FORWARD, Phase.LOSS) or not all(r.finite for r in occ.inputs)):
        return None
    largest = ", ".join(_num(r.absmax) for r in occ.inputs)
    measured = f": its inputs' max |x| {largest}, float16's max 65504"
    v = report.verdict
    bf16 = v.alternatives.get("bfloat16") if v is not None else None
    if bf16 is not None:
        measured += f"; the whole step in bfloat16: {'finite' if bf16 else 'still non-finite'}"
    device: str | None = report.config.get("device_type")  # typed: a misspelt key is a mypy error
    device = device if isinstance(device, str) and device.isidentifier() else "cuda"
    lines = ["# bfloat16: its range reaches 3.4e38 (float16: 65504)",
             f'with torch.autocast("{device}", dtype=torch.bfloat16):',
             "    loss = loss_fn(model(x), y)"]
    if occ.module is not None:
        name = _py_name(occ.module)
        lines += ["# or this module alone in float32",
                  f'with nanhunt.keep_fp32(model, [{name}]), torch.autocast("{device}", dtype=torch.float16):',
                  "    loss = loss_fn(model(x), y)",
                  "# or a smaller initialisation of its weights",
                  f"layer = model.get_submodule({name})",
                  "torch.nn.init.normal_(layer.weight, std=layer.weight.shape[-1] ** -0.5)"]
    return Advice(
        pattern="fp16-matmul-overflow",
        advice="Run the step in bfloat16, keep this module in float32 (nanhunt.keep_fp32), or initialise its "
               "weights smaller (std 1/sqrt(fan_in)).",
        fix="\n".join(lines),
        because=_at(occ) + measured,
    )


def _fp16_eps(occ: Occurrence, report: Report) -> Advice | None:
    eps: float | None = report.config.get("optimizer_eps")
    if occ.phase is not Phase.UPDATE or occ.output.dtype != "float16" or not _real(eps):
        return None
    if not eps < FP16_SMALLEST_NORMAL:
        return None
    name: str | None = report.config.get("optimizer")
    name = name if isinstance(name, str) and name.isidentifier() else "Adam"
    as_fp16 = struct.unpack("<e", struct.pack("<e", eps))[0]
    rounded = "0" if as_fp16 == 0 else f"the subnormal {as_fp16:.3g}"
    zeros = "; ".join(f"input {i} ({_tensor(r)}) is all zeros" for i, r in enumerate(occ.inputs)
                      if r.min == 0 and r.max == 0)
    return Advice(
        pattern="fp16-optimizer-eps",
        advice=f"Keep the parameters and the {name} state in float32 (autocast for the forward only): its eps "
               "is not representable in float16.",
        fix=(f"model.float()  # float32 parameters: {name}'s state (exp_avg, exp_avg_sq) follows their dtype\n"
             f"optimizer = torch.optim.{name}(model.parameters(), eps={eps!r})  # rebuilt after .float()"),
        because=(f"{_at(occ)}: {name} eps {_num(eps)} is below float16's smallest normal "
                 f"{_num(FP16_SMALLEST_NORMAL)} (in float16 it is {rounded})" + (f"; {zeros}" if zeros else "")),
    )


def _real(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _uninitialised_read(occ: Occurrence, report: Report) -> Advice | None:
    if occ.output.role is not Role.UNWRITTEN:  # the locator made it the origin: its writes since were finite
        return None
    where = "" if occ.module is None else f" (module {occ.module or '<root>'})"
    return Advice(
        pattern="uninitialised-read",
        advice=("Write every element of a tensor made with torch.empty / new_empty / empty_like before reading it, "
                "or allocate it with torch.zeros / new_zeros (or torch.full) when part of it may stay unwritten."),
        fix=("out = torch.zeros(shape, dtype=x.dtype, device=x.device)  # instead of torch.empty(shape, ...)\n"
             "out = x.new_zeros(shape)  # instead of x.new_empty(shape)"),
        because=(f"a {occ.output.dtype} {list(occ.output.shape)} tensor read in phase {occ.phase.value}{where} holds "
                 f"{_kind(occ)} where no op wrote it: it was allocated uninitialised (torch.empty, new_empty, "
                 "empty_like) and what was written into it since is finite"),
    )


_ORIGIN_RULES: tuple[Callable[[Occurrence, Report], Advice | None], ...] = (
    _exp_softmax, _log_of_zero, _grad_at_zero, _masked_row, _fp16_matmul, _fp16_eps, _uninitialised_read)


# ------------------------------------------------------------------ the step


def _grad_underflow(report: Report) -> Advice | None:
    """Float16 gradients below the smallest normal with no GradScaler (``config["fp16_backward_underflow"]``:
    what ``hunt`` counted over the backward's records)."""
    cfg = report.config
    u: BackwardUnderflow | None = cfg.get("fp16_backward_underflow")
    if "scaler_scale" in cfg and cfg["scaler_scale"] is not None:  # an enabled scaler
        return None
    if not isinstance(u, dict):
        return None
    n, of, largest, at = u.get("tensors"), u.get("of"), u.get("largest"), u.get("at")
    if not (isinstance(n, int) and isinstance(of, int) and n > 0 and _real(largest) and isinstance(at, str)):
        return None
    scaler = "a disabled GradScaler" if "scaler_scale" in cfg else "no GradScaler"
    device: str | None = cfg.get("device_type")
    device = device if isinstance(device, str) and device.isidentifier() else "cuda"
    return Advice(
        pattern="fp16-grad-underflow",
        advice="Scale the loss with torch.amp.GradScaler so float16 gradients stay above float16's smallest "
               "normal.",
        fix=(f'scaler = torch.amp.GradScaler("{device}")\n'
             "scaler.scale(loss).backward()\n"
             "scaler.step(optimizer)  # unscales first; skips the step if a gradient is inf/NaN\n"
             "scaler.update()"),
        because=(f"{scaler}; {n} of {of} float16 tensors of the backward have their largest |x| below float16's "
                 f"smallest normal {_num(FP16_SMALLEST_NORMAL)} (largest {_num(largest)}, at {at}): subnormal, "
                 "or flushed to 0"),
    )


_TOO_LARGE = 1.0  # an update at least as large as the weight it moves: no learning rate a run means to use


def _learning_rate(report: Report) -> Advice | None:
    """The last update moved a parameter by at least its own norm (``config["last_update"]``, measured from the
    optimizer's state by the replay), with the learning rate it ran at."""
    cfg = report.config
    u: LastUpdate | None = cfg.get("last_update")
    if not isinstance(u, dict) or not isinstance(u.get("ratio"), (int, float)) or not u["ratio"] >= _TOO_LARGE:
        return None
    settings = cfg.get("optimizer_settings") or {}
    hyper = settings.get("hyper") if isinstance(settings, dict) else None
    lr = hyper.get("lr") if isinstance(hyper, dict) else None
    name = settings.get("optimizer") if isinstance(settings, dict) else None
    name = name if isinstance(name, str) and name.isidentifier() else "the optimizer"
    lr_text = (f"lr={_num(lr)}" if _real(lr) else f"lr per group {lr}" if isinstance(lr, list) else "its lr")
    v = report.verdict
    not_precision = v is not None and v.kind == VerdictKind.NOT_PRECISION
    moved = (f"by {_num(float(u['ratio']))} times its own norm" if math.isfinite(u["ratio"])
             else "by a non-finite amount (its state holds Inf or NaN)")
    because = (f"{name}'s last update ({u.get('how', 'from its state')}) moved {u.get('at', '?')} {moved} at "
               f"{lr_text} (median over {u.get('params', '?')} parameters: {_num(float(u.get('median', math.nan)))})")
    if not_precision:
        because += "; the step fails in float32 too, so no precision change fixes it"
    for t in report.headroom.tracks if report.headroom is not None else ():
        if t.name in ("loss", "gradient norm") and len(t.values) >= 2:  # the run's own history, as the Guard kept it
            median = sorted(t.values)[len(t.values) // 2]
            because += (f"; the {t.name} before it, as the Guard kept it: {_num(t.values[-1])} at step {t.steps[-1]}, "
                        f"against a median of {_num(median)} over steps {t.steps[0]}-{t.steps[-1]}")
    # a tenth as a start: the state that made the update grew with the learning rate too (the gradients of weights
    # it inflated), so no single measurement gives the lr that would have been safe
    rate = f"{_num(lr / 10)}" if _real(lr) and lr > 0 else "lr / 10"
    return Advice(
        pattern="learning-rate",
        advice="Lower the learning rate (resume from a checkpoint before the weights grew), warm it up over the "
               "first steps, and clip the gradient norm.",
        fix=("for group in optimizer.param_groups:  # the optimizer's other settings kept\n"
             f"    group['lr'] = {rate}  # a tenth; again while it diverges\n"
             "scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=1000)  # warm-up\n"
             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before optimizer.step()"),
        because=because,
    )
