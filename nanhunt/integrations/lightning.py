"""Lightning under :class:`nanhunt.Guard`: stop at the first bad step and leave a capture that
``nanhunt replay CKPT BATCH --model pkg.mod:MyModule`` replays through the module's own ``training_step``.

Where Lightning shows what the Guard needs (2.x, ``TrainingEpochLoop`` and the precision plugins):
``on_train_batch_start`` has the batch on the device (after the precision plugin's ``convert_input``), before
``training_step`` draws any random number: a guard step opens there. ``on_before_backward`` has the loss;
``on_before_optimizer_step`` runs after the backward (and, with a GradScaler, after ``unscale_``), before the
update and before gradient clipping: the loss and gradients are checked there. With ``bf16-mixed`` and the
``-true`` plugins the closure (``training_step`` + backward) runs inside ``optimizer.step(closure)``: the check
still comes before the update writes the weights. ``on_train_batch_end`` ends the guard step. The step is
numbered by ``trainer.global_step``, which all micro-batches of an optimizer step share.

The same class is a ``lightning.pytorch`` and a ``pytorch_lightning`` callback (whichever are installed).
"""

from __future__ import annotations

import importlib
import inspect
import os
import shlex
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .._util._rng import rng_preserved
from ..guard.guard import Guard
from ._run import GuardedRun, Unwatchable, check_options

__all__ = ["NanhuntCallback"]


def _callback_base() -> type:
    bases: list[type] = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("nanhunt.integrations.lightning needs Lightning: pip install lightning")
    return bases[0] if len(bases) == 1 else type("Callback", tuple(bases), {})


if TYPE_CHECKING:
    from lightning.pytorch import Callback as _Callback
else:
    _Callback = _callback_base()

# The autocast dtype of each precision plugin; the others ("16-true", "bf16-true", "32-true", "64-true") run
# without autocast, in the dtype of the weights, which the capture holds.
_AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_PLAIN = (str, int, float, bool, type(None))


