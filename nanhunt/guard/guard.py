"""Training-loop guard: notice the first bad step and leave a capture that ``nanhunt replay`` reproduces.

:class:`Guard` runs the step's life (entry, checks, exit, counters) and composes its parts: the detection
flags and their one read across ranks (``_guard_flags.Detector``), the skip policy (``_skip_policy.SkipPolicy``,
plain Python), the capture writer (``_guard_capture.CaptureWriter``), the headroom history
(``_headroom.Headroom``) and the rollback (``_rollback.Rollback``). :class:`GuardEvent` lives in ``records``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..distributed import _fsdp1
from .._util._dispatch import tensor_version
from .._util._errors import GuardError
from .._util._rng import keep_rng, rng_preserved
from ._guard_capture import CaptureWriter, StepEntry
from ._guard_flags import (GRADS, LOSS, PARAMS, SKIP, Detector, any_set, nonfinite_weights, scaler_entry, scalars,
                           seen)
from ._headroom import Finding, Headroom
from ._part import Part as _Part
from ._rollback import Plan, Rollback, check_indices, host_rng
from ._skip_policy import SkipPolicy
from ._tracker import GuardTracker
from ..capture.capture import rng_state
from ..records import GuardEvent

__all__ = ["Guard", "GuardEvent", "GuardWarning", "HeadroomWarning"]

OnFail = Literal["raise", "dump", "warn", "rollback"]
OnWarn = Literal["log", "capture", "stop"]


class GuardWarning(UserWarning):
    """Issued by :class:`Guard` with ``on_fail="warn"``."""


class HeadroomWarning(GuardWarning):
    """Issued by :class:`Guard` before any non-finite value: a module's values near their dtype's limit and
    growing, the GradScaler's scale falling, a loss or gradient-norm spike, weights or optimizer state near
    the limit (once per module and condition)."""


@dataclass
class _Step(StepEntry):
    """The step in progress: what a capture needs (``StepEntry``) and what its checks found so far."""

    loss: torch.Tensor | None = None
    checked: bool = False
    grads_ok: bool = True
    local_skip: bool | None = None
    policy_done: bool = False
    update_ran: bool = False
    scale: float | None = None
    tripped: bool = False
    watched: bool = False  # the headroom history has had this step's numbers
    # on_fail="rollback": the guard dropped the gradients before optimizer.step() (``held``), the parameters'
    # versions then, and whether the optimizer wrote them all the same (a custom one that ignores .grad)
    held: bool = False
    versions: list[int] | None = None
    wrote: bool = False

    @property
    def updated(self) -> bool:
        """The optimizer changed this rank's parameters in this step."""
        return self.update_ran and not self.local_skip and (not self.held or self.wrote)


