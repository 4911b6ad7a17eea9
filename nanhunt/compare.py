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

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._errors import CommandError
from ._tree import map_tensors
from .records import Comparison, Decision, Regression, Report, TensorDiff
from ._env import environment
from .step import Step, _backward, _call_model, _loss_of

__all__ = ["compare", "default_tolerances", "top_two", "TIE_RULE", "TASKS"]

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


def _upcast(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


def _nonfinite(ts: Iterable[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in ts)


def _call_label(c: _Call) -> str:
    return f"{c.name or '<root>'}#{c.call_index} ({c.module_class})"


def _first_nonfinite(run: _Run, batch_inputs: Sequence[torch.Tensor]) -> str | None:
    """Where a run first held a non-finite value, in execution order."""
    if _nonfinite(batch_inputs):
        return "the batch (input)"
    if run.weights_nonfinite is not None:
        return f"the weights: {run.weights_nonfinite}"
    events: list[tuple[int, str]] = []
    for c in run.calls:
        if _nonfinite(c.inputs):
            events.append((c.start, f"the input of module {_call_label(c)} (forward)"))
        if c.outputs is not None and _nonfinite(c.outputs):
            events.append((c.end, f"the output of module {_call_label(c)} (forward)"))
    if events:
        return min(events)[1]
    if _nonfinite([run.loss]):
        return "the loss"
    bad = next((n for n, g in run.grads.items() if _nonfinite([g])), None)
    if bad is not None:
        return f"the gradient of {bad} (backward)"
    if run.output is not None and _nonfinite([run.output]):
        return "the model's output"
    return None


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


def _classify(ref: torch.Tensor, amp: torch.Tensor, *, rtol: float, atol: float
              ) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[Decision, ...]]:
    r, a = _as_samples(ref), _as_samples(amp)
    r_cls, r_second, r_top, r_margin = top_two(r)
    a_cls, _, a_top, a_margin = top_two(a)
    flipped = (r_cls != a_cls).tolist()
    # Near the boundary: the reference's own top-2 margin is within the score tolerance.
    near = (r_margin < atol + rtol * r_top.abs()).tolist()
    decisions = tuple(
        Decision(index=i, ref_class=int(r_cls[i]), amp_class=int(a_cls[i]), ref_runner_up=int(r_second[i]),
                 ref_margin=float(r_margin[i]), amp_margin=float(a_margin[i]), ref_score=float(r_top[i]),
                 amp_score=float(a_top[i]), flipped=bool(flipped[i]), near_boundary=bool(near[i]))
        for i in range(r.shape[0]) if flipped[i] or near[i]
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


# ------------------------------------------------------------------ the entry point


def compare(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[..., Any] | None = None,
    dtype: torch.dtype | str = torch.float16,
    device_type: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    task: str = "none",
    max_flips: int = 0,
    fail_on_tolerance: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    train: bool | None = None,
    rng: Mapping[str, Any] | None = None,
    command: str | None = None,
    notes: Sequence[str] = (),
) -> Report:
    """Run one step in float32 and under autocast from the same state; say where error is introduced.

    ``batch`` is ``(inputs, targets)`` as for :func:`nanhunt.replay`; the step is forward, loss
    and backward (no optimizer update). The acceptance rule is fixed by the arguments before
    anything runs: the float32 reference and the autocast run are finite, at most ``max_flips``
    decisions change (``task="classify"``) and, with ``fail_on_tolerance``, no element of the
    model's output or the loss is out of tolerance (|amp - ref| > atol + rtol * |ref|).
    ``rtol``/``atol`` default to float16 1e-3/1e-5 and bfloat16 1e-2/1e-5; without
    ``fail_on_tolerance`` they only rank modules and mark near-boundary samples.

    ``task="classify"``: the model's output holds class scores (classes on dim 1, or a 1-D
    output for one sample); the top-1 class is taken per sample in both runs, ties going to
    the lowest class index (:data:`TIE_RULE`). ``task="regress"``: the output's error per
    sample and its extremes. With a ``scaler``, the autocast backward is scaled by its current
    scale and the gradients unscaled before comparing, as training would.

    The model, its gradients, ``training`` flags and the RNG are restored afterwards, also on
    an exception. The result is ``report.comparison`` (a :class:`nanhunt.records.Comparison`);
    ``report.status`` is ``"clean"`` (rule held), ``"reference-nonfinite"``, ``"nonfinite"``
    (the autocast run) or ``"diverged"`` (too many flips, or out of tolerance when failing on it).

    Example::

        report = nanhunt.compare(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16, task="classify")
        c = report.comparison
        print(c.accepted, c.flipped, [c.modules[i].label() for i in c.ranking[:3]])
    """
    dt = _as_dtype(dtype)
    if task not in TASKS:
        raise CommandError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    d_rtol, d_atol = default_tolerances(dt)
    rtol = d_rtol if rtol is None else float(rtol)
    atol = d_atol if atol is None else float(atol)
    if not (rtol >= 0 and atol >= 0 and math.isfinite(rtol) and math.isfinite(atol)):
        raise CommandError(f"tolerances must be finite and >= 0 (rtol={rtol}, atol={atol})")
    if max_flips < 0:
        raise CommandError(f"max_flips must be >= 0, not {max_flips}")
    dtype_name = str(dt).replace("torch.", "")
    limit = float(torch.finfo(dt).max)
    scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0

    # no optimizer: the comparison runs forward, loss and backward (the scaler only gives its scale)
    step = Step.of(model, batch, loss_fn=loss_fn, dtype=dt, device_type=device_type, scaler=scaler, train=train,
                   rng=rng)
    model, inputs, targets, device_type = step.model, step.inputs, step.targets, step.device_type
    batch_floats, _ = _floats(inputs)
    config: dict[str, Any] = {
        "dtype": dtype_name,
        "device_type": device_type,
        "train": model.training if train is None else train,
        "loss_fn": getattr(loss_fn, "__qualname__", None) or (type(loss_fn).__name__ if loss_fn is not None else None),
        "task": task,
        "rtol": rtol,
        "atol": atol,
        "max_flips": max_flips,
        "fail_on_tolerance": fail_on_tolerance,
        "scaler_scale": scale if scaler is not None else None,
    }
    module_classes = {name: type(m).__name__ for name, m in model.named_modules()}
    base_notes = tuple(notes)
    low = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                  if p.is_floating_point() and p.dtype != torch.float32})
    if low:
        base_notes += (f"parameters held in {', '.join(low)}: the reference runs them as they are, so it is float32 "
                  "arithmetic on rounded weights",)
    # A float32 model's reference takes a float16/bfloat16 batch upcast (exactly): with autocast off, a
    # low-precision input would meet float32 weights. The autocast run takes the batch as it is.
    ref_batch = (inputs, targets) if low else (_upcast(inputs), _upcast(targets))
    rule = _Rule(dtype=dtype_name, device_type=device_type, rtol=rtol, atol=atol, task=task, max_flips=max_flips,
                 fail_on_tolerance=fail_on_tolerance, tie_rule=TIE_RULE if task == "classify" else "")

    def run(amp: bool) -> _Run:
        step.reset()
        ins, tgts = (inputs, targets) if amp else ref_batch
        return _run(model, ins, tgts, loss_fn, dtype=dt, device_type=device_type, amp=amp,
                    scale=scale if amp else 1.0)

    def report(status: str, comparison: Comparison, loss: float | None, extra: Sequence[str] = ()) -> Report:
        return Report(status=status, first=None, loss=loss, config=config, module_classes=module_classes,
                      environment=environment(device_type), command=command, notes=base_notes + tuple(extra),
                      comparison=comparison)

    with step.isolated():  # restored on leaving, also on Ctrl-C (held until the restore is complete)
        ref = run(amp=False)
        ref_loss = float(ref.loss.double().sum())
        ref_bad = _first_nonfinite(ref, batch_floats)
        if ref_bad is not None:
            # Checked first: a float32 step that is already non-finite is no reference for precision.
            why = (f"the float32 reference is non-finite, first at {ref_bad}: not a precision finding; "
                   "fix the float32 step first (nanhunt replay --dtype float32 names the op)")
            return report("reference-nonfinite", Comparison(**rule, accepted=False, violations=(why,),
                                                            reference_finite=False, reference_first_nonfinite=ref_bad,
                                                            amp_finite=None, ref_loss=ref_loss), ref_loss)
        amp = run(amp=True)

    amp_loss = float(amp.loss.double().sum())
    amp_bad = _first_nonfinite(amp, batch_floats)
    modules, ranking, unmatched = _compare_modules(ref, amp, rtol=rtol, atol=atol, limit=limit)
    loss_diff = _measure([ref.loss], [amp.loss], rtol, atol).diff(name="<loss>", kind="loss", limit=limit,
                                                                  dtype="float32", shape=tuple(ref.loss.shape))
    grads: list[TensorDiff] = []
    for name, g in ref.grads.items():
        ag = amp.grads.get(name)
        if ag is None:
            unmatched.append(f"gradient of {name} (float32 run only)")
            continue
        grads.append(_measure([g], [ag], rtol, atol).diff(name=name, kind="grad", limit=limit, dtype="float32",
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
    if task != "none":
        if ref.output is None or amp.output is None or ref.output.ndim == 0 or ref.output.shape != amp.output.shape:
            raise CommandError(f"--task {task} needs the model to return its scores or predictions as a tensor with "
                               "a sample dimension (or a dict with 'logits'); this model returned none")
        if task == "classify":
            n_samples, flipped, near, decisions = _classify(ref.output, amp.output, rtol=rtol, atol=atol)
        else:
            n_samples, regression = _regress(ref.output, amp.output)

    violations: list[str] = []
    if amp_bad is not None:
        violations.append(f"the autocast {dtype_name} run is non-finite, first at {amp_bad}")
    if task == "classify" and len(flipped) > max_flips:
        violations.append(f"{len(flipped)} decision flip{'s' if len(flipped) != 1 else ''} "
                          f"(at most {max_flips} allowed): sample{'s' if len(flipped) != 1 else ''} "
                          + ", ".join(map(str, flipped)))
    if fail_on_tolerance:
        for what, d in (("the model's output", output), ("the loss", loss_diff)):
            if d is not None and d.out_of_tol > 0:
                violations.append(f"{what}: {d.out_of_tol:.2%} of elements out of tolerance "
                                  f"(max abs error {d.max_abs:.3g}, max rel error {d.max_rel:.3g})")
    extra: list[str] = []
    if amp_bad is not None and amp_bad.startswith("the gradient") and scale != 1.0:
        extra.append(f"only the gradients went non-finite, with the loss scaled by {scale:g}: GradScaler would skip "
                     "this step and lower the scale; nanhunt replay tells whether it is scale-induced")
    if amp_bad is not None:
        status = "nonfinite"
    elif violations:
        status = "diverged"
    else:
        status = "clean"
    comparison = Comparison(
        **rule, accepted=not violations, violations=tuple(violations), reference_finite=True, amp_finite=amp_bad is None,
        amp_first_nonfinite=amp_bad, ref_loss=ref_loss, amp_loss=amp_loss, modules=tuple(modules), ranking=ranking,
        output=output, loss=loss_diff, grads=tuple(grads), n_samples=n_samples, flipped=flipped, near_boundary=near,
        decisions=decisions, regression=regression, unmatched=tuple(unmatched),
    )
    return report(status, comparison, ref_loss, extra)

