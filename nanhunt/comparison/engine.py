"""Float32 reference against autocast: where the error is *introduced*, and which decisions change.

The method of ``seeds/`` (first document), automated:

1. The acceptance rule is fixed before anything runs: the tolerances (per dtype unless given),
   the task and the number of decision flips allowed. It is stored with the result and printed
   with it; the result never widens it.
2. The float32 reference (autocast disabled) runs first and is checked first. A non-finite
   reference is reported as such (``status="reference-nonfinite"``) and nothing is compared:
   it is not a precision finding.
3. The same step (forward, loss, backward; no optimizer update) runs again from the same
   parameters, buffers and RNG state under autocast. Module calls are matched by module name
   and call index; the loss and every parameter gradient are compared too.
4. Module calls are ranked by the error they *introduce*, then the decisions are compared.

Errors are measured on float32 CPU copies, in float64. A call's ``scaled`` error is
max |amp - ref| / max(max |ref|, atol): the error as a fraction of the value's own magnitude,
so a value that only carries an error it was given keeps about the same number while the
absolute error grows or shrinks with the values. A call's *gain* is its output's scaled error
minus the largest scaled error among its floating inputs (which are copied when the call
starts, before any in-place op). A container's gain also contains its sub-calls' gains, so its
``introduced`` error is its gain minus the sum of its direct sub-calls' gains (for a chain of
sub-calls the sum telescopes to the container's gain, leaving what its own code adds); a leaf's
``introduced`` error is its gain. Both are floored at 0. A non-finite output from finite inputs
introduces an infinite error; a non-finite output from a non-finite input introduces none.

Memory: each run keeps a float32 CPU copy of every floating input and output of every module
call (containers repeat their children's tensors) and of every gradient, and both runs are kept
until they are compared: about four times the activations and gradients of one step, in host
memory. That is meant for one batch of a model that fits; slice the batch for larger ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._errors import CommandError
from .._util._tree import map_tensors
from ..records import Comparison, Decision, Failure, Occurrence, Quality, Regression, Report, Rule, Speed, TensorDiff
from .._util._env import environment
from ..step.step import Step, _backward, _call_model, _loss_of, split_batch
from ..tracing.tracer import Trace

__all__ = ["compare", "History", "HISTORY_FILE", "rule_from", "settle_rule", "default_tolerances", "top_two", "TIE_RULE",
           "TASKS"]

TASKS = ("classify", "regress", "none")
TIE_RULE = "equal top scores go to the lowest class index, in both runs; a row holding NaN has no class (-1)"
# rtol from the issue (float16 1e-3, bfloat16 1e-2); atol as torch.testing's defaults for both.
_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
_ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5}
_WORST = 5  # samples listed by --task regress


class _Rule(TypedDict):
    """The acceptance rule's fields of a ``Comparison``, fixed before the run."""

    dtype: str
    device_type: str
    rtol: float
    atol: float
    task: str
    max_flips: int
    fail_on_tolerance: bool
    tie_rule: str


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used when none are given: float16 1e-3/1e-5, bfloat16 1e-2/1e-5."""
    return _RTOL[dtype], _ATOL[dtype]


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    found = getattr(torch, dtype.replace("torch.", ""), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or found not in _RTOL:
        raise CommandError(f"compare needs an autocast dtype of float16 or bfloat16, not {dtype}")
    return found


# ------------------------------------------------------------------ recording one run


def _floats(obj: Any) -> tuple[list[torch.Tensor], list[str]]:
    """Float32 CPU copies of the floating tensors in ``obj`` (nested tuples, lists, dicts), in order."""
    out: list[torch.Tensor] = []
    dtypes: list[str] = []

    def visit(o: Any, depth: int) -> None:
        if depth > 16:
            return
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                out.append(o.detach().to("cpu", torch.float32, copy=True))
                dtypes.append(str(o.dtype).replace("torch.", ""))
        elif isinstance(o, Mapping):
            for v in o.values():
                visit(v, depth + 1)
        elif isinstance(o, (tuple, list)):
            for v in o:
                visit(v, depth + 1)

    visit(obj, 0)
    return out, dtypes


@dataclass
class _Call:
    name: str
    call_index: int
    module_class: str
    depth: int
    parent: int | None  # index of the enclosing call
    start: int  # event sequence number when the call started (inputs copied)
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None  # None: the call never returned
    dtypes: list[str] = field(default_factory=list)
    end: int = -1


class _Recorder:
    """Forward pre/post hooks on every module, copying each call's floating inputs and outputs.

    Records only while ``recording`` is set (the forward and the loss), so a checkpointed
    module recomputed during backward is not a new call. Every handle is removed on exit."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.calls: list[_Call] = []
        self.recording = False
        self._counts: dict[str, int] = {}
        self._stack: list[int] = []
        self._seq = 0
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _Recorder:
        try:
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.recording:
                return
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            parent = self._stack[-1] if self._stack else None
            inputs, _ = _floats((args, kwargs))
            self.calls.append(_Call(name, index, type(module).__name__, len(self._stack), parent, self._next(), inputs))
            self._stack.append(len(self.calls) - 1)

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.recording:
                return
            for pos in range(len(self._stack) - 1, -1, -1):  # the innermost open call of this module
                call = self.calls[self._stack[pos]]
                if call.name == name:
                    del self._stack[pos:]
                    call.outputs, call.dtypes = _floats(output)
                    call.end = self._next()
                    return

        return hook


@dataclass
class _Run:
    calls: list[_Call]
    output: torch.Tensor | None  # the model's scores (float32 CPU copy), for decisions
    output_dtype: str
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    weights_nonfinite: str | None


