"""The replayable step: one object for what a step needs (model, batch, loss, dtype, device, scaler,
optimizer, RNG, train flag), its snapshot (:class:`StepState`) and its runs.

Every stage that replays the step (trace, bisection, comparison, repro) takes a :class:`Step` and runs it
with :meth:`Step.run` inside :meth:`Step.isolated`, which snapshots everything the step can change once and
restores it in ``finally`` (Ctrl-C held until the restore is complete).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .._util._compiled import CompileSpec, spec_of
from .precision import LOSS_REGION, UPDATE_REGION, float32_weights, keep_fp32, to_fp32
from ._inputs import rng_state, set_rng_state, split_batch
from ._run import LossAt, run_step
from .snapshot import Snapshot, StepState

__all__ = ["Step", "StepState", "Snapshot", "run_step", "split_batch", "rng_state", "set_rng_state"]
@dataclasses.dataclass
class Step:
    """One training step to replay: forward and loss under autocast (``dtype``; float32 turns it off),
    ``scaler.scale(loss).backward()``, and the update when there is an optimizer.

    ``inputs`` is a tensor, a tuple of positional arguments or a dict of keyword arguments;
    ``loss_fn(output, targets)`` gives the loss (``loss_fn(output)`` without targets), or with no
    ``loss_fn`` the model's output is the loss (a scalar, ``.loss`` or ``["loss"]``, the element ``loss_at`` of a
    tuple, list or dict, or the one scalar it holds); with no ``loss_fn``, ``targets`` go to the model as its
    next positional argument when its forward takes one (``logits, loss = model(x, y)``). ``rng`` is the
    generator state the step starts from (default: the state when it is isolated); ``train`` sets the
    model's mode for every run (default: as it is). A ``torch.compile``'d model is replayed through its
    eager original (``compiled`` says so), and compiled as ``compile_spec`` says when that replay is finite.
    ``host_snapshot`` or ``snapshot``: where the snapshot of the weights and optimizer state lives (see
    :class:`StepState`; ``None``: in host memory when they are on an accelerator, in a temporary file when they
    are on the CPU and would not fit comfortably in the memory left).

    Example::

        step = Step.of(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16, scaler=scaler)
        with step.isolated():
            loss = step.run()
    """

    model: nn.Module
    inputs: Any
    targets: Any = None
    loss_fn: Callable[..., Any] | None = None
    dtype: torch.dtype = torch.float16
    device_type: str = "cpu"
    scaler: torch.amp.GradScaler | None = None
    optimizer: torch.optim.Optimizer | None = None
    rng: Mapping[str, Any] | None = None
    train: bool | None = None
    compiled: bool = False
    # how the model was compiled (a compiled step is also replayed compiled: nanhunt.hunt._compiled)
    compile_spec: CompileSpec | None = None
    notes: tuple[str, ...] = ()
    host_snapshot: bool | None = None
    snapshot: Snapshot | None = None
    # where the model's output holds its loss (``[1]`` of ``logits, loss``), as the capture recorded it
    loss_at: LossAt | None = None
    _state: StepState | None = dataclasses.field(default=None, repr=False, compare=False)
    _start_rng: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, model: nn.Module, batch: Any, *, device_type: str | None = None, **kw: Any) -> Step:
        """A step of ``model`` on ``batch`` (``(inputs, targets)``, a tensor or a dict of keyword
        arguments); ``device_type`` defaults to the device of the model's parameters."""
        inputs, targets = batch if isinstance(batch, tuple) and len(batch) == 2 else split_batch(batch)
        compiled = False
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):  # torch.compile: compiled graphs hide their ops
            kw.setdefault("compile_spec", spec_of(model))
            model, compiled = inner, True
        if device_type is None:
            device_type = next((p.device.type for p in model.parameters()), "cpu")
        return cls(model, inputs, targets, device_type=device_type, compiled=compiled, **kw)

    @property
    def start_rng(self) -> Mapping[str, Any]:
        """The generator state every run starts from (only while isolated)."""
        if self._start_rng is None:
            raise RuntimeError("Step.run() and start_rng need Step.isolated()")
        return self._start_rng

    @contextlib.contextmanager
    def isolated(self) -> Iterator[StepState]:
        """Snapshot everything the step can change; restore it on leaving, also on an exception or Ctrl-C.
        Nested, it reuses the snapshot already taken (one copy of the weights and optimizer state)."""
        if self._state is not None:
            yield self._state
            return
        state = StepState(self.model, self.optimizer, self.scaler, host=self.host_snapshot, snapshot=self.snapshot)
        with state:
            self._state, self._start_rng = state, dict(self.rng) if self.rng is not None else state.rng
            try:
                yield state
            finally:
                self._state = self._start_rng = None

    def reset(self) -> None:
        """Back to the step's start: the snapshot, no ``.grad``, the start RNG, the train flag."""
        state = self._state
        if state is None:
            raise RuntimeError("Step.run() and Step.reset() need Step.isolated()")
        state.reset(self.start_rng)
        if self.train is not None:
            self.model.train(self.train)  # StepState restores the flags

    def run(self, *, fp32: Collection[str] = (), dtype: torch.dtype | None = None, unscaled: bool = False,
            within: AbstractContextManager[Any] | None = None, before: Callable[[], None] | None = None,
            after: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the step once from its start (state reset, no ``.grad``, the start RNG, the train flag).

        ``fp32``: modules (and the regions ``<loss>``, ``<update>``) run in float32 (a half-precision model's
        modules with their parameters held in float32: their gradients and update too); ``dtype`` another
        autocast dtype, ``torch.float32`` being the float32 control (a half-precision model's weights,
        batch and optimizer state in float32 too); ``unscaled``: without the GradScaler; ``within``: a
        context entered around the step itself (a :class:`~nanhunt.Trace`); ``before``: called after the
        reset (hooks to register for this run only); ``after(loss)``: called while the float32 weights of
        the control are still in place (to check what the update made).

        Hooks registered since :meth:`isolated` (the user's, a trace entered around this call) stay for the run;
        those the run registers (a forward adding one, ``before``'s) are gone when it returns."""
        state = self._state
        if state is None:
            raise RuntimeError("Step.run() and Step.reset() need Step.isolated()")
        kept = state.hooks_now()
        self.reset()  # the snapshot's hooks: the ones added since are put back
        state.put_hooks(kept)
        try:
            if before is not None:
                before()
            inputs, targets = self.inputs, self.targets
            control = dtype == torch.float32  # asked for: the float32 control
            if control:
                inputs, targets = to_fp32(inputs), to_fp32(targets)
            with float32_weights(self.model, enabled=control, optimizer=self.optimizer), keep_fp32(
                    self.model, fp32, params=True, optimizer=self.optimizer):
                with within if within is not None else contextlib.nullcontext():
                    loss = run_step(self.model, inputs, targets, loss_fn=self.loss_fn, dtype=dtype or self.dtype,
                                    device_type=self.device_type, scaler=None if unscaled else self.scaler,
                                    optimizer=self.optimizer, fp32_loss=LOSS_REGION in fp32,
                                    fp32_update=UPDATE_REGION in fp32, loss_at=self.loss_at)
                if after is not None:
                    after(loss)
                return loss
        finally:
            state.put_hooks(kept)


