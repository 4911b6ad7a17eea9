"""``transformers.Trainer`` under :class:`nanhunt.Guard`: stop at the first bad step and leave a capture that
``nanhunt replay CKPT BATCH`` replays with no other argument.

Where the Trainer shows what the Guard needs (transformers 5.x, ``Trainer._run_epoch`` and ``training_step``):
callbacks see neither the batch nor the loss, so the callback hooks the model itself. A forward pre-hook opens
a guard step for each training micro-batch with the keyword arguments the Trainer calls the model with (the
batch, on the device, ``labels`` included) and the RNG state as the forward begins; a forward hook hands over the
model's own ``.loss``. ``on_pre_optimizer_step`` (after gradient clipping, which unscales a GradScaler's
gradients, before ``optimizer.step()``) checks the loss and the gradients; ``on_substep_end`` (a micro-batch
that only accumulated) and ``on_step_end`` (after the update) end the guard step, where a micro-batch's loss
and, with a GradScaler, a skipped update are checked. The step is numbered by ``state.global_step``, which all
micro-batches of an optimizer step share.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .._util._rng import rng_preserved
from ..guard._tracker import Sink
from ..guard.guard import Guard
from ._run import GuardedRun, Unwatchable, check_options, output_loss

__all__ = ["NanhuntCallback"]


class NanhuntCallback(TrainerCallback):
    """Give a ``transformers.Trainer`` run what :class:`nanhunt.Guard` gives a hand-written loop.

    At the first non-finite loss, gradient or update (or too many GradScaler skips) it writes the capture of the
    step as it began (``step{N}[-rank{R}]-checkpoint.pt`` / ``-batch.pt`` in ``dump_dir``, ``N`` the Trainer's
    ``global_step``) and stops the run: ``trainer.train()`` raises :class:`nanhunt.GuardError`, whose message
    names the step, the rank and the ``nanhunt replay`` command. A ``transformers`` model's capture holds its
    config: the replay rebuilds the model from it and takes the model's own loss from the batch's ``labels``.

    Example::

        from nanhunt.integrations.transformers import NanhuntCallback

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[NanhuntCallback(dump_dir="nan-captures")])
        trainer.train()

    Args:
        dump_dir: where captures go.
        guard_options: :class:`nanhunt.Guard`'s keyword options (``on_fail``, ``max_consecutive_skips``,
            ``snapshot_every``, ``check_params``, ``dtype``, ...). The autocast dtype is by default the one the
            model's forward really ran in (``fp16=True`` on the CPU runs in float32 with accelerate 1.x). By
            default ``tracker`` is the run's ``report_to`` integrations: the headroom history and the Guard's
            events go to its TensorBoard, W&B, MLflow, ... under ``train/nanhunt/`` (``tracker=None``: nowhere).

    Gradient accumulation: each micro-batch is a guard step; the capture holds the micro-batch that went bad.
    Checkpoints: after a detection (``on_fail="dump"`` or ``"warn"``, the run goes on) no checkpoint is saved
    until an optimizer step is clean, so ``save_total_limit`` never rotates the last good one out; the event
    names it (``event.last_checkpoint``).
    Several processes (torchrun, ``accelerate launch``): every rank stops at the same step (the Guard's flags
    are all-reduced), and the ranks that saw the problem write ``step{N}-rank{R}-*``.
    """

    def __init__(self, *, dump_dir: str | os.PathLike[str], **guard_options: Any) -> None:
        check_options(dump_dir, guard_options)
        self.dump_dir = dump_dir
        self.guard_options = guard_options
        self.run: GuardedRun | None = None
        self._state: Any = None

    # ----------------------------------------------------------------- Trainer events
    @rng_preserved  # between the script's seeding and its first batch: making the Guard draws nothing
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.close()  # an earlier train() that raised
            self.run = None
        if model is None or optimizer is None:
            raise Unwatchable("NanhuntCallback needs the Trainer's model and optimizer")
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer  # accelerate's AcceleratedOptimizer: the torch optimizer inside
        scaler = getattr(optimizer, "scaler", None)  # the GradScaler of fp16 training (accelerate), or None
        options = dict(self.guard_options)
        if "tracker" not in options:  # the run's report_to integrations, as the Trainer's own logs reach them
            options["tracker"] = _Integrations.of(self, args, state, control)
        try:
            guard = Guard(model, inner, scaler, dump_dir=self.dump_dir, **options)
        except ValueError as e:  # the model: its options were judged when the callback was made
            raise Unwatchable(str(e)) from e
        if getattr(args, "torch_compile", False):  # accelerate compiles the model; the callback is given it plain
            guard._compiled_as({"backend": args.torch_compile_backend or "inductor",
                                "mode": args.torch_compile_mode, "options": {}, "dynamic": None})
        self._state = state
        hooks = [model.register_forward_pre_hook(self._forward_begins, prepend=True, with_kwargs=True),
                 model.register_forward_hook(self._forward_ends)]
        self.run = GuardedRun(guard, "transformers.Trainer", hooks)
        if "dtype" not in options:
            # its first child sees the dtype the forward really runs in (none for fp16 on the CPU). A PEFT
            # model's forward may call its base model directly, skipping its first child (the tuner): the
            # base model's first child is probed
            get_base: Any = getattr(model, "get_base_model", None)
            base = get_base() if callable(get_base) else model
            child = next((base if isinstance(base, nn.Module) else model).children(), None)
            if child is not None:
                self.run.probe_autocast(child)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._state = state

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.check_grads()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.end()
            if self.run.guard.bad_since is not None:
                # quarantine: a checkpoint of a non-finite step must not rotate the last good one out
                control.should_save = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.guard.last_checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None

    # ------------------------------------------------------------------ model hooks
    def _forward_begins(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        run = self.run
        if run is None or run.open or not module.training or not torch.is_grad_enabled():
            return  # evaluation, or a second forward inside one micro-batch
        # the Trainer calls model(**inputs); a positional call keeps its arguments
        inputs: Any = dict(kwargs) if not args else tuple(args)
        run.begin({"inputs": inputs}, int(self._state.global_step) if self._state is not None else 0)

    def _forward_ends(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        run = self.run
        if run is None or not run.open:
            return
        loss = output_loss(output)
        if isinstance(loss, torch.Tensor):
            run.loss(loss)


class _Integrations(Sink):
    """The Trainer's ``report_to`` integrations (its TensorBoard, W&B, MLflow, ... callbacks) as a tracker: the
    Guard's numbers go to each one's ``on_log`` as the Trainer's own logs do (under ``train/``, at the step
    ``state.global_step``); an event's text to those that take text (TensorBoard, W&B), its count to all."""

    _TEXT = ("TensorBoardCallback", "WandbCallback")

    def __init__(self, callbacks: list[Any], args: Any, state: Any, control: Any) -> None:
        self.callbacks, self.args, self.state, self.control = callbacks, args, state, control

    @classmethod
    def of(cls, callback: TrainerCallback, args: Any, state: Any, control: Any) -> _Integrations | None:
        """The integrations among the callbacks of the Trainer that called ``callback``'s ``on_train_begin``;
        None without any. A callback is given no handle on its Trainer: its ``CallbackHandler`` is the caller up
        the stack (``call_event``) whose callbacks hold this one."""
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
        from transformers.trainer_callback import CallbackHandler

        kinds = tuple(INTEGRATION_TO_CALLBACK.values())
        frame = sys._getframe(1)
        for _ in range(16):  # the decorators and nanhunt run's wrapper between this and call_event
            owner = frame.f_locals.get("self")
            if isinstance(owner, CallbackHandler) and any(c is callback for c in owner.callbacks):
                found = [c for c in owner.callbacks if isinstance(c, kinds)]
                return cls(found, args, state, control) if found else None
            if frame.f_back is None:
                break
            frame = frame.f_back
        return None

    def metrics(self, values: dict[str, float], step: int) -> None:
        for cb in self.callbacks:
            cb.on_log(self.args, self.state, self.control, logs=dict(values))

    def event(self, text: str, step: int, *, kind: str) -> None:
        for cb in self.callbacks:
            if type(cb).__name__ in self._TEXT:
                cb.on_log(self.args, self.state, self.control, logs={"nanhunt/event": text})