def _scores(out: Any) -> torch.Tensor | None:
    """The model's decision scores: a tensor, ``["logits"]``/``.logits``, else the first floating tensor."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]  # type: ignore[no-any-return]
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping):
        out = [v for k, v in out.items() if k != "loss"]
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                return o
    return None


def _run(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[..., Any] | None, *, dtype: torch.dtype,
         device_type: str, amp: bool, scale: float) -> _Run:
    weights_bad = next((n for n, t in (*model.named_parameters(), *model.named_buffers())
                        if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    with _Recorder(model) as rec:
        rec.recording = True
        try:
            with torch.autocast(device_type, dtype=dtype, enabled=amp):
                out = _call_model(model, inputs)
                loss = _loss_of(out, targets, loss_fn)
        finally:
            rec.recording = False
        scores = _scores(out)
        copies, dtypes = _floats(scores) if scores is not None else ([], [])
        loss_copy = loss.detach().to("cpu", torch.float32, copy=True)
        if loss.requires_grad:
            _backward(loss * scale if scale != 1.0 else loss)
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None and p.grad.is_floating_point():
            g = p.grad.detach().to("cpu", torch.float32, copy=True)
            grads[name] = g / scale if scale != 1.0 else g  # unscaled as GradScaler.unscale_ would
    return _Run(rec.calls, copies[0] if copies else None, dtypes[0] if dtypes else "", loss_copy, grads, weights_bad)


def _absorbed(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[..., Any] | None, *, dtype: torch.dtype,
              device_type: str, scale: float, allow: Sequence[str]) -> tuple[str, ...]:
    """The autocast step once more, traced op by op: its silent origins (a non-finite value born and absorbed before
    the loss and the gradients, as a hand-written RMSNorm's float16 square of a large value: rsqrt(Inf) = 0), one
    line each. Module-level copies cannot see them: every value entering and leaving a module is finite. Harmless
    origins (feeding only indices) and those inside modules the rule allows are left out."""
    from ..hunt.pipeline import _line_text

    with Trace(model, level="op") as t:
        with torch.autocast(device_type, dtype=dtype):
            out = _call_model(model, inputs)
            loss = _loss_of(out, targets, loss_fn)
        if loss.requires_grad:
            _backward(loss * scale if scale != 1.0 else loss)
    lines = []
    for o in t.origins:
        if o.silent and not o.harmless and not (o.module is not None and _allowed(o.module, allow)):
            text = _line_text(o.source)
            lines.append(_origin_text(o) + (f", at {o.source}" if o.source else "") + (f": {text}" if text else ""))
    return tuple(lines)


def _origin_text(o: Occurrence) -> str:
    what = "NaN" if o.kind == "nan" else "Inf"
    where = "outside the model" if o.module is None else f"module {o.module or '<root>'}"
    if o.module is not None and o.module_class:
        where += f" ({o.module_class}, call {o.call_index})"
    return f"{what} born in phase {o.phase.value}, {where}, " + (f"op {o.op}" if o.op else f"role {o.output.role.value}")


def _upcast(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


def _nonfinite(ts: Iterable[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in ts)


def _call_label(c: _Call) -> str:
    return f"{c.name or '<root>'}#{c.call_index} ({c.module_class})"


def _allowed(name: str, allow: Sequence[str]) -> bool:
    """Whether a module call's name is inside a subtree the rule allows (``"<root>"``: the model's own code)."""
    if not name:
        return "<root>" in allow
    return any(name == a or name.startswith(a + ".") for a in allow if a not in ("<root>", "<input>"))


def _inside(calls: Sequence[_Call], i: int, ancestor: int) -> bool:
    p = calls[i].parent
    while p is not None:
        if p == ancestor:
            return True
        p = calls[p].parent
    return False


def _first_nonfinite(run: _Run, batch_inputs: Sequence[torch.Tensor], allow: Sequence[str] = ()
                     ) -> tuple[str | None, tuple[str, ...]]:
    """Where a run first held a non-finite value the rule does not allow, in execution order (None: nowhere),
    and where it held allowed ones. A non-finite value is allowed when it was introduced inside a module the
    rule names (a call whose output is non-finite from finite inputs, innermost first; or the enclosing call's
    own code, when a call's input is the first non-finite value seen) and is carried onwards from there; the
    loss and the gradients are never allowed to hold one. Without ``allow``: the first non-finite value."""
    allowed: list[str] = []
    if _nonfinite(batch_inputs):
        if "<input>" not in allow:
            return "the batch (input)", ()
        allowed.append("the batch (input)")
    if run.weights_nonfinite is not None:
        return f"the weights: {run.weights_nonfinite}", tuple(allowed)
    events: list[tuple[int, bool, int]] = []  # (sequence number, is an output, call)
    for i, c in enumerate(run.calls):
        if _nonfinite(c.inputs):
            events.append((c.start, False, i))
        if c.outputs is not None and _nonfinite(c.outputs):
            events.append((c.end, True, i))
    origins: list[int] = []
    for _, output, i in sorted(events):
        c = run.calls[i]
        if not output:
            if allowed:
                continue  # carried from an allowed origin
            where = f"the input of module {_call_label(c)} (forward)"
            owner = c.parent  # made outside any recorded call: by the enclosing call's own code
            if owner is None or not _allowed(run.calls[owner].name, allow):
                return where, tuple(allowed)
            origins.append(owner)
            allowed.append(f"{where}, made by {_call_label(run.calls[owner])}")
        elif not _nonfinite(c.inputs) and not any(_inside(run.calls, o, i) for o in origins):
            where = f"the output of module {_call_label(c)} (forward)"
            if not _allowed(c.name, allow):
                return where, tuple(allowed)
            origins.append(i)
            allowed.append(where)
    if _nonfinite([run.loss]):
        return "the loss", tuple(allowed)
    bad = next((n for n, g in run.grads.items() if _nonfinite([g])), None)
    if bad is not None:
        return f"the gradient of {bad} (backward)", tuple(allowed)
    if run.output is not None and _nonfinite([run.output]):
        if not allowed:
            return "the model's output", ()
        allowed.append("the model's output")
    return None, tuple(allowed)


# ------------------------------------------------------------------ measuring


@dataclass
class _Measure:
    numel: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    scaled: float = 0.0
    n_out: int = 0
    absmax: float = 0.0  # largest finite magnitude in either run
    ref_absmax: float = 0.0
    underflow: int = 0
    ref_nonfinite: int = 0
    amp_nonfinite: int = 0
    shape_mismatch: bool = False

    def add(self, ref: torch.Tensor, amp: torch.Tensor, rtol: float, atol: float) -> None:
        if ref.shape != amp.shape:
            self.shape_mismatch = True
            return
        # float64: the difference of two float32 copies is exact and the reductions reproducible.
        r, a = ref.double().flatten(), amp.double().flatten()
        self.numel += r.numel()
        if r.numel() == 0:
            return
        fr, fa = torch.isfinite(r), torch.isfinite(a)
        both = fr & fa
        same = ~fr & ~fa & ((r == a) | (torch.isnan(r) & torch.isnan(a)))  # the same NaN/Inf in both runs
        mismatch = ~(both | same)
        ar = r.abs()
        d = torch.where(both, (a - r).abs(), torch.zeros_like(r))
        ref_absmax = float(ar[fr].max()) if bool(fr.any()) else 0.0
        amp_absmax = float(a.abs()[fa].max()) if bool(fa.any()) else 0.0
        n_mismatch = int(mismatch.sum())
        if n_mismatch:
            max_abs = max_rel = scaled = math.inf
        else:
            max_abs = float(d.max())
            rel_mask = both & (ar > atol)
            max_rel = float((d[rel_mask] / ar[rel_mask]).max()) if bool(rel_mask.any()) else 0.0
            scaled = max_abs / max(ref_absmax, atol)
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, max_rel)
        self.scaled = max(self.scaled, scaled)
        self.n_out += int(((d > atol + rtol * ar) & both).sum()) + n_mismatch
        self.absmax = max(self.absmax, ref_absmax, amp_absmax)
        self.ref_absmax = max(self.ref_absmax, ref_absmax)
        self.underflow += int((fr & (r != 0) & (a == 0)).sum())
        self.ref_nonfinite += int((~fr).sum())
        self.amp_nonfinite += int((~fa).sum())

    def diff(self, *, name: str, kind: str, limit: float, dtype: str, shape: Sequence[int], call_index: int = 0,
             module_class: str | None = None, input_scaled: float | None = None, depth: int = 0) -> TensorDiff:
        if self.amp_nonfinite:
            headroom: float | None = None
        else:
            headroom = math.inf if self.absmax == 0 else limit / self.absmax
        return TensorDiff(
            name=name, kind=kind, call_index=call_index, module_class=module_class, dtype=dtype,
            shape=tuple(int(s) for s in shape), numel=self.numel, max_abs=self.max_abs, max_rel=self.max_rel,
            scaled=self.scaled, out_of_tol=(self.n_out / self.numel) if self.numel else 0.0, headroom=headroom,
            underflow=self.underflow, ref_nonfinite=self.ref_nonfinite, amp_nonfinite=self.amp_nonfinite,
            ref_absmax=self.ref_absmax, input_scaled=input_scaled, depth=depth,
        )


def _measure(refs: Sequence[torch.Tensor], amps: Sequence[torch.Tensor], rtol: float, atol: float) -> _Measure:
    m = _Measure()
    if len(refs) != len(amps):
        m.shape_mismatch = True
    for r, a in zip(refs, amps):
        m.add(r, a, rtol, atol)
    return m


def _gain(out: float, inp: float) -> float:
    if math.isinf(out):
        return 0.0 if math.isinf(inp) else math.inf  # a carried non-finite value adds nothing
    return out - inp


def _introduced(gains: list[float], parents: list[int | None]) -> list[float]:
    """Each call's gain less its direct sub-calls' gains (see the module docstring), floored at 0."""
    children: list[float] = [0.0] * len(gains)
    for i, p in enumerate(parents):
        if p is not None:
            children[p] += gains[i]
    out: list[float] = []
    for g, c in zip(gains, children):
        own = g - c
        out.append(0.0 if math.isnan(own) or own < 0 else own)  # inf - inf: a sub-call made it non-finite
    return out


def _compare_modules(ref: _Run, amp: _Run, *, rtol: float, atol: float, limit: float
                     ) -> tuple[list[TensorDiff], tuple[int, ...], list[str]]:
    amp_calls = {(c.name, c.call_index): c for c in amp.calls if c.outputs is not None}
    unmatched: list[str] = []
    matched: list[tuple[_Call, _Call]] = []
    position: dict[int, int] = {}  # ref call index -> position in ``matched``
    for i, rc in enumerate(ref.calls):
        ac = amp_calls.pop((rc.name, rc.call_index), None)
        if rc.outputs is None or ac is None or ac.outputs is None:
            unmatched.append(f"module call {rc.name or '<root>'}#{rc.call_index} (float32 run only)")
            continue
        position[i] = len(matched)
        matched.append((rc, ac))
    unmatched += [f"module call {n or '<root>'}#{k} (autocast run only)" for n, k in amp_calls]
    diffs: list[TensorDiff] = []
    gains: list[float] = []
    parents: list[int | None] = []
    for rc, ac in matched:
        assert rc.outputs is not None and ac.outputs is not None
        m_in = _measure(rc.inputs, ac.inputs, rtol, atol)
        m_out = _measure(rc.outputs, ac.outputs, rtol, atol)
        if m_in.shape_mismatch or m_out.shape_mismatch:
            unmatched.append(f"module call {rc.name or '<root>'}#{rc.call_index} (tensors differ in number or shape)")
        diffs.append(m_out.diff(name=rc.name, kind="module", call_index=rc.call_index, module_class=rc.module_class,
                                dtype=ac.dtypes[0] if ac.dtypes else "", limit=limit,
                                shape=rc.outputs[0].shape if rc.outputs else (), input_scaled=m_in.scaled,
                                depth=rc.depth))
        gains.append(_gain(m_out.scaled, m_in.scaled))
        p = rc.parent
        while p is not None and p not in position:  # the nearest enclosing call that was matched
            p = ref.calls[p].parent
        parents.append(None if p is None else position[p])
    introduced = _introduced(gains, parents)
    diffs = [dataclasses.replace(d, introduced=x) for d, x in zip(diffs, introduced)]
    ranking = tuple(sorted((i for i, x in enumerate(introduced) if x > 0), key=lambda i: (-introduced[i], i)))
    return diffs, ranking, unmatched


# ------------------------------------------------------------------ decisions


def _as_samples(x: torch.Tensor) -> torch.Tensor:
    """``(samples, classes)``: a 1-D output is one sample; with more than 2 dims the classes are dim 1
    (as for cross_entropy) and every other position is a sample, in row-major order."""
    if x.ndim == 1:
        return x.unsqueeze(0)
    if x.ndim == 2:
        return x
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def top_two(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: top-1 class, runner-up class, top score and margin (top-1 minus top-2 score), by :data:`TIE_RULE`.

    Ties are broken explicitly rather than relying on ``argmax``: among equal top scores the lowest
    class index wins. A row holding NaN has no class (-1) and a NaN margin."""
    x = scores.double()
    n, c = x.shape
    idx = torch.arange(c).expand(n, c)
    nan_row = torch.isnan(x).any(dim=1)
    filled = torch.where(torch.isnan(x), torch.full_like(x, -math.inf), x)
    top = filled.max(dim=1).values
    first = torch.where(filled == top[:, None], idx, torch.full_like(idx, c)).min(dim=1).values.clamp(max=c - 1)
    if c > 1:
        rest = filled.scatter(1, first[:, None], -math.inf)
        second_score = rest.max(dim=1).values
        second = torch.where(rest == second_score[:, None], idx, torch.full_like(idx, c)).min(dim=1).values
        second = second.clamp(max=c - 1)
        # Equal scores (inf == inf included) have a zero margin, not inf - inf.
        margin = torch.where(top == second_score, torch.zeros_like(top), top - second_score)
    else:
        second = torch.full_like(first, -1)
        margin = torch.full_like(top, math.inf)
    first = torch.where(nan_row, torch.full_like(first, -1), first)
    margin = torch.where(nan_row, torch.full_like(margin, math.nan), margin)
    return first, second, top, margin


def _classify(ref: torch.Tensor, amp: torch.Tensor, *, rtol: float, atol: float, nonfinite: Sequence[int] = ()
              ) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[Decision, ...]]:
    """Samples, flips, near-boundary samples and the decisions listed (flipped, ``nonfinite``, near the
    boundary). A sample whose autocast scores are non-finite (``nonfinite``) made no decision: it is listed as
    such and never counted as a flip, whatever class its NaN/Inf scores would give."""
    r, a = _as_samples(ref), _as_samples(amp)
    r_cls, r_second, r_top, r_margin = top_two(r)
    a_cls, _, a_top, a_margin = top_two(a)
    bad = set(nonfinite)
    flipped = [f and i not in bad for i, f in enumerate((r_cls != a_cls).tolist())]
    # Near the boundary: the reference's own top-2 margin is within the score tolerance.
    near = (r_margin < atol + rtol * r_top.abs()).tolist()
    decisions = tuple(
        Decision(index=i, ref_class=int(r_cls[i]), amp_class=int(a_cls[i]), ref_runner_up=int(r_second[i]),
                 ref_margin=float(r_margin[i]), amp_margin=float(a_margin[i]), ref_score=float(r_top[i]),
                 amp_score=float(a_top[i]), flipped=bool(flipped[i]), near_boundary=bool(near[i]))
        for i in range(r.shape[0]) if flipped[i] or near[i] or i in bad
    )
    return (r.shape[0], tuple(i for i, f in enumerate(flipped) if f), tuple(i for i, x in enumerate(near) if x),
            decisions)


