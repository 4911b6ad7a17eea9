"""Training-loop guard: notice the first bad step and leave a capture that ``nanhunt replay`` reproduces.

:class:`Guard` runs the step's life (entry, checks, exit, counters) and composes three parts: the detection
flags and their one read across ranks (``_guard_flags.Detector``), the skip policy (``_skip_policy.SkipPolicy``,
plain Python) and the capture writer (``_guard_capture.CaptureWriter``). :class:`GuardEvent` lives in ``records``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, overload

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..distributed import _fsdp1
from .._util._dispatch import local_tensor, tensor_version
from .._util._errors import GuardError
from .._util._text import dtype_name
from ._guard_capture import CaptureWriter, StepEntry, _Snapshot, restore_scaler
from .._util._interrupt import atomic
from ._guard_flags import GRADS, LOSS, PARAMS, SKIP, Detector, any_set, seen
from ._headroom import Finding, Headroom
from ._skip_policy import SkipPolicy
from ..capture.capture import rng_state
from ..records import GuardEvent
from ..step.step import set_rng_state
from .._util._wrappers import user_modules

__all__ = ["Guard", "GuardEvent", "GuardWarning", "HeadroomWarning"]

OnFail = Literal["raise", "dump", "warn", "rollback"]
OnWarn = Literal["log", "capture", "stop"]
_T = TypeVar("_T")


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


@dataclass
class _Plan:
    """What rolling back the last detection means: back to the state step ``target`` began with (the failing
    update's). ``live``: at the detection, the live weights and optimizer state were that state."""

    event: GuardEvent
    entry: _Step
    target: int
    live: bool


class _Part(Generic[_T]):
    """A Guard attribute kept by one of its parts, read and written through (``guard.dump_dir``)."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Part[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _Part[_T] | _T:
        if obj is None:
            return self
        value: _T = getattr(getattr(obj, self.part), self.name)
        return value

    def __set__(self, obj: object, value: _T) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class Guard:
    """Watch a training loop; at the first bad step, write a capture ``nanhunt replay`` reproduces.

    It detects a non-finite loss (hand it over with :meth:`loss`), non-finite
    gradients (:meth:`check_grads`: one fused on-device reduction and one host
    read, the one GradScaler does anyway), a GradScaler step that was skipped,
    and non-finite parameters after the update. With a GradScaler a skipped step
    is normal; ``max_consecutive_skips`` skips in a row, or more than
    ``max_rate`` of the last ``window`` steps skipped (``skip_window``), are not.
    Without a GradScaler, ``optimizer.step()`` checks the gradients itself (a
    step pre-hook) when the loop did not call :meth:`check_grads`.

    Parameters: with ``check_params=True`` every update is followed by a fused
    check of the optimizer's parameters (and a second host read). By default
    weights that an update made non-finite are found by the next step's loss or
    gradient check; the guard then checks the model's weights (on the failure path
    only) and reports the earlier update as the culprit (``kind="params"``).

    On a detection it writes ``step{N}[-rank{R}]-checkpoint.pt`` and
    ``-batch.pt`` (and ``-event.json``) into ``dump_dir``: weights, optimizer,
    GradScaler state, batch and RNG as they were *before* the failing update
    (buffers such as BatchNorm running statistics as the failing step began),
    then raises :class:`nanhunt.GuardError` (a :class:`nanhunt.NonFiniteError`;
    ``on_fail="raise"``), continues silently (``"dump"``) or warns (``"warn"``).
    Detections in :meth:`check_grads` come before ``scaler.step``/``optimizer.step``,
    so the live state is pre-update; a skipped GradScaler step never touched the
    weights. Only an update that itself wrote non-finite weights (no scaler,
    bfloat16) needs an earlier copy: ``snapshot_every=N`` keeps a rolling
    last-good copy on the CPU, taken at the start of every N-th step. Its cost
    is one device-to-host copy of the parameters, buffers and optimizer state
    (3x the parameter bytes with Adam) every N steps, and that much host memory;
    with N=1 the capture is exactly the failing step, with N>1 it is the start of
    the last snapshot step (re-run from there). Without a snapshot such a capture
    holds the poisoned weights and says so (``event.pre_update`` is False).

    Counters: ``iterations`` (guard steps), ``updates`` (optimizer updates that
    really ran and stand), ``skipped`` (GradScaler skips), ``rollbacks``,
    ``stepped`` (the last step updated the weights), ``scale_history`` ((step,
    scale) whenever the scale in use changed), ``events``, ``bad_since`` (the first
    step of the detections in a row, None once a step is clean: the callbacks
    save no checkpoint meanwhile) and ``last_checkpoint`` (set by the callbacks:
    the last checkpoint saved before, named by a detection's event).

    Rollback: after a detection, :meth:`rollback` (or ``on_fail="rollback"``, at
    the end of the failing step, with a :class:`GuardWarning`) puts the model's
    parameters and persistent buffers, the optimizer's state and hyper-parameters,
    the GradScaler's scale and growth tracker and torch's RNG back to the state the
    failing update began with, bit for bit, into the same tensor objects, and drops
    every ``.grad``. The loop then simply goes on with its next batch: the bad one
    is skipped. A detection before the update (a loss or gradient check) needs no
    copy: the live weights are still those, and the guard puts back what the step
    did change (the buffers its forward wrote, the GradScaler's backoff, the RNG).
    Weights an update already wrote non-finite need the ``snapshot_every`` copy
    (with N>1 the steps since it are undone too); without it the rollback refuses.
    A rolled-back step is no update and no skip: ``updates`` and ``skipped`` go back
    to what they were at the restored state, ``stepped`` is False, ``iterations``
    still counts it. Under ``on_fail="rollback"`` the guard also drops the
    gradients before an ``optimizer.step()`` that a detection already condemned
    (so without a GradScaler the update never happens), and keeps Python's and
    NumPy's generators too (85 us a step). Every rollback is an event (kind
    ``"rollback"``, naming the detection and its capture) in ``events`` and in
    ``dump_dir/rollbacks.jsonl``, with the changes of policy made before resuming:
    :meth:`note_change`, ``rollback(change=...)``, and float32 regions
    (``nanhunt.keep_fp32_permanently``) or an autocast dtype that differ when the
    loop resumes, found by the guard (kind ``"change"``). More than
    ``max_rollbacks`` rollbacks in a run raise :class:`nanhunt.GuardError`.

    Under ``torch.distributed`` the flags of every rank are summed with one
    ``all_reduce`` per check, so all ranks decide alike and stop at the same step
    (no rank is left waiting in a collective); the event names the rank(s) that
    saw the problem, and those ranks write their captures (every rank with
    ``dump_all_ranks=True``). Under FSDP2 (DTensor weights) every rank writes its
    part of one capture directory ``step{N}/`` instead (DCP shards, each rank's
    batch, ``manifest.json``; ``nanhunt replay DIR``), nothing gathered onto one rank.
    Under FSDP1 (``FullyShardedDataParallel``) every rank gathers the full state dict and
    optimizer state (collectives on the failure path; the whole model in each rank's host
    memory for a moment) and the ranks that saw it write the ordinary per-rank files;
    ``on_fail="rollback"`` and ``snapshot_every`` are refused there.
    A skip counts towards the policy when any rank skipped.

    Clean-path cost per step: at entry the RNG state, two scalar copies (the
    GradScaler's scale and growth tracker) and one fused copy of the model's
    buffers into memory kept between steps (none without buffers; BatchNorm's
    running statistics are small); then a few scalar ops and one host read
    in :meth:`check_grads` (without a GradScaler, one fused reduction over the
    gradients), and with ``check_params=True`` one reduction and one host read at
    exit. Nothing reads back per parameter. ``scripts/bench_guard.py`` measures it.

    Before the NaN: on one step in ``headroom_every`` (default 16) the guard hooks every module and keeps, on the
    device, the largest magnitude of its output and of its output gradient (a max over its calls); the samples
    are read back once every 64 steps (one host read), with the largest magnitude of every weight and optimizer
    state tensor. The loss, the gradient norm (``check_grads(grad_norm=...)``) and the GradScaler's
    scale come every step from the read :meth:`check_grads` does anyway. A module whose values are within 1024x
    of their dtype's limit (float16 65504; under autocast the autocast dtype's) and whose robust trend meets it
    within ``warn_horizon`` steps (gradients without a GradScaler only: with one, the scale keeps them in
    range), the GradScaler's scale backing off 4 times more than it grew within 200 steps, a loss or
    gradient-norm spike (robust z-score of 8 over the last 100 steps), weights or optimizer state within 16x of
    their limit: each is a
    :class:`HeadroomWarning` once per module and condition, naming what was measured and the usual fixes, and
    an event of kind ``"warning"`` in ``events`` and ``dump_dir/rollbacks.jsonl``. ``on_warn="capture"`` also
    writes a capture of the warned step (the first warning's; it does not count towards ``max_captures``),
    ``"stop"`` raises :class:`nanhunt.GuardError` with that event.

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
        model, optimizer, scaler: what the loop trains with (``scaler`` None or
            disabled: no GradScaler). A DDP or ``torch.compile`` wrapper is unwrapped
            for the capture.
        dump_dir: where captures go (created on the first one).
        loss_fn, model_factory, model_kwargs: how ``nanhunt replay`` rebuilds the
            step. The model must be rebuildable by name: its class (called with
            ``model_kwargs``) or ``model_factory="package.module:callable"``;
            ``loss_fn`` an ``nn.Module`` loss or a module-level function (``None``:
            the model returns its loss). Checked here, not at the first failure; a name
            defined in the training script by running what its replay runs of the script
            (a :class:`GuardWarning` says what that replay would lack).
        on_fail: ``"raise"`` (default), ``"dump"``, ``"warn"`` or ``"rollback"``.
        max_rollbacks: rollbacks allowed in the run; the next one raises instead.
        max_consecutive_skips: trip at this many GradScaler skips in a row (None: never).
        skip_window: ``(window, max_rate)``: trip when more than ``max_rate *
            window`` of the last ``window`` steps were skipped (None: never).
        snapshot_every: keep a CPU copy of the state every N steps (see above).
        check_params: check the parameters after every update (see above).
        max_captures: captures written at most (later detections are events only).
        dump_all_ranks: under torch.distributed, every rank writes its capture,
            not only the ranks that saw the problem.
        device_type, dtype: the autocast configuration recorded in the capture;
            by default the device of the parameters and the autocast dtype in
            effect when the model's forward ran (float32 when autocast was off).
        process_group: the group whose ranks stop together (default: the world).
        headroom_every: sample the modules' headroom on one step in this many (None: no module history; the
            loss, gradient norm and scale are still judged). Off for a ``torch.compile`` model (hooks added and
            removed would recompile it).
        warn_horizon: warn when a module's overflow is forecast at most this many steps ahead.
        on_warn: ``"log"`` (default), ``"capture"`` or ``"stop"`` (see above; under torch.distributed ``"log"``
            only: each rank judges its own history, and a rank that stopped alone would leave the others waiting).

    The batch is kept by reference until the next step: don't modify it in
    place during the step.
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
        headroom_every: int | None = 16,
        warn_horizon: int = 1000,
        on_warn: OnWarn = "log",
    ) -> None:
        if on_fail not in ("raise", "dump", "warn", "rollback"):
            raise ValueError(f"on_fail must be 'raise', 'dump', 'warn' or 'rollback', not {on_fail!r}")
        if on_warn not in ("log", "capture", "stop"):
            raise ValueError(f"on_warn must be 'log', 'capture' or 'stop', not {on_warn!r}")
        if max_rollbacks < 0:
            raise ValueError("max_rollbacks must be >= 0")
        refused = _fsdp1.refusal(model, on_fail=on_fail, snapshot_every=snapshot_every)
        if refused is not None:
            raise ValueError(refused)
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
        compiled = isinstance(getattr(model, "_orig_mod", None), nn.Module)
        self._watch = Headroom(self._capture.module, optimizer, every=None if compiled else headroom_every,
                               horizon=warn_horizon, device_type=self._capture.device_type)
        self._warn_captured = False
        for problem in self._capture.replay_problems:  # the replay command it would print fails: said now
            warnings.warn(f"nanhunt.Guard: {problem}", GuardWarning, stacklevel=2)

        self.iterations = 0
        self.updates = 0
        self.skipped = 0
        self.rollbacks = 0
        self.max_rollbacks = max_rollbacks
        self.stepped = False
        self._plan: _Plan | None = None  # the last step's detection, until the next step begins
        self._changes: list[str] = []  # changes of policy noted, not yet in an event
        self._regions = _fp32_regions(self._capture.module)  # float32 regions as last looked at
        self._resumed: _Step | None = None  # the step rolled back, until the loop resumes (changes are looked for)
        self._watch_dtype: _Step | None = None  # ... and until the resumed step's forward (its autocast dtype)
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
    captures = _Part[int]("_capture")  # captures written so far

    # ------------------------------------------------------------------ API
    def step(self, batch: Any) -> _StepContext:
        """Context manager around one training step on ``batch`` (remembered with the RNG state)."""
        return self._step(batch)

    def _step(self, batch: Any, index: int | None = None) -> _StepContext:
        """``step``, numbered ``index`` (default: ``iterations``): a framework's optimizer step, which its
        micro-batches share (the integrations)."""
        if self._closed:
            raise RuntimeError("this Guard is closed")
        return _StepContext(self, batch, index)

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
                and self.scaler._growth_tracker is not None:
            extra = [self.scaler._scale, self.scaler._growth_tracker]  # still the state the step began with
        n_scaler = len(extra)
        watched = _scalars(extra, cur.loss, grad_norm)  # the headroom history's numbers, in the same read
        per_rank, values = self._detect.read([self._detect.loss_flag(cur.loss), grads_flag, None, None], extra)
        if n_scaler:
            self._note_scale(cur, values[0])
            cur.scale_before, cur.tracker_before = values[0], int(values[1])
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
        self._changes.append(" ".join(str(text).split()))

    def rollback(self, change: str | None = None) -> GuardEvent:
        """Undo the last step's detection: back to the last good pre-update state (see the class docstring).

        Call it after the ``with guard.step(batch):`` block that saw the detection (``on_fail="dump"`` or
        ``"warn"``, or where :class:`nanhunt.GuardError` was caught) and before the next one; then go on with
        the next batch. ``change``: a change of policy made before resuming (as :meth:`note_change`). Returns
        the rollback's event. Raises :class:`nanhunt.GuardError`, having restored nothing, when it cannot: no
        snapshot holds the state before an update that wrote non-finite weights, or ``max_rollbacks`` reached.
        """
        if self._cur is not None:
            raise RuntimeError("guard.rollback() must be called after the `with guard.step(batch):` block that "
                               "saw the detection, not inside it")
        plan = self._plan
        if plan is None:
            raise RuntimeError("nothing to roll back: the last guard step saw no detection, or was rolled back already")
        if change is not None:
            self.note_change(change)
        return self._roll(plan)

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
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        cur = self._cur
        if cur is not None and not cur.forward_seen:
            cur.forward_seen = True
            if torch.is_autocast_enabled(self.device_type):
                cur.autocast = torch.get_autocast_dtype(self.device_type)
            if self._watch_dtype is not None:
                self._dtype_after_rollback(cur)

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
    def _enter(self, batch: Any, index: int | None = None) -> Guard:
        if self._cur is not None:
            raise RuntimeError("guard.step() is already active: steps do not nest")
        try:
            host = _host_rng() if self.on_fail == "rollback" else None
            return self._open(_Step(self.iterations if index is None else index, batch, rng_state(),
                                    counts=(self.updates, self.skipped), host_rng=host))
        except BaseException:
            # Interrupted (Ctrl-C) before the with-block began: its __exit__ never runs, so the step is
            # closed here, not counted, and the next guard.step() starts afresh.
            self._cur = None
            raise

    def _open(self, cur: _Step) -> Guard:
        if self._scaling():
            assert self.scaler is not None
            cur.scaler_unset = self.scaler._scale is None
            # Copied at every entry, whether or not the loop calls check_grads (a gradient-accumulation
            # micro-batch does not): to tell a skipped step at exit and to capture the scale the step ran with.
            if self.scaler._scale is not None and self.scaler._growth_tracker is not None:
                cur.scale_before = self.scaler._scale.detach().clone()
                cur.tracker_before = self.scaler._growth_tracker.detach().clone()
        self._capture.begin(cur, first=self.iterations == 0)
        self._watch.begin(cur.index)
        if self._resumed is not None or self._changes:
            self._changes_at_resume(cur)
        self._cur, self._plan = cur, None  # a detection can be rolled back only until the next step begins
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
        plan = self._plan
        if self.on_fail == "rollback" and plan is not None and plan.entry is cur:
            # The step ended normally (a step that raised keeps its detection for guard.rollback()).
            self._roll(plan)

    def _close(self, cur: _Step, failed: bool) -> None:
        """Count the step and end it. One assignment: interrupted, every counter is as it was or all are
        updated (``_StepContext.__exit__`` ends the step in any case)."""
        self._watch.discard()  # a sampled step that never reached its checks (it raised) keeps nothing
        stepped = cur.updated
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
        need_skip = skip_flag is not None
        need_loss = cur.loss is not None and not cur.checked
        touched = cur.update_ran and not cur.local_skip
        if not (self.check_params or need_skip or need_loss):
            if not cur.watched and not cur.tripped:
                self._headroom(cur, None, None, live=not touched, scaler_before=True, stacklevel=6)
            return
        n_extra = len(extra)
        watched = _scalars(extra, cur.loss if need_loss else None, None)
        flags: list[torch.Tensor | None] = [None, None, None, skip_flag]
        if self.check_params and cur.update_ran:  # a skipped update wrote nothing (the read still happens:
            # every rank must join the same collectives whatever its own step did)
            flags[2] = self._detect.params_flag()
        if need_loss:
            flags[0] = self._detect.loss_flag(cur.loss)
        per_rank, values = self._detect.read(flags, extra)
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
            per_rank, _ = self._detect.read([self._detect.loss_flag(cur.loss), None, None, None], [])
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
                what = _nonfinite_weights(self._capture.module, self._detect.params) or (
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
        self._plan = _Plan(event, cur, bad_update, live)
        if written.checkpoint is not None:
            self._capture.write_event(event, self.scale_history)
        if self.on_fail == "raise" and propagate:
            raise GuardError(event)
        if self.on_fail == "warn":
            warnings.warn(event.describe(), GuardWarning, stacklevel=stacklevel)
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

    def _warn(self, cur: _Step, f: Finding, *, live: bool, scaler_before: bool, stacklevel: int) -> None:
        event = GuardEvent(step=cur.index, kind="warning", detail=f.detail, rank=self._detect.rank,
                           condition=f.condition, module=f.module, measured=f.value, limit=f.limit,
                           forecast_step=f.forecast_step, iterations=self.iterations, updates=self.updates,
                           skipped=self.skipped, scale=cur.scale)
        if self.on_warn == "capture" and not self._warn_captured:
            self._warn_captured = True  # the first warning's step: later ones are events only
            written = self._capture.capture(cur, seen_here=True, live=live, began=live, bad_update=cur.index,
                                            scaler_before=scaler_before)
            if written.checkpoint is not None:
                # not counted: max_captures stays for the failure the warning may precede
                self._capture.captures -= 1
                replay_args, replay_notes = self._capture.replay_args()
                event = dataclasses.replace(event, checkpoint=written.checkpoint, batch=written.batch,
                                            captured_step=written.captured_step, pre_update=written.pre_update,
                                            replay_args=replay_args, replay_notes=replay_notes)
                self._capture.write_event(event, self.scale_history)
            else:
                event = dataclasses.replace(event, capture_error=written.error)
        self._record(event)
        warnings.warn(event.describe(), HeadroomWarning, stacklevel=stacklevel)
        if self.on_warn == "stop":
            raise GuardError(event)

    # ------------------------------------------------------------- rollback
    def _roll(self, plan: _Plan) -> GuardEvent:
        """Roll back ``plan``'s detection, or record why not and raise :class:`GuardError` (nothing restored).

        No collective: under torch.distributed every rank saw the same detection at the same step (one
        all_reduce) and decides from the same configuration, so all ranks roll back together."""
        cur = plan.entry
        snap = None
        reason: str | None = None
        if self._capture.fsdp1 is not None:
            reason = _fsdp1.NO_ROLLBACK
        elif self.rollbacks >= self.max_rollbacks:
            reason = f"max_rollbacks={self.max_rollbacks} reached (pass a larger max_rollbacks to nanhunt.Guard)"
        else:
            live = plan.live and plan.target == cur.index and not cur.updated
            lost = self._capture.unrestorable_buffers(cur) if live else []
            if not live or lost:
                snap = self._capture.snapshot
                if snap is None or snap.step > plan.target:
                    why = (f"buffer {lost[0]} was first changed by step {cur.index}, which kept no copy of it" if lost
                           else f"the update of step {plan.target} wrote the weights and no snapshot holds them "
                                f"from before it")
                    reason = f"{why}: pass snapshot_every=1 to nanhunt.Guard"
                else:
                    reason = self._capture.snapshot_problem(snap)
        if reason is not None:
            event = dataclasses.replace(plan.event, kind="rollback", rollback_error=reason, rollbacks=self.rollbacks,
                                        iterations=self.iterations, updates=self.updates, skipped=self.skipped)
            self._record(event)
            raise GuardError(event)
        event = self._restore(plan, snap)
        if self.on_fail == "rollback":
            warnings.warn(event.describe(), GuardWarning, stacklevel=4)
        return event

    @atomic
    def _restore(self, plan: _Plan, snap: _Snapshot | None) -> GuardEvent:
        """Put the state back, count, record: runs to its end despite Ctrl-C (a SIGINT waits until all is done)."""
        cur = plan.entry
        if snap is None:  # the live weights and optimizer state are the target's: the rest is the step's
            self._capture.restore_buffers(cur)
            scale, tracker, unset = cur.scale_before, cur.tracker_before, cur.scaler_unset
            rng, host, counts, restored = cur.rng, cur.host_rng, cur.counts, cur.index
        else:
            self._capture.restore_snapshot(snap)
            saved = snap.scaler or {}
            scale, tracker, unset = saved.get("scale"), saved.get("_growth_tracker"), snap.scaler_unset
            rng, host, counts, restored = snap.rng, snap.host_rng, snap.counts, snap.step
        if self._scaling():
            assert self.scaler is not None
            restore_scaler(self.scaler, scale, tracker, unset)
        for p in (*self._capture.module.parameters(), *self._detect.params):
            p.grad = None
        set_rng_state(rng)
        if host is not None:
            set_rng_state(host)
        scale_now = None if unset or scale is None else float(scale)
        if scale_now is not None and (not self.scale_history or self.scale_history[-1][1] != scale_now):
            self.scale_history.append((self.iterations, scale_now))
        event = dataclasses.replace(
            plan.event, kind="rollback", restored_step=restored, changes=self._take_changes(),
            rollbacks=self.rollbacks + 1, iterations=self.iterations, updates=counts[0], skipped=counts[1],
            scale=scale_now)
        self.updates, self.skipped, self.stepped, self.rollbacks, self._plan = (
            counts[0], counts[1], False, self.rollbacks + 1, None)
        self._capture.poisoned_at = None  # the weights are good again: snapshots resume
        self.bad_since = self._bad_at = None
        self._resumed = self._watch_dtype = cur
        self._record(event)
        return event

    def _take_changes(self) -> tuple[str, ...]:
        """The changes noted, and the float32 regions added or removed since last looked at."""
        regions = _fp32_regions(self._capture.module)
        found = [f"float32 region added: {n} (nanhunt.keep_fp32_permanently)" for n in regions if n not in self._regions]
        found += [f"float32 region removed: {n}" for n in self._regions if n not in regions]
        changes = (*self._changes, *found)
        self._changes, self._regions = [], regions
        return changes

    def _changes_at_resume(self, cur: _Step) -> None:
        """The first step after a rollback (or after a note): record the changes made before it."""
        self._resumed = None
        changes = self._take_changes()
        if changes:
            self._record(self._change_event(cur, changes))

    def _dtype_after_rollback(self, cur: _Step) -> None:
        was, self._watch_dtype = self._watch_dtype, None
        if was is not None and was is not cur and was.forward_seen and was.autocast != cur.autocast:
            self._record(self._change_event(cur, (f"autocast dtype {_dtype_name(was.autocast)} -> "
                                                  f"{_dtype_name(cur.autocast)}",)))

    def _change_event(self, cur: _Step, changes: tuple[str, ...]) -> GuardEvent:
        rank = self._detect.rank
        return GuardEvent(step=cur.index, kind="change", detail="changes of policy before resuming", rank=rank,
                          changes=changes, iterations=self.iterations, updates=self.updates, skipped=self.skipped,
                          rollbacks=self.rollbacks)

    def _record(self, event: GuardEvent) -> None:
        """Append ``event`` to ``events`` and to ``dump_dir/rollbacks.jsonl`` (a failed write warns)."""
        self.events.append(event)
        try:
            self._capture.write_log(event)
        except OSError as e:
            warnings.warn(f"nanhunt.Guard: could not append to the rollback log in {self.dump_dir}: {e}", GuardWarning,
                          stacklevel=2)


class _StepContext:
    __slots__ = ("_guard", "_batch", "_index")

    def __init__(self, guard: Guard, batch: Any, index: int | None = None) -> None:
        self._guard = guard
        self._batch = batch
        self._index = index

    def __enter__(self) -> Guard:
        return self._guard._enter(self._batch, self._index)  # nothing runs between the step start and the block

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._guard._exit(failed=exc_type is not None, exc=exc)
        finally:
            # Ended here too: a Ctrl-C inside _exit before its own try/finally, or inside that finally,
            # must not leave a step open (every later guard.step() would raise "steps do not nest").
            self._guard._cur = None


def _scalars(extra: list[torch.Tensor], loss: torch.Tensor | None, grad_norm: torch.Tensor | float | None
             ) -> Callable[[list[float]], tuple[float | None, float | None]]:
    """Append the loss and the gradient norm (one-element tensors) to ``extra``, the scalars of a read; returns
    how to find them among the values read after ``extra``'s own."""
    start = len(extra)

    def slot(x: torch.Tensor | None) -> int | None:
        if x is None or x.numel() != 1:
            return None
        extra.append(local_tensor(x.detach()))
        return len(extra) - 1 - start

    at_loss = slot(loss)
    at_norm = slot(grad_norm) if isinstance(grad_norm, torch.Tensor) else None
    fixed = float(grad_norm) if isinstance(grad_norm, (int, float)) else None

    def found(tail: list[float]) -> tuple[float | None, float | None]:
        return (None if at_loss is None else tail[at_loss], fixed if at_norm is None else tail[at_norm])

    return found


def _host_rng() -> dict[str, Any]:
    """Python's and NumPy's global generators (torch's is in every step entry already)."""
    return {"python": random.getstate(), "numpy": np.random.get_state()}


def _fp32_regions(model: nn.Module) -> tuple[str, ...]:
    """The submodules ``nanhunt.keep_fp32_permanently`` (or an open ``keep_fp32``) runs in float32 now."""
    return tuple(name for name, m in model.named_modules()
                 if getattr(m.__dict__.get("forward"), "__nanhunt_fp32__", False))


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "float32 (no autocast)" if dtype is None else dtype_name(dtype)


def _nonfinite_weights(model: nn.Module, params: list[torch.Tensor]) -> str | None:
    """``fc1.weight holds 3 NaN and 1 Inf (of 2048), and 2 other parameters hold NaN/Inf``: the first non-finite
    parameter of this rank (its shard, under FSDP), by the model's names, and how many others; None: none here.
    The failure path only: one host read per parameter."""
    names = {id(p): f"{name}.{pn}" if name else pn
             for name, mod in user_modules(model).items() for pn, p in mod.named_parameters(recurse=False)}
    found: list[tuple[torch.Tensor, int, int]] = []
    done: set[int] = set()
    for p in [*model.parameters(), *params]:
        if id(p) in done or not p.is_floating_point():
            continue
        done.add(id(p))
        t = local_tensor(p.detach())
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            found.append((p, nan, inf))
    if not found:
        return None
    p, nan, inf = found[0]
    counts = " and ".join(f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "Inf")) if n)
    name = names.get(id(p), "a parameter the optimizer updates outside the model")
    more = len(found) - 1
    others = f", and {more} other parameter{'s hold' if more != 1 else ' holds'} NaN/Inf" if more else ""
    return f"{name} holds {counts} (of {local_tensor(p.detach()).numel()}){others}"