class NanhuntCallback(_Callback):
    """Give a Lightning run what :class:`nanhunt.Guard` gives a hand-written loop.

    At the first non-finite loss, gradient or update (or too many GradScaler skips with ``16-mixed``) it writes
    the capture of the step as it began (``step{N}[-rank{R}]-checkpoint.pt`` / ``-batch.pt`` in ``dump_dir``,
    ``N`` the trainer's ``global_step``) and stops the run: ``trainer.fit()`` raises
    :class:`nanhunt.GuardError`, whose message names the step, the rank and the ``nanhunt replay`` command.
    The capture replays ``training_step(batch, batch_idx)`` as the step's loss, in the precision plugin's
    autocast dtype, with its GradScaler; the module is rebuilt by its class with its saved hyper-parameters
    (``self.save_hyperparameters()``), so ``--model pkg.mod:MyModule`` confirms it and no ``--loss`` is needed.

    Example::

        from nanhunt.integrations.lightning import NanhuntCallback

        trainer = lightning.Trainer(precision="bf16-mixed", callbacks=[NanhuntCallback(dump_dir="nan-captures")])
        trainer.fit(model, loader)

    Args:
        dump_dir: where captures go.
        guard_options: :class:`nanhunt.Guard`'s keyword options (``on_fail``, ``max_consecutive_skips``,
            ``snapshot_every``, ``check_params``, ``model_factory``, ``model_kwargs``, ...). By default
            ``tracker`` is ``trainer.loggers``: the headroom history and the Guard's events go to every logger
            under ``nanhunt/`` (``tracker=None``: nowhere).

    Checkpoints: after a detection (``on_fail="dump"`` or ``"warn"``, the run goes on) no ``ModelCheckpoint``
    saves until a step is clean, so ``save_top_k`` never rotates the last good checkpoint out; the event names it
    (``event.last_checkpoint``).

    Automatic optimization only (one optimizer; with manual optimization, use :class:`nanhunt.Guard` in
    ``training_step``). Under DDP every rank stops at the same step (the Guard's flags are all-reduced).
    """

    def __init__(self, *, dump_dir: str | os.PathLike[str], **guard_options: Any) -> None:
        check_options(dump_dir, guard_options)
        self.dump_dir = dump_dir
        self.guard_options = guard_options
        self.run: GuardedRun | None = None
        self._takes_batch_idx = True
        self._scaled = False

    # ----------------------------------------------------------------- Lightning events
    @rng_preserved  # between the script's seeding and its first batch: making the Guard draws nothing
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None:
            self.run.close()  # an earlier fit() that raised
            self.run = None
        if not pl_module.automatic_optimization:
            raise Unwatchable("NanhuntCallback supports automatic optimization; with manual optimization, wrap the "
                              "steps of training_step in nanhunt.Guard")
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise Unwatchable(f"NanhuntCallback needs one optimizer, the trainer has {len(optimizers)}")
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed's GradScaler
        options = dict(self.guard_options)
        options.setdefault("dtype", _AUTOCAST.get(str(trainer.precision), torch.float32))
        options.setdefault("tracker", list(trainer.loggers) or None)  # the run's loggers: CSV, TensorBoard, W&B, ...
        if "model_factory" not in options and "model_kwargs" not in options:
            options["model_kwargs"] = _hyperparameters(pl_module)
        try:
            guard = Guard(pl_module, optimizers[0], scaler, dump_dir=self.dump_dir, **options)
        except ValueError as e:  # the module: its options were judged when the callback was made
            raise Unwatchable(str(e)) from e
        guard._capture.step_call = "training_step"
        self._takes_batch_idx = _takes_batch_idx(pl_module.training_step)
        self._scaled = scaler is not None and scaler.is_enabled()
        # the module's class is usually a script's or the project's own: the replay confirms it with --model
        self.run = GuardedRun(guard, "Lightning", [], replay_options=f"--model {shlex.quote(guard.model_factory)}")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.run is not None:
            # training_step's arguments, as Lightning passes them
            inputs = (batch, batch_idx) if self._takes_batch_idx else (batch,)
            self.run.begin({"inputs": inputs}, int(trainer.global_step))
            if self.run.guard.bad_since is None:  # the last checkpoint saved while the steps were clean
                saved = [getattr(cb, "_last_checkpoint_saved", "") for cb in trainer.checkpoint_callbacks]
                self.run.guard.last_checkpoint = next((p for p in saved if p), None)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.run is None:
            return
        # With a GradScaler Lightning hands over the scaled loss: a float32 one stays finite when the loss is
        # (it would take a loss above 1e31); a half one may overflow while the loss is finite, and is left to
        # the gradient check (GradScaler's found_inf and the skip policy).
        if not self._scaled or loss.dtype in (torch.float32, torch.float64):
            self.run.loss(loss)
        else:
            self.run.loss_seen = True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Only after a backward: a training_step that returned None ran none, and unscaling then would leave
        # the GradScaler's per-optimizer state for a step Lightning does not take.
        if self.run is not None and self.run.loss_seen:
            self.run.check_grads()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.run is not None:
            self.run.end()
            if self.run.guard.bad_since is not None:
                # quarantine: a checkpoint of a non-finite step must not rotate the last good one out. Lightning
                # runs checkpoint callbacks after this one; a ModelCheckpoint skips a step it saved already.
                for cb in trainer.checkpoint_callbacks:
                    if hasattr(cb, "_last_global_step_saved"):
                        cb._last_global_step_saved = trainer.global_step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.run is not None:
            self.run.close(exception)
            self.run = None


def _takes_batch_idx(training_step: Any) -> bool:
    """Whether Lightning passes ``batch_idx`` to this ``training_step`` (as its ``is_param_in_hook_signature``)."""
    try:
        params = list(inspect.signature(training_step).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (any(p.name == "batch_idx" for p in params) or any(p.kind is p.VAR_POSITIONAL for p in params)
            or len(positional) >= 2)


def _hyperparameters(module: Any) -> dict[str, Any]:
    """The module's saved hyper-parameters, to rebuild it by its class; {} when they are not plain data (the
    capture loads with weights_only: no objects)."""
    hparams = dict(getattr(module, "hparams", None) or {})
    if all(isinstance(k, str) for k in hparams) and _plain(hparams):
        return hparams
    warnings.warn("NanhuntCallback: the module's hyper-parameters are not all plain values (str, int, float, "
                  "bool, None, lists and dicts of them): the capture rebuilds it with its class's defaults; pass "
                  "model_factory='package.module:factory' to rebuild it your way", stacklevel=3)
    return {}


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False