def _regress(ref: torch.Tensor, amp: torch.Tensor) -> tuple[int, Regression]:
    r = ref.double().reshape(ref.shape[0] if ref.ndim else 1, -1)
    a = amp.double().reshape(r.shape)
    both = torch.isfinite(r) & torch.isfinite(a)
    same = (r == a) | (torch.isnan(r) & torch.isnan(a))
    err = torch.where(both, (a - r).abs(), torch.where(same, torch.zeros_like(r), torch.full_like(r, math.inf)))
    per_sample = err.max(dim=1).values if r.shape[1] else torch.zeros(r.shape[0], dtype=torch.float64)
    order = sorted(range(r.shape[0]), key=lambda i: (-float(per_sample[i]), i))[:_WORST]

    def extremes(t: torch.Tensor) -> tuple[float, float]:
        f = t[torch.isfinite(t)]
        return (float(f.min()), float(f.max())) if f.numel() else (math.nan, math.nan)

    (rmin, rmax), (amin, amax) = extremes(r), extremes(a)
    return r.shape[0], Regression(ref_min=rmin, ref_max=rmax, amp_min=amin, amp_max=amax,
                                  worst=tuple((i, float(per_sample[i])) for i in order))


# ------------------------------------------------------------------ the rule, fixed first

_METRICS = ("accuracy", "mse")
_RULE_KEYS = tuple(f.name for f in dataclasses.fields(Rule))
_NUMBERS = {"rtol": True, "atol": True, "max_quality_drop": True, "min_quality": False}  # key: must be >= 0


def rule_from(d: Mapping[str, Any], *, where: str = "the rule") -> Rule:
    """A :class:`~nanhunt.records.Rule` from a JSON object (a ``--rule`` file), every key and value checked:
    an unknown key (a typo would silently drop a clause) or a value of the wrong type is an error."""
    if not isinstance(d, Mapping):
        raise CommandError(f"{where} is a {type(d).__name__}, not a JSON object of the rule's clauses")
    unknown = sorted(str(k) for k in d if k not in _RULE_KEYS)
    if unknown:
        raise CommandError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; a rule has "
                           f"{', '.join(_RULE_KEYS)}")
    kw: dict[str, Any] = {}
    for k, v in d.items():
        def bad(expected: str) -> CommandError:
            return CommandError(f"{where}: {k} is {v!r}, expected {expected}")

        if v is None and k in ("metric", "higher_is_better", *_NUMBERS):
            kw[k] = None
        elif k == "task":
            if v not in TASKS:
                raise bad(f"one of {', '.join(TASKS)}")
            kw[k] = v
        elif k == "metric":
            if not isinstance(v, str) or not v:
                raise bad("'accuracy', 'mse' or 'package.module:fn'")
            kw[k] = v
        elif k in ("higher_is_better", "fail_on_tolerance"):
            if not isinstance(v, bool):
                raise bad("true or false")
            kw[k] = v
        elif k == "max_flips":
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad("an integer >= 0")
            kw[k] = v
        elif k in _NUMBERS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (_NUMBERS[k] and v < 0):
                raise bad("a finite number" + (" >= 0" if _NUMBERS[k] else "") + " or null")
            kw[k] = float(v)
        elif k == "allow_nonfinite":
            if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
                raise bad("a list of module names ('<root>': the model's own code, '<input>': the batch)")
            kw[k] = tuple(v)
    return Rule(**kw)


def settle_rule(rule: Rule, metric: str | Callable[..., Any] | None = None
                ) -> tuple[Rule, Callable[..., Any] | None]:
    """The rule as it is printed and hashed, with what it leaves to defaults made explicit: the quality metric
    of its task (``classify``: accuracy, ``regress``: mse) and which way the metric improves; and the user's
    metric function. ``metric`` is a name (``"accuracy"``, ``"mse"``, ``"package.module:fn"``, imported as
    given: a name you typed is trusted) or a function ``fn(outputs, targets) -> float``, higher is better
    unless the rule or ``fn.higher_is_better`` says otherwise."""
    rule = rule_from(rule.to_dict(), where="the rule")  # the same checks as a file's
    name, fn = rule.metric, None
    if metric is not None:
        given = metric if isinstance(metric, str) else f"{metric.__module__}:{metric.__qualname__}"
        if name is not None and name != given:
            raise CommandError(f"the rule measures {name!r} but the metric given is {given!r}; give one")
        name = given
        fn = None if isinstance(metric, str) else metric
    if name is None:
        name = {"classify": "accuracy", "regress": "mse"}.get(rule.task)
    if name is not None and name not in _METRICS and fn is None:
        from ..capture.capture import resolve

        fn = resolve(name, what="quality metric", trusted=True)
    hib = rule.higher_is_better
    if name in _METRICS:
        natural = name == "accuracy"
        if hib is not None and hib != natural:
            raise CommandError(f"{name} is {'higher' if natural else 'lower'} is better; the rule says otherwise")
        hib = natural
    elif name is None:
        hib = None
    elif hib is None:
        hib = bool(getattr(fn, "higher_is_better", True))
    if name is None and (rule.max_quality_drop is not None or rule.min_quality is not None):
        raise CommandError("a quality clause (max_quality_drop, min_quality) needs a metric: --task classify "
                           "(accuracy), --task regress (mse) or --metric package.module:fn")
    return dataclasses.replace(rule, metric=name, higher_is_better=hib), fn


# ------------------------------------------------------------------ quality


@dataclass
class _Scored:
    """One batch's quality per sample, so that a set's total is exact: quality = sum(ref) / sum(count).
    accuracy: 1 right / 0 wrong, count 1 (0: no target); mse: the sample's sum of squared errors and its
    number of elements, and its largest |output - target|."""

    ref: torch.Tensor
    amp: torch.Tensor
    count: torch.Tensor
    ref_max: torch.Tensor | None = None
    amp_max: torch.Tensor | None = None


def _targets_cpu(targets: Any) -> torch.Tensor:
    if not isinstance(targets, torch.Tensor):
        raise CommandError("the quality metric needs the batch's targets as a tensor; this batch has "
                           + ("none" if targets is None else f"a {type(targets).__name__}"))
    return targets.detach().cpu()


