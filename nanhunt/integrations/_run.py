"""What the framework callbacks share: the Guard of one run, the guard step open now, and stopping the run."""

from __future__ import annotations

import inspect
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._errors import GuardError
from .._util._rng import preserve_rng
from ..guard.guard import Guard

__all__ = ["GuardedRun", "Unwatchable", "check_options", "check_values", "output_loss"]

# Guard options that describe the model and its replay: judged with the real model, when its Guard is made
_OF_THE_MODEL = ("model", "optimizer", "scaler", "dump_dir", "loss_fn", "model_factory", "model_kwargs",
                 "device_type", "dtype", "process_group")


class Unwatchable(ValueError):
    """A run the callback refuses to watch, raised where it refuses, as the training starts: Lightning's manual
    optimization, several optimizers, a model the Guard cannot capture. ``nanhunt run`` says it and lets the run
    go on unwatched; any other error of the callback is raised as it is."""


def check_options(dump_dir: str | os.PathLike[str], options: dict[str, Any]) -> None:
    """Fail when the callback is created, not when training starts: options the Guard does not take, or whose
    values it refuses."""
    params = inspect.signature(Guard).parameters
    unknown = [k for k in options if k not in params or k in ("model", "optimizer", "scaler", "dump_dir")]
    if unknown:
        raise TypeError(f"NanhuntCallback got options nanhunt.Guard does not take: {', '.join(unknown)}")
    if options.get("on_fail") == "rollback":
        raise ValueError("on_fail='rollback' is not available in NanhuntCallback: the framework owns the training "
                         "loop, so the guard cannot skip the batch and go on; use 'raise', 'dump' or 'warn'")
    check_values(options)
    os.fspath(dump_dir)  # a TypeError now for something that is no path


def check_values(options: Mapping[str, Any]) -> None:
    """The Guard's own checks of the options' values (its ValueError), run now on a one-weight model: a value
    it refuses is refused before the training starts, not at its first step, where ``nanhunt run`` would go
    on unwatched. The options that describe the model are judged when its Guard is made.

    It runs in the script, between its seeding and its training: the probe's weight is left uninitialised
    (``nn.Linear``'s init would draw from torch's generator, and every dropout mask after it would differ)."""
    with preserve_rng():
        probe = nn.Linear(1, 1, device="meta").to_empty(device="cpu")
        values = {k: v for k, v in options.items() if k not in _OF_THE_MODEL}
        Guard(probe, torch.optim.SGD(probe.parameters(), lr=0.0), dump_dir=".", **values).close()


def output_loss(output: Any) -> Any:
    """The loss a model's output holds (a transformers ``ModelOutput`` or a dict with ``loss``), or None."""
    return output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)


class GuardedRun:
    """One training run under a :class:`Guard`: a guard step per micro-batch, numbered by the framework's
    optimizer step (``begin``/``end``), the loss and gradient checks, and the run's end.

    Each call leaves torch's generators where the framework had them (:class:`preserve_rng`): the run draws the
    same dropout masks and data order as without nanhunt.

    A detection raised (:class:`nanhunt.GuardError`, ``on_fail="raise"``) ends the step, removes every hook
    (the run is over) and carries a note naming the framework and the step; the framework then unwinds."""

    def __init__(self, guard: Guard, framework: str, hooks: list[RemovableHandle] | None = None, *,
                 replay_options: str = "") -> None:
        self.guard = guard
        self.framework = framework
        self.replay_options = replay_options  # what the replay command needs besides the files ("--model ...")
        self.hooks = hooks if hooks is not None else []
        self._ctx: Any = None  # the guard step open now (guard._step's context)
        self._index = 0
        self.micro = 0  # micro-batches of the optimizer step so far
        self.loss_seen = False

    @property
    def open(self) -> bool:
        return self._ctx is not None

    def begin(self, batch: Any, index: int) -> None:
        """A micro-batch of optimizer step ``index`` begins (its batch and the RNG state are remembered)."""
        if self._ctx is not None:
            self.end()  # a step the framework left open (a batch it skipped)
        self.micro = self.micro + 1 if index == self._index else 1
        self._index = index
        with preserve_rng(host=False):
            ctx = self.guard._step(batch, index)
            ctx.__enter__()
        self._ctx, self.loss_seen = ctx, False

    def probe_autocast(self, module: nn.Module,
                       wrap: Callable[[Callable[..., None]], Callable[..., None]] = lambda hook: hook) -> None:
        """Take each step's autocast dtype from the first call of ``module`` within it: accelerate enters
        autocast inside the forward it wraps, after the model's own pre-hooks, so a child of the model sees the
        dtype the forward really runs in. Every step: a loop may warm up in float32 and go on under autocast.
        ``wrap``: how the hook is wrapped (``nanhunt run`` shields the script from nanhunt's own errors)."""
        asked: list[Any] = [None]  # the step (its context) whose dtype was taken

        def seen(m: nn.Module, args: tuple[Any, ...]) -> None:
            if self._ctx is None or self._ctx is asked[0]:
                return
            asked[0] = self._ctx
            with preserve_rng(host=False):
                self.guard._on_forward(m, args, again=True)

        self.hooks.append(module.register_forward_pre_hook(wrap(seen)))

    def loss(self, loss: torch.Tensor) -> None:
        """The micro-batch's loss (the first one handed over; checked on device, read with the gradients)."""
        if self._ctx is not None and not self.loss_seen:
            with preserve_rng(host=False):
                self.guard.loss(loss)
            self.loss_seen = True

    def check_grads(self) -> None:
        """Before the optimizer step: the loss and gradients (one fused check, one host read)."""
        if self._ctx is not None:
            self._call(self.guard.check_grads)

    def end(self) -> None:
        """The micro-batch is over (checks of a micro-batch that did not update, a skipped step)."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self._call(lambda: ctx.__exit__(None, None, None), ctx)

    def close(self, exc: BaseException | None = None) -> None:
        """The run is over (``exc``: it raised): end the open step, remove the hooks; safe to call twice."""
        ctx, self._ctx = self._ctx, None
        with preserve_rng():
            try:
                if ctx is not None:
                    if exc is None:
                        ctx.__exit__(None, None, None)
                    else:
                        ctx.__exit__(type(exc), exc, exc.__traceback__)
            finally:
                for h in self.hooks:
                    h.remove()
                self.hooks.clear()
                self.guard.close()

    def _call(self, fn: Callable[[], Any], ended: Any = None) -> None:
        try:
            with preserve_rng(host=False):  # a rollback at the step's end keeps the generators it put back
                fn()
        except BaseException as e:
            ctx, self._ctx = self._ctx, None
            if ctx is not None and ctx is not ended:
                ctx.__exit__(type(e), e, e.__traceback__)
            if isinstance(e, GuardError):
                self._stopped(e)
            raise

    def _stopped(self, e: GuardError) -> None:
        micro = f", micro-batch {self.micro} of it" if self.micro > 1 else ""
        note = f"nanhunt stopped the {self.framework} run at its optimizer step {self._index}{micro}"
        ev = e.event
        if self.replay_options and ev.checkpoint and ev.batch:
            files = f"{shlex.quote(ev.checkpoint)} {shlex.quote(ev.batch)}"
            note += f"; replay: nanhunt replay {files} {self.replay_options}"
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(note)
        self.close()
