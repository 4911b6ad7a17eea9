"""Recording one run of the step for a comparison: each module call's floating outputs, the first non-finite one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._text import dtype_name
from .._util._tree import map_tensors
from ..records import Level, Occurrence
from ..step._run import _backward, _call_model, _loss_of
from ..tracing.tracer import Trace


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
                dtypes.append(dtype_name(o.dtype))
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


def _absorbed(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[..., Any] | None, *,
              dtype: torch.dtype | None, device_type: str, scale: float, allow: Sequence[str]) -> tuple[str, ...]:
    """The autocast step once more, traced op by op: its silent origins (a non-finite value born and absorbed before
    the loss and the gradients, as a hand-written RMSNorm's float16 square of a large value: rsqrt(Inf) = 0), one
    line each. Module-level copies cannot see them: every value entering and leaving a module is finite. Harmless
    origins (feeding only indices) and those inside modules the rule allows are left out. ``dtype`` None: autocast
    off (a float8 run without autocast)."""
    from ..hunt.pipeline import _line_text

    with Trace(model, level=Level.OP) as t:
        with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
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