def _score(metric: str, ref: torch.Tensor, amp: torch.Tensor, targets: Any) -> _Scored:
    t = _targets_cpu(targets)
    if metric == "accuracy":
        r, a = _as_samples(ref), _as_samples(amp)
        if t.is_floating_point() and tuple(t.shape) == tuple(ref.shape):  # one-hot or probabilities
            labels = top_two(_as_samples(t.float()))[0]
        elif not t.is_floating_point() and t.numel() == r.shape[0]:
            labels = t.reshape(-1).long()
        else:
            raise CommandError(f"accuracy needs targets as class indices ({r.shape[0]} of them) or scores shaped "
                               f"like the output {list(ref.shape)}; the targets are {t.dtype} {list(t.shape)}")
        valid = labels >= 0  # -100 and the like: ignored, as cross_entropy's ignore_index
        count = valid.double()
        return _Scored(((top_two(r)[0] == labels) & valid).double(), ((top_two(a)[0] == labels) & valid).double(),
                       count)
    if t.numel() != ref.numel():
        raise CommandError(f"mse needs targets with as many elements as the output {list(ref.shape)}; the targets "
                           f"are {list(t.shape)}")
    n = ref.shape[0] if ref.ndim else 1
    tt = t.double().reshape(n, -1)
    r, a = ref.double().reshape(n, -1) - tt, amp.double().reshape(n, -1) - tt
    count = torch.full((n,), float(tt.shape[1]), dtype=torch.float64)
    ref_max = r.abs().max(dim=1).values if tt.shape[1] else torch.zeros(n, dtype=torch.float64)
    amp_max = a.abs().max(dim=1).values if tt.shape[1] else torch.zeros(n, dtype=torch.float64)
    return _Scored(r.square().sum(dim=1), a.square().sum(dim=1), count, ref_max, amp_max)


def _quality(rule: Rule, scored: _Scored | None, user: tuple[float, float, int] | None) -> Quality | None:
    """The quality of both runs from their per-sample scores (or the user's metric's two values)."""
    name, hib = rule.metric, rule.higher_is_better is not False
    if name is None:
        return None
    if user is not None:
        return Quality(metric=name, higher_is_better=hib, ref=user[0], amp=user[1], n=user[2])
    if scored is None:
        return None
    total = float(scored.count.sum())
    ref = float(scored.ref.sum()) / total if total else math.nan
    amp = float(scored.amp.sum()) / total if total else math.nan
    if name == "accuracy":
        worse = tuple(int(i) for i in torch.nonzero((scored.count > 0) & (scored.ref > scored.amp)).flatten())
        return Quality(metric=name, higher_is_better=True, ref=ref, amp=amp, n=int(total), worse=worse)
    growth = torch.nan_to_num((scored.amp - scored.ref) / scored.count.clamp(min=1), nan=math.inf)
    order = sorted((i for i in range(growth.numel()) if float(growth[i]) > 0), key=lambda i: (-float(growth[i]), i))
    assert scored.ref_max is not None and scored.amp_max is not None
    return Quality(metric=name, higher_is_better=False, ref=ref, amp=amp, n=int(scored.count.numel()),
                   ref_max_error=float(scored.ref_max.max()) if scored.ref_max.numel() else 0.0,
                   amp_max_error=float(scored.amp_max.max()) if scored.amp_max.numel() else 0.0,
                   worse=tuple(order[:_WORST]))


def _user_metric(fn: Callable[..., Any], ref: torch.Tensor, amp: torch.Tensor, targets: Any) -> tuple[float, float, int]:
    t = targets.detach().cpu() if isinstance(targets, torch.Tensor) else targets
    return float(fn(ref, t)), float(fn(amp, t)), int(ref.shape[0]) if ref.ndim else 1


# ------------------------------------------------------------------ judging


_NAMED = 20  # samples a failure's message names; ``Failure.samples`` holds them all


def _samples_text(ids: Sequence[str]) -> str:
    head = ", ".join(ids[:_NAMED]) + (f", ... ({len(ids) - _NAMED} more)" if len(ids) > _NAMED else "")
    return f"sample{'s' if len(ids) != 1 else ''} {head}"


def _judge(rule: Rule, *, dtype: str, ref_bad: str | None, amp_bad: str | None, amp_rows: Sequence[str],
           flipped: Sequence[str], max_flips: int, task: str, output: TensorDiff | None, loss: TensorDiff | None,
           quality: Quality | None, worse: Sequence[str]) -> list[Failure]:
    """The clauses of the rule that the measurements fail, in the rule's order (one :class:`Failure` each)."""
    out: list[Failure] = []
    if ref_bad is not None:
        out.append(Failure("reference_finite", f"the float32 reference is non-finite, first at {ref_bad}: not a "
                           "precision finding; fix the float32 step first (nanhunt replay --dtype float32 names the op)"))
        return out
    if amp_bad is not None:
        text = f"the autocast {dtype} run is non-finite, first at {amp_bad}"
        if amp_rows:
            text += f"; non-finite output in {_samples_text(amp_rows)}"
        out.append(Failure("amp_finite", text, tuple(amp_rows)))
    if task == "classify" and len(flipped) > max_flips:
        out.append(Failure("max_flips", f"{len(flipped)} decision flip{'s' if len(flipped) != 1 else ''} "
                                        f"(at most {max_flips} allowed): {_samples_text(flipped)}", tuple(flipped)))
    if rule.fail_on_tolerance:
        for what, d in (("the model's output", output), ("the loss", loss)):
            if d is not None and d.out_of_tol > 0:
                out.append(Failure("tolerance", f"{what}: {d.out_of_tol:.2%} of elements out of tolerance "
                                                f"(max abs error {d.max_abs:.3g}, max rel error {d.max_rel:.3g})"))
    if quality is not None:
        m = quality.metric
        seen = f"{m} {quality.amp:.6g} under autocast {dtype} against {quality.ref:.6g} in float32"
        which = f"; worse under autocast: {_samples_text(worse)}" if worse else ""
        if rule.max_quality_drop is not None and not quality.drop() <= rule.max_quality_drop:  # NaN fails too
            out.append(Failure("max_quality_drop", f"{seen}: {quality.drop():.6g} worse (at most "
                                                   f"{rule.max_quality_drop:g} allowed){which}", tuple(worse)))
        q = rule.min_quality
        if q is not None and not (quality.amp >= q if quality.higher_is_better else quality.amp <= q):
            ref_ok = quality.ref >= q if quality.higher_is_better else quality.ref <= q
            tail = "" if ref_ok else "; the float32 reference fails it too: not a precision finding"
            out.append(Failure("min_quality", f"{m} {quality.amp:.6g} under autocast {dtype} "
                                              f"({'at least' if quality.higher_is_better else 'at most'} {q:g} "
                                              f"required){tail}", tuple(worse)))
    return out


def _nonfinite_rows(ref: torch.Tensor | None, amp: torch.Tensor | None, task: str = "classify") -> list[int]:
    """Samples whose autocast output holds a non-finite value where the reference's does not (samples as
    ``task`` counts them: classify's rows of scores, else the output's first dimension)."""
    if ref is None or amp is None or ref.ndim == 0 or ref.shape != amp.shape:
        return []
    if task == "classify":
        r, a = _as_samples(ref), _as_samples(amp)
    else:
        r, a = ref.reshape(ref.shape[0], -1), amp.reshape(amp.shape[0], -1)
    return [int(i) for i in torch.nonzero((~torch.isfinite(a)).any(dim=1) & torch.isfinite(r).all(dim=1)).flatten()]


# ------------------------------------------------------------------ one batch


@dataclass
class _Candidate:
    """One autocast dtype: its tolerances and the rule fields of its comparisons."""

    dt: torch.dtype
    name: str
    rtol: float
    atol: float
    limit: float
    header: _Rule
    batches: list[Comparison] = field(default_factory=list)
    scored: list[_Scored | None] = field(default_factory=list)
    outputs: list[tuple[torch.Tensor, torch.Tensor, Any]] = field(default_factory=list)  # for a user metric