class Guard:
    """Watch a training loop; at the first bad step, write a capture ``nanhunt replay`` reproduces.

    It detects a non-finite loss (:meth:`loss`), non-finite gradients (:meth:`check_grads`: one fused on-device
    reduction and one host read, GradScaler's own; without a GradScaler ``optimizer.step()`` checks them itself when
    the loop did not), a GradScaler that skips too often, and non-finite weights after an update (found by the next
    step's checks, or at once with ``check_params``). At a detection it writes ``step{N}[-rank{R}]-checkpoint.pt``,
    ``-batch.pt`` and ``-event.json`` into ``dump_dir``, the state *before* the failing update, then does what
    ``on_fail`` says; :meth:`rollback` puts that state back and the loop goes on with its next batch. Before any
    non-finite value, the headroom history warns of values growing towards their dtype's limit
    (:class:`HeadroomWarning`, ``on_warn``). Under ``torch.distributed`` one ``all_reduce`` per check makes every
    rank stop (or roll back) at the same step. Nothing reads back per parameter on the clean path.

    Counters: ``iterations`` (guard steps), ``updates`` (updates that ran and stand), ``skipped`` (GradScaler
    skips), ``rollbacks``, ``stepped`` (the last step updated the weights: step a scheduler on it),
    ``scale_history`` ((step, scale) at each change), ``events``, ``bad_since`` (the first step of the detections
    in a row, None once a step is clean) and ``last_checkpoint`` (set by the callbacks, named by the events).
    The guide (docs/guard.md) tells the rest: what a rollback restores, the warnings, FSDP, the measured costs.

    Example::

        guard = nanhunt.Guard(model, optimizer, scaler, dump_dir="nan-captures", loss_fn=loss_fn)
        for batch in loader:
            inputs, targets = batch
            with guard.step(batch):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = guard.loss(loss_fn(model(inputs), targets))
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                guard.check_grads()
                scaler.step(optimizer)
                scaler.update()
            if guard.stepped:
                scheduler.step()

    Args:
        model, optimizer, scaler: what the loop trains with (``scaler`` None or disabled: no GradScaler). A DDP
            or ``torch.compile`` wrapper is unwrapped for the capture.
        dump_dir: where captures go (created on the first one).
        loss_fn, model_factory, model_kwargs: how ``nanhunt replay`` rebuilds the step. The model must be
            rebuildable by name: its class (called with ``model_kwargs``) or
            ``model_factory="package.module:callable"``; ``loss_fn`` an ``nn.Module`` loss or a module-level
            function (``None``: the model returns its loss). Checked here, not at the first failure; a name
            defined in the training script by running what its replay runs of the script (a
            :class:`GuardWarning` says what that replay would lack).
        on_fail: what a detection does after its capture: raise :class:`nanhunt.GuardError` (``"raise"``,
            default), go on silently (``"dump"``), warn (``"warn"``) or :meth:`rollback` (``"rollback"``).
        max_rollbacks: rollbacks allowed in the run; the next one raises instead.
        max_consecutive_skips: trip at this many GradScaler skips in a row (None: never).
        skip_window: ``(window, max_rate)``: trip when more than ``max_rate * window`` of the last ``window``
            steps were skipped (None: never).
        snapshot_every: keep a CPU copy of the state at the start of every N-th step: what a capture and a
            rollback need when an update itself wrote non-finite weights (no GradScaler); one device-to-host
            copy of the parameters, buffers and optimizer state every N steps, and that much host memory.
        check_params: check the optimizer's parameters after every update (a fused check and a second host
            read), rather than at the next step's checks.
        max_captures: captures written at most (later detections are events only).
        dump_all_ranks: under torch.distributed, every rank writes its capture, not only the ranks that saw
            the problem.
        device_type, dtype: the autocast configuration recorded in the capture; by default the device of the
            parameters and the autocast dtype in effect when the model's forward ran (float32 when autocast was
            off).
        process_group: the group whose ranks stop together (default: the world).
        headroom_every: sample the modules' headroom on one step in this many; ``"auto"`` (the default): 16,
            lengthened (up to 32) until the sampled steps' extra time is 1% of a step; None: no module history
            (loss, gradient norm and scale still judged). Off for a ``torch.compile`` model (its hooks recompile).
        warn_horizon: warn when a module's overflow is forecast at most this many steps ahead.
        on_warn: what a warning does besides its :class:`HeadroomWarning` and event: nothing (``"log"``,
            default), write a capture of the first warned step, not counted in ``max_captures`` (``"capture"``),
            or raise :class:`nanhunt.GuardError` with the warning's event (``"stop"``). Under torch.distributed
            ``"log"`` only: each rank judges its own history, and a rank that stopped alone would leave the
            others waiting.
        tracker: the run's experiment tracker, given the headroom history at each window's read and every warning
            and detection (docs/guard.md, "In your tracker"): a TensorBoard ``SummaryWriter``, a W&B run, the
            ``mlflow`` module or an MLflow run, a Lightning logger, a callable ``(dict, step)``, or a list of them.

    The batch is kept by reference until the next step: don't modify it in place during the step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        *,
        dump_dir: str | os.PathLike[str],
        loss_fn: Any = None,
        model_factory: str | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        on_fail: OnFail = "raise",
        max_rollbacks: int = 3,
        max_consecutive_skips: int | None = 10,
        skip_window: tuple[int, float] | None = (1000, 0.05),
        snapshot_every: int | None = None,
        check_params: bool = False,
        max_captures: int = 1,
        dump_all_ranks: bool = False,
        device_type: str | None = None,
        dtype: torch.dtype | None = None,
        process_group: Any = None,
        headroom_every: int | Literal["auto"] | None = "auto",
        warn_horizon: int = 1000,
        on_warn: OnWarn = "log",
        tracker: Any = None,
    ) -> None:
        _check_options(model, on_fail=on_fail, on_warn=on_warn, max_rollbacks=max_rollbacks,
                       snapshot_every=snapshot_every)
        self._policy = SkipPolicy(max_consecutive_skips, skip_window)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.on_fail: OnFail = on_fail
        self.check_params = check_params
        self._detect = Detector(optimizer, process_group)
        self._capture = CaptureWriter(
            model, optimizer, scaler, dump_dir=dump_dir, loss_fn=loss_fn, model_factory=model_factory,
            model_kwargs=model_kwargs, device_type=device_type or self._detect.device.type, dtype=dtype,
            snapshot_every=snapshot_every, max_captures=max_captures, dump_all_ranks=dump_all_ranks,
            rank=self._detect.rank)
        self._capture.group = self._detect._pg
        if on_warn != "log" and self._detect.world > 1:
            raise ValueError(f"on_warn={on_warn!r} needs a single process: under torch.distributed pass on_warn='log'")
        self.on_warn: OnWarn = on_warn
        compiled = self._capture.compiled is not None  # hooks would recompile it, or go unseen by its graph
        self._watch = Headroom(self._capture.module, optimizer, every=None if compiled else headroom_every,
                               horizon=warn_horizon, device_type=self._capture.device_type)
        self._capture.headroom = self._watch  # a capture's event file holds its picture
        self._tracker = GuardTracker(tracker, GuardWarning)
        self._watch.tracker = self._tracker if tracker is not None else None
        self._warn_captured = False
        for problem in self._capture.replay_problems:  # the replay command it would print fails: said now
            warnings.warn(f"nanhunt.Guard: {problem}", GuardWarning, stacklevel=2)
        self._rollback = Rollback(self, max_rollbacks)
        self.iterations = 0
        self.updates = 0
        self.skipped = 0
        self.stepped = False
        self.scale_history: list[tuple[int, float]] = []
        self.events: list[GuardEvent] = []
        # Checkpoint quarantine (the callbacks): the first step of the detections in a row, None once a step is
        # clean; and the last checkpoint the framework saved while the steps were clean, named by the events.
        self.bad_since: int | None = None
        self._bad_at: int | None = None  # the last step with a detection (its micro-batches share its index)
        self.last_checkpoint: str | None = None
        self._cur: _Step | None = None
        self._closed = False
        self._hooks: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre_update),
            optimizer.register_step_post_hook(self._post_update),
            model.register_forward_pre_hook(self._on_forward),
        ]

    # The configuration, kept by the part that uses it.
    max_consecutive_skips = _Part[int | None]("_policy")
    skip_window = _Part[tuple[int, float] | None]("_policy")
    dump_dir = _Part[str]("_capture")
    loss_fn = _Part[Any]("_capture")
    model_factory = _Part[str]("_capture")
    model_kwargs = _Part[dict[str, Any]]("_capture")
    device_type = _Part[str]("_capture")
    dtype = _Part[torch.dtype | None]("_capture")
    snapshot_every = _Part[int | None]("_capture")
    max_captures = _Part[int]("_capture")
    dump_all_ranks = _Part[bool]("_capture")
    captures = _Part[int]("_capture")  # captures of detections written so far (max_captures limits them)
    warning_captures = _Part[int]("_capture")  # on_warn="capture": captures of warned, finite steps
    max_rollbacks = _Part[int]("_rollback")
    rollbacks = _Part[int]("_rollback")  # rollbacks done so far

    # ------------------------------------------------------------------ API
    def step(self, batch: Any, *, indices: Any = None) -> _StepContext:
        """Context manager around one training step on ``batch`` (remembered with the RNG state); ``indices``: its
        dataset indices (ints), which a rollback lists in ``dump_dir/skip_batches.json`` (docs/guard.md)."""
        return self._step(batch, indices=indices)

    def _step(self, batch: Any, index: int | None = None, *, indices: Any = None) -> _StepContext:
        """``step``, numbered ``index`` (default: ``iterations``): a framework's optimizer step, which its
        micro-batches share (the integrations)."""
        if self._closed:
            raise RuntimeError("this Guard is closed")
        check_indices(indices)
        return _StepContext(self, batch, index, indices)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hand over the step's loss to be checked (no host read here); returns it unchanged."""
        cur = self._require("loss")
        cur.loss = loss.detach()
        return loss

    def check_grads(self, grad_norm: torch.Tensor | float | None = None) -> bool:
        """Check the loss and gradients; call after ``unscale_``/clipping, before ``scaler.step``.

        With a GradScaler, reuses its ``found_inf`` (calling ``scaler.unscale_``
        if the loop did not); without one, one fused reduction over the
        gradients. One host read in all (plus one ``all_reduce`` when
        distributed). Returns True when every rank's loss and gradients are
        finite: without a GradScaler and with ``on_fail`` other than ``"raise"``,
        skip ``optimizer.step()`` when it returns False. Repeated calls in one step
        return the first answer. ``grad_norm``: the norm the loop has (``clip_grad_norm_``'s), for the
        headroom history's spike check; read in the same host read.
        """
        cur = self._require("check_grads")
        if cur.checked:
            return cur.grads_ok
        cur.checked = True
        scaling = self._scaling()
        grads_flag = self._detect.grads_flag(self.optimizer, self.scaler if scaling else None)
        extra: list[torch.Tensor] = []
        if scaling and self.scaler is not None and self.scaler._scale is not None \
                and self.scaler._growth_tracker is not None and not isinstance(cur.scale_before, float):
            extra = [self.scaler._scale, self.scaler._growth_tracker]  # still the state the step began with
        n_scaler = len(extra)
        watched = scalars(extra, cur.loss, grad_norm)  # the headroom history's numbers, in the same read
        per_rank, values = self._detect.read([None, grads_flag, None, None], extra, loss=cur.loss)
        if n_scaler:
            cur.scale_before, cur.tracker_before = values[0], int(values[1])
        if isinstance(cur.scale_before, float):
            self._note_scale(cur, cur.scale_before)
        any_bits = any_set(per_rank)
        cur.grads_ok = not any_bits & (LOSS | GRADS)
        reason = None
        if scaling:
            cur.local_skip = bool(self._detect.own(per_rank) & GRADS)
            cur.policy_done = True
            reason = self._policy.record(bool(any_bits & GRADS))
        kind: str | None = None
        detail = ""
        ranks: tuple[int, ...] = ()
        if any_bits & LOSS:
            kind, detail, ranks = "loss", "non-finite loss", seen(per_rank, LOSS)
        elif any_bits & GRADS and not scaling:
            kind, detail, ranks = "grads", "non-finite gradients", seen(per_rank, GRADS)
        elif reason is not None:
            kind, detail, ranks = "skips", reason, seen(per_rank, GRADS)
        if kind is not None:
            # Still before scaler.step/optimizer.step: the live state is the pre-update state.
            self._trip(cur, kind, detail, ranks, per_rank, live=True, stacklevel=3)
        else:
            self._headroom(cur, *watched(values[n_scaler:]), live=True, scaler_before=False, stacklevel=4)
        return cur.grads_ok

    def note_change(self, text: str) -> None:
        """Record a change of policy made before the loop resumes (a float32 region, another dtype, a lower
        learning rate), in a line of its own: it goes into the next rollback's event, or into a ``"change"``
        event when the next step begins. A change is an experiment to judge, not a fix."""
        self._rollback.note_change(text)

    def rollback(self, change: str | None = None) -> GuardEvent:
        """Undo the last step's detection: the state the failing update began with, put back.

        The parameters and persistent buffers, the optimizer's state and hyper-parameters, the GradScaler's
        state and torch's RNG (Python's and NumPy's too under ``on_fail="rollback"``), bit for bit into the same
        tensors; every ``.grad`` dropped. Weights an update already wrote non-finite need the ``snapshot_every``
        copy (with N>1 the steps since it are undone too). ``updates`` and ``skipped`` go back to what they were
        then, ``stepped`` is False, ``iterations`` still counts the step. An event of kind ``"rollback"`` in
        ``events`` and ``dump_dir/rollbacks.jsonl`` records it, with the changes of policy made before resuming.

        Call it after the ``with guard.step(batch):`` block that saw the detection and before the next one, then
        go on with the next batch (``on_fail="rollback"`` does it at the end of the failing step, with a
        :class:`GuardWarning`). ``change``: a change of policy made before resuming (as :meth:`note_change`).
        Returns the rollback's event; raises :class:`nanhunt.GuardError`, having restored nothing, when it cannot
        (no snapshot holds the state before an update that wrote the weights, or ``max_rollbacks`` reached)."""
        if self._cur is not None:
            raise RuntimeError("guard.rollback() must be called after the `with guard.step(batch):` block that "
                               "saw the detection, not inside it")
        event = self._rollback.rollback(change)
        keep_rng()  # the step's own generators, put back on purpose: nanhunt's hooks around this leave them
        if self.on_fail == "rollback":
            warnings.warn(event.describe(), GuardWarning, stacklevel=2)
        return event

    @property
    def skip_rate(self) -> float:
        """Fraction of skipped steps among the last ``skip_window[0]`` steps."""
        return self._policy.rate

    def close(self) -> None:
        """Remove the guard's hooks from the model and optimizer; safe to call twice."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._watch.close()
        self._capture.snapshot = None
        self._closed = True

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- hooks
    def _compiled_as(self, record: Mapping[str, Any]) -> None:
        """Compiled out of the Guard's sight (a Trainer's ``torch_compile``): recorded, and no headroom hooks."""
        self._capture.set_compiled(record)
        self._watch.off()

    def _on_forward(self, module: nn.Module, args: Any, again: bool = False) -> None:
        cur = self._cur  # again: a framework entered autocast after the model's pre-hooks; its child asks again
        if cur is not None and (again or not cur.forward_seen):
            cur.forward_seen = True
            if torch.is_autocast_enabled(self.device_type):
                cur.autocast = torch.get_autocast_dtype(self.device_type)
            self._rollback.forward(cur)

    def _pre_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Without a GradScaler nothing stops a non-finite update: check before it writes the weights. Not when
        # step() was given a closure (LBFGS, Lightning): it computes the gradients after this hook, and the
        # loop (or the callback) checks them.
        cur = self._cur
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
        if cur is not None and not cur.checked and not self._scaling() and closure is None:
            self.check_grads()
        if cur is not None and cur.tripped and self.on_fail == "rollback" and not cur.held and closure is None:
            # The step is condemned: no update. Dropping the gradients makes the optimizer skip every parameter
            # (a custom one that writes them all the same is noticed after, and rolled back from the snapshot).
            cur.held, cur.versions = True, [tensor_version(p) for p in self._detect.params]
            for p in self._detect.params:
                p.grad = None

    def _post_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        cur = self._cur
        if cur is not None:
            cur.update_ran = True
            if cur.held and cur.versions is not None:
                cur.wrote = cur.wrote or any(tensor_version(p) != v for p, v in zip(self._detect.params, cur.versions))

    # ------------------------------------------------------------ the step
    def _enter(self, batch: Any, index: int | None = None, indices: Any = None) -> Guard:
        if self._cur is not None:
            raise RuntimeError("guard.step() is already active: steps do not nest")
        try:
            host = host_rng() if self.on_fail == "rollback" else None
            return self._open(_Step(self.iterations if index is None else index, batch, rng_state(),
                                    counts=(self.updates, self.skipped), host_rng=host), indices)
        except BaseException:
            # Interrupted (Ctrl-C) before the with-block began: its __exit__ never runs, so the step is
            # closed here, not counted, and the next guard.step() starts afresh.
            self._cur = None
            raise

    def _open(self, cur: _Step, indices: Any = None) -> Guard:
        if self._scaling():
            assert self.scaler is not None
            cur.scaler_unset = self.scaler._scale is None
            # Copied at every entry, whether or not the loop calls check_grads (a gradient-accumulation
            # micro-batch does not): to tell a skipped step at exit and to capture the scale the step ran with.
            cur.scale_before, cur.tracker_before = scaler_entry(self.scaler)
        self._capture.begin(cur, first=self.iterations == 0)
        self._watch.begin(cur.index)
        self._rollback.begin(cur, indices)
        self._cur, self._rollback.plan = cur, None  # a detection can be rolled back only until the next step begins
        return self

    def _exit(self, failed: bool, exc: BaseException | None = None) -> None:
        cur = self._cur
        assert cur is not None
        try:
            if not failed:
                self._check_exit(cur)
            elif isinstance(exc, Exception) and self._detect.world == 1:
                self._check_aborted(cur, exc)
        except BaseException as e:
            failed = failed or not isinstance(e, Exception)  # a Ctrl-C in the checks: the step was aborted
            raise
        finally:
            self._close(cur, failed)
        plan = self._rollback.plan
        if self.on_fail == "rollback" and plan is not None and plan.entry is cur:
            # The step ended normally (a step that raised keeps its detection for guard.rollback()).
            event = self._rollback.roll(plan)
            keep_rng()  # as in rollback()
            warnings.warn(event.describe(), GuardWarning, stacklevel=3)

    def _close(self, cur: _Step, failed: bool) -> None:
        """Count the step and end it. One assignment: interrupted, every counter is as it was or all are
        updated (``_StepContext.__exit__`` ends the step in any case)."""
        self._watch.discard()  # a sampled step that never reached its checks (it raised) keeps nothing
        stepped = cur.updated
        self._rollback.ended(cur, stepped)
        skipped = bool(cur.local_skip) and not failed  # an aborted step attempted nothing
        if not (cur.tripped or failed) and cur.index != self._bad_at:
            self.bad_since = None
        self._cur, self.iterations, self.stepped, self.updates, self.skipped = (
            None, self.iterations + 1, stepped, self.updates + stepped, self.skipped + skipped)

    def _check_exit(self, cur: _Step) -> None:
        scaling = self._scaling()
        scale_now = self.scaler._scale if scaling and self.scaler is not None else None
        before = cur.scale_before
        if before is None and cur.scaler_unset and scale_now is not None and self.scaler is not None:
            before = torch.full((), self.scaler._init_scale, device=scale_now.device)
        skip_flag: torch.Tensor | None = None
        extra: list[torch.Tensor] = []
        if scale_now is not None and not cur.checked:
            if isinstance(before, torch.Tensor):
                # update() backs the scale off exactly when it skipped the step; a step that did not call
                # update() (a gradient-accumulation micro-batch) leaves it as it was.
                skip_flag, extra = scale_now < before.to(scale_now.device), [before]
            elif isinstance(before, float):  # read at entry (on the CPU)
                skip_flag = scale_now < before
                self._note_scale(cur, before)
        need_skip = skip_flag is not None
        need_loss = cur.loss is not None and not cur.checked
        touched = cur.update_ran and not cur.local_skip
        if not (self.check_params or need_skip or need_loss):
            if not cur.watched and not cur.tripped:
                self._headroom(cur, None, None, live=not touched, scaler_before=True, stacklevel=6)
            return
        n_extra = len(extra)
        watched = scalars(extra, cur.loss if need_loss else None, None)
        flags: list[torch.Tensor | None] = [None, None, None, skip_flag]
        if self.check_params and cur.update_ran:  # a skipped update wrote nothing (the read still happens:
            # every rank must join the same collectives whatever its own step did)
            flags[2] = self._detect.params_flag()
        per_rank, values = self._detect.read(flags, extra, loss=cur.loss if need_loss else None)
        if n_extra:
            self._note_scale(cur, values[0])
        any_bits = any_set(per_rank)
        if need_skip:
            cur.local_skip = bool(self._detect.own(per_rank) & SKIP)
        if any_bits & PARAMS:
            self._capture.poison(cur.index + 1)
        kind: str | None = None
        detail = ""
        ranks: tuple[int, ...] = ()
        if cur.tripped:
            pass  # already reported by check_grads in this step (on_fail="dump"/"warn")
        elif any_bits & LOSS:
            kind, detail, ranks = "loss", "non-finite loss", seen(per_rank, LOSS)
        elif any_bits & PARAMS:
            kind, detail, ranks = "params", "non-finite parameters after the update", seen(per_rank, PARAMS)
        if scaling and not cur.policy_done:  # the policy leaves out a micro-batch that only accumulated
            cur.policy_done = True
            reason = self._policy.record(bool(any_bits & SKIP), due=cur.update_ran)
            if reason and kind is None and not cur.tripped:
                kind, detail, ranks = "skips", reason, seen(per_rank, SKIP)
        if kind is not None:
            # After update(): the weights are pre-update unless the optimizer really stepped (else the
            # snapshot); the scaler state is put back to what it was when the step began.
            touched = cur.update_ran and not cur.local_skip
            self._trip(cur, kind, detail, ranks, per_rank, live=not touched, scaler_before=True, stacklevel=5)
        elif not cur.watched and not cur.tripped:
            loss, _ = watched(values[n_extra:])
            self._headroom(cur, loss, None, live=not touched, scaler_before=True, stacklevel=6)

    def _check_aborted(self, cur: _Step, exc: Exception) -> None:
        """A step that raised: a non-finite loss it was handed and did not check is still the detection.

        Recorded (event, capture, warning), never raised: the step's own exception propagates, with the
        event as a note. Only outside torch.distributed: a rank that raised cannot count on the others
        joining a collective."""
        if cur.tripped or cur.checked or cur.loss is None:
            return
        try:
            per_rank, _ = self._detect.read([None, None, None, None], [], loss=cur.loss)
            if not per_rank[0] & LOSS:
                return
            touched = cur.update_ran and not cur.local_skip
            event = self._trip(cur, "loss", "non-finite loss (then the step raised)", seen(per_rank, LOSS),
                               per_rank, live=not touched, scaler_before=True, propagate=False, stacklevel=5)
        except Exception:
            return  # the step's exception is what matters; a device in error may fail any read here
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(event.describe())

    # ------------------------------------------------------------- checks
    def _require(self, what: str) -> _Step:
        if self._cur is None:
            raise RuntimeError(f"guard.{what}() must be called inside `with guard.step(batch):`")
        return self._cur

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _note_scale(self, cur: _Step, scale: float) -> None:
        cur.scale = scale
        if not self.scale_history or self.scale_history[-1][1] != scale:
            self.scale_history.append((cur.index, scale))

    # ------------------------------------------------------------ detection
    @rng_preserved  # a run that goes on after its capture (on_fail "dump", "warn") draws as without nanhunt
    def _trip(self, cur: _Step, kind: str, detail: str, ranks: tuple[int, ...], per_rank: list[int], *,
              live: bool, scaler_before: bool = False, propagate: bool = True, stacklevel: int = 3) -> GuardEvent:
        """Report a detection: capture (this rank's, if it saw it), event, then raise/warn/continue.

        ``live``: the live weights are those the step began with (nothing updated them yet).
        ``propagate=False``: never raise (another exception is propagating)."""
        cur.tripped = True
        self._bad_at = cur.index
        self.bad_since = cur.index if self.bad_since is None else self.bad_since  # one line: one path either way
        began = live  # the live weights are this step's starting weights, its buffers the entry copies
        bad_update = cur.index  # the step whose update the capture should hold the state before
        if live and kind != "params":
            # Were the weights already non-finite when this step began? Then an earlier update is the
            # culprit, not this step. All the model's weights: another optimizer, or an update check_params
            # did not watch, may have written them. Failure path only; every rank is here at the same time,
            # so the all_reduce in the read is safe.
            p_rank, _ = self._detect.read([None, None, self._detect.weights_flag(self._capture.module), None], [])
            if any_set(p_rank) & PARAMS:
                self._capture.poison(cur.index)
                ranks = seen(p_rank, PARAMS)
                # what was measured, not who wrote them: an update, a callback or the user's code may have
                what = nonfinite_weights(self._capture.module, self._detect.params) or (
                    f"on rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}")
                kind, detail, per_rank = ("params", f"{detail}; the weights were already non-finite when the step "
                                          f"began: {what}; nanhunt did not see what wrote them", p_rank)
                live, bad_update = False, (self._capture.poisoned_at or cur.index) - 1
        rank = self._detect.rank
        written = self._capture.capture(cur, seen_here=self._detect.world == 1 or bool(self._detect.own(per_rank)),
                                        live=live, began=began, bad_update=bad_update, scaler_before=scaler_before,
                                        ranks=ranks, group=self._detect._pg)  # FSDP2: every rank writes
        replay_args, replay_notes = self._capture.replay_args() if written.checkpoint is not None else ((), ())
        event = GuardEvent(
            step=cur.index, kind=kind, detail=detail, rank=rank, ranks=ranks if rank is not None else (),
            checkpoint=written.checkpoint, batch=written.batch, captured_step=written.captured_step,
            pre_update=written.pre_update, capture_error=written.error,
            iterations=self.iterations, updates=self.updates, skipped=self.skipped, scale=cur.scale,
            replay_args=replay_args, replay_notes=replay_notes, last_checkpoint=self.last_checkpoint,
        )
        self.events.append(event)
        self._tracker.event(event.step, kind, event.describe())
        self._rollback.plan = Plan(event, cur, bad_update, live)
        if written.checkpoint is not None:
            self._capture.write_event(event, self.scale_history, self._write_failed)
        if self.on_fail == "raise" and propagate:
            raise GuardError(event)
        if self.on_fail == "warn":
            warnings.warn(event.describe(), GuardWarning, stacklevel=stacklevel + 1)  # + rng_preserved's frame
        return event

    # ------------------------------------------------------------- warnings
    def _headroom(self, cur: _Step, loss: float | None, grad_norm: float | None, *, live: bool,
                  scaler_before: bool, stacklevel: int) -> None:
        """The step's numbers, and a sampled step's module maxima, into the headroom history; then its warnings.
        ``live``: nothing updated the weights yet (a capture holds the warned step's own start)."""
        cur.watched = True
        findings = self._watch.observe(cur.index, loss=loss, grad_norm=grad_norm, scale=cur.scale)
        findings += self._watch.end(cur.index, cur.scale)
        for f in findings:
            self._warn(cur, f, live=live, scaler_before=scaler_before, stacklevel=stacklevel + 1)

    @rng_preserved  # its capture, as _trip's
    def _warn(self, cur: _Step, f: Finding, *, live: bool, scaler_before: bool, stacklevel: int) -> None:
        event = GuardEvent(step=cur.index, kind="warning", detail=f.detail, rank=self._detect.rank,
                           condition=f.condition, module=f.module, measured=f.value, limit=f.limit,
                           forecast_step=f.forecast_step, iterations=self.iterations, updates=self.updates,
                           skipped=self.skipped, scale=cur.scale)
        if self.on_warn == "capture" and not self._warn_captured:
            self._warn_captured = True  # the first warning's step: later ones are events only
            # not counted: max_captures stays for the failure the warning may precede
            written = self._capture.capture(cur, seen_here=True, live=live, began=live, bad_update=cur.index,
                                            scaler_before=scaler_before, counted=False)
            if written.checkpoint is not None:
                replay_args, replay_notes = self._capture.replay_args()
                event = dataclasses.replace(event, checkpoint=written.checkpoint, batch=written.batch,
                                            captured_step=written.captured_step, pre_update=written.pre_update,
                                            replay_args=replay_args, replay_notes=replay_notes)
                self._capture.write_event(event, self.scale_history, self._write_failed)
            else:
                event = dataclasses.replace(event, capture_error=written.error)
        self._record(event)
        warnings.warn(event.describe(), HeadroomWarning, stacklevel=stacklevel + 1)  # + rng_preserved's frame
        if self.on_warn == "stop":
            raise GuardError(event)

    def _record(self, event: GuardEvent) -> None:
        """Append ``event`` to ``events`` and to ``dump_dir/rollbacks.jsonl`` (a failed write warns)."""
        self.events.append(event)
        self._tracker.event(event.step, event.kind, event.describe())
        try:
            self._capture.write_log(event)
        except OSError as e:
            self._write_failed("to the rollback log", e)

    def _write_failed(self, what: str, e: OSError) -> None:
        warnings.warn(f"nanhunt.Guard: could not write {what} in {self.dump_dir}: {e}", GuardWarning, stacklevel=3)


def _check_options(model: nn.Module, *, on_fail: str, on_warn: str, max_rollbacks: int,
                   snapshot_every: int | None) -> None:
    """Guard's options that need no part to judge them: refused before anything is made."""
    if on_fail not in ("raise", "dump", "warn", "rollback"):
        raise ValueError(f"on_fail must be 'raise', 'dump', 'warn' or 'rollback', not {on_fail!r}")
    if on_warn not in ("log", "capture", "stop"):
        raise ValueError(f"on_warn must be 'log', 'capture' or 'stop', not {on_warn!r}")
    if max_rollbacks < 0:
        raise ValueError("max_rollbacks must be >= 0")
    refused = _fsdp1.refusal(model, on_fail=on_fail, snapshot_every=snapshot_every)
    if refused is not None:
        raise ValueError(refused)


class _StepContext:
    __slots__ = ("_guard", "_batch", "_index", "_indices")

    def __init__(self, guard: Guard, batch: Any, index: int | None = None, indices: Any = None) -> None:
        self._guard = guard
        self._batch = batch
        self._index = index
        self._indices = indices

    def __enter__(self) -> Guard:
        return self._guard._enter(self._batch, self._index, self._indices)  # the block begins right after

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._guard._exit(failed=exc_type is not None, exc=exc)
        finally:
            # Ended here too: a Ctrl-C inside _exit before its own try/finally, or inside that finally,
            # must not leave a step open (every later guard.step() would raise "steps do not nest").
            self._guard._cur = None