def _compare_batch(ref: _Run, amp: _Run, cand: _Candidate, rule: Rule, *, floats: Sequence[torch.Tensor],
                   name: str, targets: Any, ref_allowed: Sequence[str], scale: float,
                   metric_fn: Callable[..., Any] | None, need_quality: bool) -> Comparison:
    """The autocast run of one batch against its reference: errors, decisions, quality, the rule on it alone."""
    rtol, atol, limit = cand.rtol, cand.atol, cand.limit
    task = rule.task
    amp_loss = float(amp.loss.double().sum())
    amp_bad, amp_allowed = _first_nonfinite(amp, floats, rule.allow_nonfinite)
    modules, ranking, unmatched = _compare_modules(ref, amp, rtol=rtol, atol=atol, limit=limit)
    loss_diff = _measure([ref.loss], [amp.loss], rtol, atol).diff(name="<loss>", kind="loss", limit=limit,
                                                                  dtype="float32", shape=tuple(ref.loss.shape))
    grads: list[TensorDiff] = []
    for g_name, g in ref.grads.items():
        ag = amp.grads.get(g_name)
        if ag is None:
            unmatched.append(f"gradient of {g_name} (float32 run only)")
            continue
        grads.append(_measure([g], [ag], rtol, atol).diff(name=g_name, kind="grad", limit=limit, dtype="float32",
                                                         shape=tuple(g.shape)))
    unmatched += [f"gradient of {n} (autocast run only)" for n in amp.grads if n not in ref.grads]

    output: TensorDiff | None = None
    n_samples = 0
    flipped: tuple[int, ...] = ()
    near: tuple[int, ...] = ()
    decisions: tuple[Decision, ...] = ()
    regression: Regression | None = None
    if ref.output is not None and amp.output is not None:
        output = _measure([ref.output], [amp.output], rtol, atol).diff(
            name="<output>", kind="output", limit=limit, dtype=amp.output_dtype, shape=tuple(ref.output.shape))
    usable = ref.output is not None and amp.output is not None and ref.output.ndim > 0 \
        and ref.output.shape == amp.output.shape
    if usable and task != "classify":  # the samples the quality and the failures name
        assert ref.output is not None
        n_samples = int(ref.output.shape[0])
    nonfinite = tuple(_nonfinite_rows(ref.output, amp.output, task)) if usable else ()
    if task != "none":
        if not usable:
            raise CommandError(f"--task {task} needs the model to return its scores or predictions as a tensor with "
                               "a sample dimension (or a dict with 'logits'); this model returned none")
        assert ref.output is not None and amp.output is not None
        if task == "classify":
            n_samples, flipped, near, decisions = _classify(ref.output, amp.output, rtol=rtol, atol=atol,
                                                            nonfinite=nonfinite)
        else:
            n_samples, regression = _regress(ref.output, amp.output)

    scored: _Scored | None = None
    user: tuple[float, float, int] | None = None
    if rule.metric is not None and usable:
        assert ref.output is not None and amp.output is not None
        try:
            if metric_fn is not None:
                user = _user_metric(metric_fn, ref.output, amp.output, targets)
                cand.outputs.append((ref.output, amp.output, targets))
            else:
                scored = _score(rule.metric, ref.output, amp.output, targets)
        except CommandError:
            if need_quality:
                raise
    if metric_fn is None:
        cand.scored.append(scored)
    quality = _quality(rule, scored, user)
    def sample(i: int) -> str:
        return f"{name}:{i}" if name else str(i)

    worse = [sample(i) for i in quality.worse] if quality is not None else []
    failures = _judge(rule, dtype=cand.name, ref_bad=None, amp_bad=amp_bad,
                      amp_rows=[sample(i) for i in nonfinite] if amp_bad else [],
                      flipped=[sample(i) for i in flipped], max_flips=rule.max_flips, task=task, output=output,
                      loss=loss_diff, quality=quality, worse=worse)
    allowed = [f"float32 reference: {w}" for w in ref_allowed] + [f"autocast {cand.name}: {w}" for w in amp_allowed]
    return Comparison(
        **cand.header, accepted=not failures, violations=tuple(f.message for f in failures), reference_finite=True,
        amp_finite=amp_bad is None, amp_first_nonfinite=amp_bad, ref_loss=float(ref.loss.double().sum()),
        amp_loss=amp_loss, modules=tuple(modules), ranking=ranking, output=output, loss=loss_diff, grads=tuple(grads),
        n_samples=n_samples, flipped=flipped, near_boundary=near, nonfinite=nonfinite, decisions=decisions,
        regression=regression, unmatched=tuple(unmatched), failures=tuple(failures), quality=quality,
        allowed=tuple(allowed), batch=name,
    )


def _reference_failed(cand: _Candidate, rule: Rule, *, name: str, ref_bad: str, ref_loss: float) -> Comparison:
    failures = _judge(rule, dtype=cand.name, ref_bad=ref_bad, amp_bad=None, amp_rows=[], flipped=[], max_flips=0,
                      task=rule.task, output=None, loss=None, quality=None, worse=[])
    cand.scored.append(None)
    return Comparison(**cand.header, accepted=False, violations=tuple(f.message for f in failures),
                      failures=tuple(failures), reference_finite=False, reference_first_nonfinite=ref_bad,
                      amp_finite=None, ref_loss=ref_loss, batch=name)


# ------------------------------------------------------------------ a set: totals


def _merge(diffs: Sequence[TensorDiff]) -> TensorDiff:
    """One value over several batches: the largest errors, the smallest headroom, counts summed."""
    first = diffs[0]
    numel = sum(d.numel for d in diffs)

    def most(xs: Iterable[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return max(vals) if vals else None

    headrooms = [d.headroom for d in diffs]
    return dataclasses.replace(
        first, numel=numel, max_abs=max(d.max_abs for d in diffs), max_rel=max(d.max_rel for d in diffs),
        scaled=max(d.scaled for d in diffs),
        out_of_tol=sum(d.out_of_tol * d.numel for d in diffs) / numel if numel else 0.0,
        headroom=None if any(h is None for h in headrooms) else min(h for h in headrooms if h is not None),
        underflow=sum(d.underflow for d in diffs), ref_nonfinite=sum(d.ref_nonfinite for d in diffs),
        amp_nonfinite=sum(d.amp_nonfinite for d in diffs), ref_absmax=max(d.ref_absmax for d in diffs),
        input_scaled=most(d.input_scaled for d in diffs), introduced=most(d.introduced for d in diffs),
    )


def _merged(groups: Iterable[Sequence[TensorDiff]], key: Callable[[TensorDiff], Any]) -> list[TensorDiff]:
    """``groups`` (one list per batch) merged by ``key``, in the order each key first appears."""
    by: dict[Any, list[TensorDiff]] = {}
    for group in groups:
        for d in group:
            by.setdefault(key(d), []).append(d)
    return [_merge(ds) for ds in by.values()]


def _total_regression(regs: Sequence[tuple[Regression, int]]) -> Regression | None:
    """The regression extremes of a set: each batch's ``(regression, sample offset)``; None without any."""
    if not regs:
        return None

    def ext(f: Callable[[Regression], float], pick: Callable[..., float]) -> float:
        vals = [f(g) for g, _ in regs if not math.isnan(f(g))]
        return pick(vals) if vals else math.nan

    worst = sorted(((o + i, e) for g, o in regs for i, e in g.worst), key=lambda w: (-w[1], w[0]))[:_WORST]
    return Regression(ref_min=ext(lambda g: g.ref_min, min), ref_max=ext(lambda g: g.ref_max, max),
                      amp_min=ext(lambda g: g.amp_min, min), amp_max=ext(lambda g: g.amp_max, max),
                      worst=tuple(worst))


def _total_quality(cand: _Candidate, rule: Rule, metric_fn: Callable[..., Any] | None, done: Sequence[Comparison],
                   offsets: Sequence[int], at: int) -> Quality | None:
    """The quality of a set: the user metric on all outputs, else the built-in one on all scored samples."""
    if metric_fn is not None and cand.outputs:
        try:
            user = _user_metric(metric_fn, torch.cat([r for r, _, _ in cand.outputs]),
                                torch.cat([a for _, a, _ in cand.outputs]),
                                torch.cat([_targets_cpu(t) for _, _, t in cand.outputs]))
        except (RuntimeError, CommandError):  # outputs that do not concatenate: the mean, weighted by samples
            qs = [b.quality for b in done if b.quality is not None]
            n = sum(q.n for q in qs) or 1
            user = (sum(q.ref * q.n for q in qs) / n, sum(q.amp * q.n for q in qs) / n, sum(q.n for q in qs))
        return _quality(rule, None, user)
    if metric_fn is None and any(s is not None for s in cand.scored):
        # a batch without scores (a non-finite reference) weighs nothing: its count stays 0
        ref_s, amp_s, count = (torch.zeros(at, dtype=torch.float64) for _ in range(3))
        ref_m, amp_m = (torch.zeros(at, dtype=torch.float64) for _ in range(2))
        for s, o in zip(cand.scored, offsets):
            if s is None:
                continue
            span = slice(o, o + s.count.numel())
            ref_s[span], amp_s[span], count[span] = s.ref, s.amp, s.count
            if s.ref_max is not None and s.amp_max is not None:
                ref_m[span], amp_m[span] = s.ref_max, s.amp_max
        return _quality(rule, _Scored(ref_s, amp_s, count, ref_m, amp_m), None)
    return None


def _total(cand: _Candidate, rule: Rule, metric_fn: Callable[..., Any] | None) -> Comparison:
    """The comparison of a whole set: every batch's, the rule applied to the totals."""
    bs = cand.batches
    done = [b for b in bs if b.reference_finite]
    offsets, at = [], 0
    for b in bs:
        offsets.append(at)
        at += b.n_samples

    def sample(i: int) -> str:
        b = next(k for k in range(len(bs)) if i < offsets[k] + bs[k].n_samples)
        return f"{bs[b].batch}:{i - offsets[b]}"

    def first(what: Callable[[Comparison], str | None]) -> str | None:
        return next((f"{b.batch}: {what(b)}" for b in bs if what(b) is not None), None)

    ref_bad = first(lambda b: b.reference_first_nonfinite)
    amp_bad = first(lambda b: b.amp_first_nonfinite)
    modules = _merged((b.modules for b in done), lambda d: (d.name, d.call_index))
    ranking = tuple(sorted((i for i, d in enumerate(modules) if (d.introduced or 0.0) > 0),
                           key=lambda i: (-(modules[i].introduced or 0.0), i)))
    grads = _merged((b.grads for b in done), lambda d: d.name)
    outputs = [b.output for b in done if b.output is not None]
    losses = [b.loss for b in done if b.loss is not None]
    flipped = tuple(o + i for b, o in zip(bs, offsets) for i in b.flipped)
    near = tuple(o + i for b, o in zip(bs, offsets) for i in b.near_boundary)
    nonfinite = tuple(o + i for b, o in zip(bs, offsets) for i in b.nonfinite)
    decisions = tuple(dataclasses.replace(d, index=o + d.index) for b, o in zip(bs, offsets) for d in b.decisions)
    regression = _total_regression([(b.regression, o) for b, o in zip(bs, offsets) if b.regression is not None])
    quality = _total_quality(cand, rule, metric_fn, done, offsets, at)
    loss_mean = [b.ref_loss for b in bs if b.ref_loss is not None]
    amp_mean = [b.amp_loss for b in done if b.amp_loss is not None]
    amp_rows = [f for b in done for x in b.failures if x.clause == "amp_finite" for f in x.samples]
    failures = _judge(rule, dtype=cand.name, ref_bad=None, amp_bad=amp_bad, amp_rows=amp_rows,
                      flipped=[sample(i) for i in flipped], max_flips=rule.max_flips, task=rule.task,
                      output=_merge(outputs) if outputs else None, loss=_merge(losses) if losses else None,
                      quality=quality, worse=[sample(i) for i in quality.worse] if quality is not None else [])
    if ref_bad is not None:
        failures = _judge(rule, dtype=cand.name, ref_bad=ref_bad, amp_bad=None, amp_rows=[], flipped=[],
                          max_flips=0, task=rule.task, output=None, loss=None, quality=None, worse=[]) + failures
    return Comparison(
        **cand.header, accepted=not failures, violations=tuple(f.message for f in failures),
        failures=tuple(failures), reference_finite=ref_bad is None, reference_first_nonfinite=ref_bad,
        amp_finite=None if not done else amp_bad is None, amp_first_nonfinite=amp_bad,
        ref_loss=sum(loss_mean) / len(loss_mean) if loss_mean else None,
        amp_loss=sum(amp_mean) / len(amp_mean) if amp_mean else None, modules=tuple(modules), ranking=ranking,
        output=_merge(outputs) if outputs else None, loss=_merge(losses) if losses else None, grads=tuple(grads),
        n_samples=at, flipped=flipped, near_boundary=near, nonfinite=nonfinite, decisions=decisions,
        regression=regression,
        unmatched=tuple(f"{b.batch}: {u}" for b in bs for u in b.unmatched), quality=quality,
        allowed=tuple(f"{b.batch}: {a}" for b in bs for a in b.allowed),
        absorbed=tuple(f"{b.batch}: {a}" for b in bs for a in b.absorbed), batches=tuple(bs),
    )


# ------------------------------------------------------------------ speed, after the numbers


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


_CLEAR_REFS = "/proc/self/clear_refs"
_trim: Any = None  # glibc's malloc_trim; False where there is none


def _status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_hwm() -> None:
    """Linux: "5" in clear_refs resets the peak resident set (VmHWM) to the current resident set."""
    with open(_CLEAR_REFS, "w", encoding="ascii") as f:
        f.write("5")


def _quiesce() -> None:
    """Free what can be freed before a peak is measured: garbage, and the allocator's free pages (glibc)."""
    global _trim
    gc.collect()
    if _trim is None:
        try:
            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


def _peak_meter(device_type: str) -> tuple[Callable[[Callable[[], None]], int] | None, str]:
    """A function measuring the peak memory one call adds, and how it measures (or why there is none).

    CUDA: the bytes allocated above the level before the call. CPU: the growth of the process's peak resident
    set (Linux VmHWM, reset through /proc/self/clear_refs) above its resident size before the call, after a
    garbage collection and malloc_trim: what the step costs in RAM, allocator slack included. tracemalloc
    would not see tensors (torch allocates outside Python's allocator)."""
    if device_type == "cuda":
        def cuda(run: Callable[[], None]) -> int:
            _quiesce()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            return max(0, int(torch.cuda.max_memory_allocated()) - base)

        return cuda, "cuda max_memory_allocated above the level before each batch"
    if device_type != "cpu":
        return None, f"not measured: nanhunt has no peak memory counter for device type {device_type!r}"
    try:
        _reset_hwm()
        _status_bytes("VmHWM")
    except (OSError, KeyError, ValueError):
        return None, (f"not measured: the peak resident set cannot be reset here ({_CLEAR_REFS} is not writable: "
                      "not Linux, or not allowed)")

    def cpu(run: Callable[[], None]) -> int:
        _quiesce()
        _reset_hwm()
        base = _status_bytes("VmRSS")
        run()
        return max(0, _status_bytes("VmHWM") - base)

    return cpu, "peak RSS growth (Linux VmHWM) above the resident size before each batch"


def _speed(step: Step, batches: Sequence[tuple[str, Any, Any, tuple[Any, Any]]], dt: torch.dtype, *,
           repeats: int, train: bool) -> Speed:
    """The plain step over the set, float32 and autocast interleaved (alternating which goes first), with no
    hook of nanhunt's installed: the median time per pass over the set, the median and quartiles of the
    autocast / float32 ratio per repetition; then one untimed pass of each to measure its peak memory (the
    largest batch's), so the measuring never slows a timed pass."""
    model, device_type, loss_fn = step.model, step.device_type, step.loss_fn

    def plain(ins: Any, tgts: Any, amp: bool) -> None:
        with contextlib.ExitStack() as stack:
            if not train:
                stack.enter_context(torch.no_grad())
            with torch.autocast(device_type, dtype=dt, enabled=amp):
                loss = _loss_of(_call_model(model, ins), tgts, loss_fn)
            if train and loss.requires_grad:
                _backward(loss)

    def one_pass(amp: bool) -> float:
        total = 0.0
        for _, inputs, targets, ref_batch in batches:
            ins, tgts = (inputs, targets) if amp else ref_batch
            step.reset()
            _sync(device_type)
            t0 = time.perf_counter()
            plain(ins, tgts, amp)
            _sync(device_type)
            total += time.perf_counter() - t0
        return total

    one_pass(False)  # warm-up: first calls allocate, pick kernels, fill caches
    one_pass(True)
    ref_t: list[float] = []
    amp_t: list[float] = []
    for r in range(repeats):
        for amp in ((False, True) if r % 2 == 0 else (True, False)):
            (amp_t if amp else ref_t).append(one_pass(amp))
    meter, how = _peak_meter(device_type)
    peaks: dict[bool, int | None] = {False: None, True: None}
    if meter is not None:
        for amp in (False, True):
            for _, inputs, targets, ref_batch in batches:
                ins, tgts = (inputs, targets) if amp else ref_batch
                step.reset()
                used = meter(functools.partial(plain, ins, tgts, amp))
                peaks[amp] = max(peaks[amp] or 0, used)
    ratios = [a / r if r > 0 else math.inf for a, r in zip(amp_t, ref_t)]
    q1, q3 = (statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratios[0], ratios[0]))
    return Speed(mode="train" if train else "eval", repeats=repeats, ref_median_s=statistics.median(ref_t),
                 amp_median_s=statistics.median(amp_t), ratio_median=statistics.median(ratios), ratio_q1=q1,
                 ratio_q3=q3, ref_peak_bytes=peaks[False], amp_peak_bytes=peaks[True], peak_memory=how)


# ------------------------------------------------------------------ the rule's history


HISTORY_FILE = "nanhunt-compare-history.jsonl"
_WARNED = 5  # earlier rules a report names


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(functools.partial(f.read, 1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise CommandError(f"cannot read {path!r} to identify it in the compare history: {e.strerror}") from e
    return h.hexdigest()


def _failed_clauses(c: Comparison) -> list[str]:
    """``clause (autocast dtype)`` for every clause a candidate failed, in order, each once."""
    return list(dict.fromkeys(f"{f.clause} (autocast {x.dtype})" for x in c.candidates() for f in x.failures))


@dataclass(frozen=True)
class History:
    """The compare runs recorded beside the reports of one directory (``nanhunt-compare-history.jsonl``, one
    JSON object per run): which checkpoint (its sha256), under which rule (its sha256), and whether the rule
    held. Kept so that a rule widened after a failing run shows: a report of a later run of the same
    checkpoint under another rule says which rule failed before, and on which clause.

    Example::

        history = History.beside("reports/run.json", "checkpoint.pt")
        print(history.warnings(rule.sha256()))          # before the run
        report = history.record(nanhunt.compare(...))   # after it: the warnings in the report, the run appended
    """

    path: str
    checkpoint: str
    checkpoint_sha256: str
    batches: tuple[str, ...] = ()
    report: str = ""

    @classmethod
    def beside(cls, report_path: str, checkpoint: str, batches: Sequence[str] = ()) -> History:
        """The history of the directory ``report_path`` is written to, for the checkpoint file ``checkpoint``."""
        where = os.path.join(os.path.dirname(os.path.abspath(report_path)), HISTORY_FILE)
        return cls(where, checkpoint, _file_sha256(checkpoint), tuple(batches), report_path)

    def runs(self) -> list[dict[str, Any]]:
        """The recorded runs of this checkpoint, oldest first (lines that are not a run's JSON are skipped)."""
        out: list[dict[str, Any]] = []
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return out
        except (OSError, UnicodeDecodeError) as e:
            raise CommandError(f"cannot read the compare history {self.path!r}: {e}; move it away to start a new "
                               "one") from e
        for line in lines:
            try:
                run = json.loads(line)
            except ValueError:
                continue
            if isinstance(run, dict) and run.get("checkpoint_sha256") == self.checkpoint_sha256 \
                    and isinstance(run.get("rule_sha256"), str):
                out.append(run)
        return out

    def warnings(self, rule_sha256: str) -> tuple[str, ...]:
        """One line per earlier rule (newest first) under which this checkpoint failed, when it is not
        ``rule_sha256``: the rule changed after a failing run."""
        latest: dict[str, dict[str, Any]] = {}
        for run in self.runs():
            if run.get("accepted") is False and run["rule_sha256"] != rule_sha256:
                latest.pop(run["rule_sha256"], None)
                latest[run["rule_sha256"]] = run  # the newest failing run of each rule, in time order
        out: list[str] = []
        for digest, run in reversed(list(latest.items())):
            failed = [str(x) for x in run.get("failed", ())] or ["unknown"]
            clause = f"clause{'s' if len(failed) != 1 else ''} {', '.join(failed)}"
            when = f"; {run['time']}" if isinstance(run.get("time"), str) else ""
            out.append(f"the rule changed after a failing run (was {digest[:12]} failing {clause}, now "
                       f"{rule_sha256[:12]}{when}, {HISTORY_FILE})")
        if len(out) > _WARNED:
            out = out[:_WARNED] + [f"... and {len(out) - _WARNED} earlier failing rules in {HISTORY_FILE}"]
        return tuple(out)

    def record(self, report: Report) -> Report:
        """``report`` with the warnings of its rule (``comparison.rule_warnings``); this run appended."""
        c = report.comparison
        assert c is not None, "not a comparison report"
        warned = self.warnings(c.rule_sha256)
        run = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checkpoint": self.checkpoint, "checkpoint_sha256": self.checkpoint_sha256, "batches": list(self.batches),
            "dtype": ",".join(x.dtype for x in c.candidates()), "rule_sha256": c.rule_sha256,
            "rule": c.acceptance.canonical() if c.acceptance is not None else None,
            "accepted": all(x.accepted for x in c.candidates()), "failed": _failed_clauses(c), "report": self.report,
        }
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(run, allow_nan=False) + "\n")
        except OSError as e:
            raise CommandError(f"cannot append to the compare history {self.path!r}: {e.strerror}") from e
        return dataclasses.replace(report, comparison=dataclasses.replace(c, rule_warnings=warned))


# ------------------------------------------------------------------ the entry point


def _as_dtypes(dtype: torch.dtype | str | Sequence[torch.dtype | str]) -> list[torch.dtype]:
    items: list[torch.dtype | str]
    if isinstance(dtype, str):
        items = [d.strip() for d in dtype.split(",")]
    elif isinstance(dtype, torch.dtype):
        items = [dtype]
    else:
        items = list(dtype)
    out = [_as_dtype(d) for d in items]
    if not out or len(set(out)) != len(out):
        raise CommandError(f"compare needs one or more different autocast dtypes, not {dtype}")
    return out


def _named(batch: Any, batches: Sequence[Any] | Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if (batch is None) == (batches is None):
        raise CommandError("compare needs a batch, or a set of them (batches=[...]), not both")
    if batches is None:
        return [("", batch)]
    named = list(batches.items()) if isinstance(batches, Mapping) else \
        [(f"batch{i}", b) for i, b in enumerate(batches)]
    if not named:
        raise CommandError("the set of batches is empty")
    names = [str(n) for n, _ in named]
    if len(set(names)) != len(names) or not all(names):
        raise CommandError("the batches of a set need different, non-empty names")
    return [(str(n), b) for n, b in named]


_BatchSet = tuple[str, Any, Any, tuple[Any, Any]]  # name, inputs, targets, (reference inputs, targets)


def _rule_of_args(rule: Rule | None, *, rtol: float | None, atol: float | None, task: str, max_flips: int,
                  fail_on_tolerance: bool) -> Rule:
    """The acceptance rule: ``rule`` as given, or built from compare's arguments (not both)."""
    if rule is None:
        return rule_from({"task": task, "rtol": rtol, "atol": atol, "max_flips": max_flips,
                          "fail_on_tolerance": fail_on_tolerance}, where="compare's arguments")
    if (rtol, atol, task, max_flips, fail_on_tolerance) != (None, None, "none", 0, False):
        raise CommandError("give the acceptance rule as rule=... or as rtol/atol/task/max_flips/fail_on_tolerance, "
                           "not both")
    return rule


def _batch_sets(named: Sequence[tuple[str, Any]], low: Sequence[str]) -> list[_BatchSet]:
    sets: list[_BatchSet] = []
    for name, b in named:
        inputs, targets = b if isinstance(b, tuple) and len(b) == 2 else split_batch(b)
        # A float32 model's reference takes a float16/bfloat16 batch upcast (exactly): with autocast off, a
        # low-precision input would meet float32 weights. The autocast run takes the batch as it is.
        sets.append((name, inputs, targets, (inputs, targets) if low else (_upcast(inputs), _upcast(targets))))
    return sets


def _candidates(dts: Sequence[torch.dtype], names: Sequence[str], rule: Rule, device_type: str) -> list[_Candidate]:
    cands: list[_Candidate] = []
    for dt, dname in zip(dts, names):
        d_rtol, d_atol = default_tolerances(dt)
        c_rtol = d_rtol if rule.rtol is None else rule.rtol
        c_atol = d_atol if rule.atol is None else rule.atol
        cands.append(_Candidate(dt, dname, c_rtol, c_atol, float(torch.finfo(dt).max), _Rule(
            dtype=dname, device_type=device_type, rtol=c_rtol, atol=c_atol, task=rule.task, max_flips=rule.max_flips,
            fail_on_tolerance=rule.fail_on_tolerance, tie_rule=TIE_RULE if rule.task == "classify" else "")))
    return cands


def _status(results: Sequence[Comparison]) -> str:
    if not all(r.reference_finite for r in results):
        return "reference-nonfinite"
    if all(r.accepted for r in results):
        return "clean"
    if any(r.amp_finite is False for r in results):
        return "nonfinite"
    return "diverged"


class _Comparer:
    """One call of :func:`compare` once its arguments are checked: the step, the rule, the batches, the candidates."""

    def __init__(self, step: Step, rule: Rule, metric_fn: Callable[..., Any] | None, dts: Sequence[torch.dtype],
                 named: Sequence[tuple[str, Any]], *, loss_fn: Callable[..., Any] | None,
                 scaler: torch.amp.GradScaler | None, train: bool | None, is_set: bool, metric_given: bool) -> None:
        self.step, self.rule, self.metric_fn, self.dts = step, rule, metric_fn, list(dts)
        self.model, self.device_type = step.model, step.device_type
        self.loss_fn, self.scaler, self.train = loss_fn, scaler, train
        self.scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        self.is_set = is_set
        self.need_quality = rule.max_quality_drop is not None or rule.min_quality is not None or metric_given
        self.low = sorted({str(p.dtype).replace("torch.", "") for p in self.model.parameters()
                           if p.is_floating_point() and p.dtype != torch.float32})
        self.sets = _batch_sets(named, self.low)
        self.names = [str(d).replace("torch.", "") for d in self.dts]

    def config(self, speed: int) -> dict[str, Any]:
        rule, dts, loss_fn = self.rule, self.dts, self.loss_fn
        loss_name = getattr(loss_fn, "__qualname__", None) or (type(loss_fn).__name__ if loss_fn is not None else None)
        return {
            "dtype": ",".join(self.names),
            "device_type": self.device_type,
            "train": self.model.training if self.train is None else self.train,
            "loss_fn": loss_name,
            "task": rule.task,
            "rtol": rule.rtol if rule.rtol is not None or len(dts) > 1 else default_tolerances(dts[0])[0],
            "atol": rule.atol if rule.atol is not None or len(dts) > 1 else default_tolerances(dts[0])[1],
            "max_flips": rule.max_flips,
            "fail_on_tolerance": rule.fail_on_tolerance,
            "scaler_scale": self.scale if self.scaler is not None else None,
            "metric": rule.metric,
            "batches": len(self.sets) if self.is_set else None,
            "speed_repeats": speed or None,
        }

    def notes(self, notes: Sequence[str]) -> tuple[str, ...]:
        base_notes = tuple(notes)
        if self.low:
            base_notes += (f"parameters held in {', '.join(self.low)}: the reference runs them as they are, so it is "
                           "float32 arithmetic on rounded weights",)
        return base_notes

    def _run(self, inputs: Any, targets: Any, dt: torch.dtype, amp: bool) -> _Run:
        self.step.reset()
        return _run(self.model, inputs, targets, self.loss_fn, dtype=dt, device_type=self.device_type, amp=amp,
                    scale=self.scale if amp else 1.0)

    def _batch(self, cands: Sequence[_Candidate], name: str, inputs: Any, targets: Any,
               ref_in: Any, ref_tg: Any) -> None:
        """The reference of one batch, then every candidate against it."""
        rule = self.rule
        floats, _ = _floats(inputs)
        ref = self._run(ref_in, ref_tg, self.dts[0], amp=False)
        ref_bad, ref_allowed = _first_nonfinite(ref, floats, rule.allow_nonfinite)
        for cand in cands:
            if ref_bad is not None:
                # Checked first: a float32 step that is already non-finite is no reference for precision.
                cand.batches.append(_reference_failed(cand, rule, name=name, ref_bad=ref_bad,
                                                      ref_loss=float(ref.loss.double().sum())))
                continue
            amp = self._run(inputs, targets, cand.dt, amp=True)
            result = _compare_batch(ref, amp, cand, rule, floats=floats, name=name, targets=targets,
                                    ref_allowed=ref_allowed, scale=self.scale, metric_fn=self.metric_fn,
                                    need_quality=self.need_quality)
            del amp
            if result.amp_finite:  # a non-finite run already says where it went non-finite first
                self.step.reset()
                absorbed = _absorbed(self.model, inputs, targets, self.loss_fn, dtype=cand.dt,
                                     device_type=self.device_type, scale=self.scale, allow=rule.allow_nonfinite)
                result = dataclasses.replace(result, absorbed=tuple(f"autocast {cand.name}: {a}" for a in absorbed))
            cand.batches.append(result)
        del ref

    def execute(self, speed: int) -> tuple[list[_Candidate], list[Comparison], dict[str, Speed]]:
        """Every batch and candidate, then the speed of those accepted; the model is restored afterwards."""
        cands = _candidates(self.dts, self.names, self.rule, self.device_type)
        speeds: dict[str, Speed] = {}
        with self.step.isolated():  # restored on leaving, also on Ctrl-C (held until the restore is complete)
            for name, inputs, targets, (ref_in, ref_tg) in self.sets:
                self._batch(cands, name, inputs, targets, ref_in, ref_tg)
            results = [_total(c, self.rule, self.metric_fn) if self.is_set else c.batches[0] for c in cands]
            if speed:
                mode = self.model.training if self.train is None else self.train
                for c, r in zip(cands, results):
                    if r.accepted:  # only after the numbers pass
                        speeds[c.name] = _speed(self.step, self.sets, c.dt, repeats=speed, train=mode)
        return cands, results, speeds

    def finish(self, cands: Sequence[_Candidate], results: Sequence[Comparison], speeds: Mapping[str, Speed],
               speed: int) -> tuple[str, Comparison, list[str]]:
        """The status, the first candidate's comparison (holding the others) and the extra notes."""
        scale = self.scale
        extra: list[str] = []
        for c, r in zip(cands, results):
            bad = r.amp_first_nonfinite
            if bad is not None and "the gradient" in bad and scale != 1.0:
                extra.append(f"autocast {c.name}: only the gradients went non-finite, with the loss scaled by "
                             f"{scale:g}: GradScaler would skip this step and lower the scale; nanhunt replay tells "
                             "whether it is scale-induced")
        refused = Speed(reason="not measured: the candidate failed the rule (speed is measured only after the "
                               "numbers pass)")
        digest = self.rule.sha256()
        results = [dataclasses.replace(r, acceptance=self.rule, rule_sha256=digest,
                                       speed=speeds.get(r.dtype, refused) if speed else None) for r in results]
        first = dataclasses.replace(results[0], alternatives=tuple(results[1:]))
        if len(extra) == 1 and len(results) == 1:
            extra = [extra[0].split(": ", 1)[1]]  # one candidate: as before
        return _status(results), first, extra


def compare(
    model: nn.Module, batch: Any = None, *, batches: Sequence[Any] | Mapping[str, Any] | None = None,
    loss_fn: Callable[..., Any] | None = None, dtype: torch.dtype | str | Sequence[torch.dtype | str] = torch.float16,
    device_type: str | None = None, rtol: float | None = None, atol: float | None = None, task: str = "none",
    max_flips: int = 0, fail_on_tolerance: bool = False, rule: Rule | None = None,
    metric: str | Callable[..., Any] | None = None, speed: int = 0, scaler: torch.amp.GradScaler | None = None,
    train: bool | None = None, rng: Mapping[str, Any] | None = None, command: str | None = None,
    notes: Sequence[str] = (),
) -> Report:
    """Run one step in float32 and under autocast from the same state; say where error is introduced.

    ``batch`` is ``(inputs, targets)`` as for :func:`nanhunt.replay`; the step is forward, loss
    and backward (no optimizer update). Or ``batches``, a fixed set to validate on (ordinary inputs,
    edge cases, inputs near decision boundaries): a list (named ``batch0``, ``batch1``...) or a dict
    name -> batch; every batch starts from the same state and RNG, samples are named ``name:index``,
    and the result holds one comparison per batch (``comparison.batches``) and the totals.

    The acceptance rule is fixed before anything runs: ``rule`` (a :class:`nanhunt.records.Rule`, e.g.
    :func:`rule_from` of a JSON file) or the arguments ``rtol``, ``atol``, ``task``, ``max_flips`` and
    ``fail_on_tolerance`` (not both). It holds when the float32 reference and the autocast run are finite
    (but for values introduced inside the modules ``rule.allow_nonfinite`` names), at most ``max_flips``
    decisions change (``task="classify"``), with ``fail_on_tolerance`` no element of the model's output
    or the loss is out of tolerance (|amp - ref| > atol + rtol * |ref|), and the quality of the
    autocast run is at most ``rule.max_quality_drop`` worse than float32's and at least
    ``rule.min_quality``. ``rtol``/``atol`` default to float16 1e-3/1e-5 and bfloat16 1e-2/1e-5;
    without ``fail_on_tolerance`` they only rank modules and mark near-boundary samples. The rule is
    stored with its sha256 (``comparison.acceptance``, ``comparison.rule_sha256``); each failed clause
    is a :class:`~nanhunt.records.Failure` naming its samples.

    Quality (``metric``): accuracy for ``task="classify"``, mean squared error (and the largest error)
    for ``"regress"``, or your ``fn(outputs, targets) -> float`` (a function, or its
    ``"package.module:fn"`` name), on both runs against the targets.

    ``dtype`` may list several autocast dtypes (``"float16,bfloat16"``): the reference runs once per
    batch, each candidate after it; ``report.comparison`` is the first's and
    ``report.comparison.alternatives`` the others'. ``speed=N`` then times the plain step (no hook
    of nanhunt's) N times interleaved, for the candidates that passed only.

    ``task="classify"``: the model's output holds class scores (classes on dim 1, or a 1-D
    output for one sample); the top-1 class is taken per sample in both runs, ties going to
    the lowest class index (:data:`TIE_RULE`). ``task="regress"``: the output's error per
    sample and its extremes. With a ``scaler``, the autocast backward is scaled by its current
    scale and the gradients unscaled before comparing, as training would.

    The model, its gradients, ``training`` flags and the RNG are restored afterwards, also on
    an exception. The result is ``report.comparison`` (a :class:`nanhunt.records.Comparison`);
    ``report.status`` is ``"clean"`` (rule held by every candidate), ``"reference-nonfinite"``,
    ``"nonfinite"`` (an autocast run) or ``"diverged"`` (another clause failed).

    Example::

        report = nanhunt.compare(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16, task="classify")
        c = report.comparison
        print(c.accepted, c.flipped, [c.modules[i].label() for i in c.ranking[:3]])

        rule = Rule(task="classify", max_flips=0, max_quality_drop=0.01)
        report = nanhunt.compare(model, batches={"ordinary": b1, "edge": b2, "boundary": b3}, loss_fn=F.cross_entropy,
                                 dtype="float16,bfloat16", rule=rule, speed=10)
        print([(c.dtype, c.accepted, [f.clause for f in c.failures]) for c in report.comparison.candidates()])
    """
    dts = _as_dtypes(dtype)
    rule = _rule_of_args(rule, rtol=rtol, atol=atol, task=task, max_flips=max_flips,
                         fail_on_tolerance=fail_on_tolerance)
    rule, metric_fn = settle_rule(rule, metric)
    if speed < 0:
        raise CommandError(f"speed must be >= 0 repetitions, not {speed}")
    named = _named(batch, batches)
    # no optimizer: the comparison runs forward, loss and backward (the scaler only gives its scale)
    step = Step.of(model, named[0][1], loss_fn=loss_fn, dtype=dts[0], device_type=device_type, scaler=scaler,
                   train=train, rng=rng)
    run = _Comparer(step, rule, metric_fn, dts, named, loss_fn=loss_fn, scaler=scaler, train=train,
                    is_set=batches is not None, metric_given=metric is not None)
    config = run.config(speed)
    module_classes = {name: type(m).__name__ for name, m in run.model.named_modules()}
    cands, results, speeds = run.execute(speed)
    status, first, extra = run.finish(cands, results, speeds, speed)
    return Report(status=status, first=None, loss=results[0].ref_loss, config=config, module_classes=module_classes,
                  environment=environment(run.device_type), command=command, notes=run.notes(notes) + tuple(extra),
                  comparison=first)
