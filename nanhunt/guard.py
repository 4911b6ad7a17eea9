"""Training-loop guard: notice the first bad step and leave a capture that ``nanhunt replay`` reproduces."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.hooks import RemovableHandle

from ._dispatch import tensor_version as _version
from ._errors import GuardError
from .capture import callable_path, rng_state, save_capture, unwrap_model

__all__ = ["Guard", "GuardEvent", "GuardWarning"]

OnFail = Literal["raise", "dump", "warn"]

# The four flags of one check, in this order, as bits of a rank's answer. On the device each flag is a
# float scalar that is 0 when fine and non-zero (1 or NaN) otherwise, so one all_reduce(SUM) of a
# (world, 4) matrix tells every rank what every rank saw.
_LOSS, _GRADS, _PARAMS, _SKIP = 1, 2, 4, 8
_N_FLAGS = 4


class GuardWarning(UserWarning):
    """Issued by :class:`Guard` with ``on_fail="warn"``."""


@dataclass(frozen=True)
class GuardEvent:
    """One detection of :class:`Guard`: what went wrong, at which step, and where the capture is.

    ``step`` is the guard's 0-based iteration index. ``ranks`` are the ranks whose
    check saw it at that step (the first to see it); ``rank`` is this process's
    rank (both empty/None outside ``torch.distributed``). ``captured_step`` is the
    step whose starting state the capture holds: the failing step itself, or an
    earlier last-good snapshot. ``pre_update`` is True when the capture's weights
    are those the failing step started from.
    """

    step: int
    kind: str  # "loss", "grads", "params" or "skips"
    detail: str
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    checkpoint: str | None = None
    batch: str | None = None
    captured_step: int | None = None
    pre_update: bool = False
    capture_error: str | None = None
    iterations: int = 0
    updates: int = 0
    skipped: int = 0
    scale: float | None = None

    def describe(self) -> str:
        where = f"step {self.step}"
        if self.rank is not None:
            seen = ", ".join(map(str, self.ranks)) or "none"
            where += f" (rank {self.rank}; seen first by rank(s) {seen})"
        text = f"nanhunt.Guard: {self.detail} at {where}"
        if self.checkpoint and self.batch:
            what = "the pre-update state"
            if self.captured_step is not None and self.captured_step != self.step:
                what = f"the last good snapshot (start of step {self.captured_step}"
                what += ", before the update that wrote them)" if self.pre_update else f"; re-run to step {self.step})"
            elif not self.pre_update:
                what = "the state with the weights already non-finite (pass snapshot_every=1 for the state before)"
            text += f"; capture of {what}: nanhunt replay {self.checkpoint} {self.batch}"
        elif self.capture_error:
            text += f"; no capture: {self.capture_error}"
        return text

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        return d


@dataclass
class _Snapshot:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scaler: dict[str, Any] | None
    batch: Any
    rng: dict[str, Any]


@dataclass
class _Step:
    index: int
    batch: Any
    rng: dict[str, Any]
    # GradScaler state the step began with: tensor copies taken at entry, or the numbers check_grads read
    scale_before: torch.Tensor | float | None = None
    tracker_before: torch.Tensor | int | None = None
    scaler_unset: bool = False  # the scale did not exist yet at entry (created lazily by scaler.scale)
    buffers: dict[int, torch.Tensor] | None = None  # entry copies of the buffers a step changes (Guard._buffers' index)
    loss: torch.Tensor | None = None
    autocast: torch.dtype | None = None
    forward_seen: bool = False
    checked: bool = False
    grads_ok: bool = True
    local_skip: bool | None = None
    policy_done: bool = False
    update_ran: bool = False
    scale: float | None = None
    tripped: bool = False


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
    really ran), ``skipped`` (GradScaler skips), ``stepped`` (the last step
    updated the weights), ``scale_history`` ((step, scale) whenever the scale in
    use changed), ``events``.

    Under ``torch.distributed`` the flags of every rank are summed with one
    ``all_reduce`` per check, so all ranks decide alike and stop at the same step
    (no rank is left waiting in a collective); the event names the rank(s) that
    saw the problem, and those ranks write their captures (every rank with
    ``dump_all_ranks=True``). A skip counts towards the policy when any rank skipped.

    Clean-path cost per step: at entry the RNG state, two scalar copies (the
    GradScaler's scale and growth tracker) and one fused copy of the model's
    buffers into memory kept between steps (none without buffers; BatchNorm's
    running statistics are small); then a few scalar ops and one host read
    in :meth:`check_grads` (without a GradScaler, one fused reduction over the
    gradients), and with ``check_params=True`` one reduction and one host read at
    exit. Nothing reads back per parameter. ``scripts/bench_guard.py`` measures it.

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
            the model returns its loss). Checked here, not at the first failure.
        on_fail: ``"raise"`` (default), ``"dump"`` or ``"warn"``.
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
        max_consecutive_skips: int | None = 10,
        skip_window: tuple[int, float] | None = (1000, 0.05),
        snapshot_every: int | None = None,
        check_params: bool = False,
        max_captures: int = 1,
        dump_all_ranks: bool = False,
        device_type: str | None = None,
        dtype: torch.dtype | None = None,
        process_group: Any = None,
    ) -> None:
        if on_fail not in ("raise", "dump", "warn"):
            raise ValueError(f"on_fail must be 'raise', 'dump' or 'warn', not {on_fail!r}")
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError("max_consecutive_skips must be >= 1 or None")
        if skip_window is not None:
            n, rate = skip_window
            if n < 1 or not 0.0 <= rate < 1.0:
                raise ValueError("skip_window is (window >= 1, max_rate in [0, 1))")
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1 or None")
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.dump_dir = os.fspath(dump_dir)
        self.loss_fn = loss_fn
        self.model_kwargs = dict(model_kwargs or {})
        self.on_fail: OnFail = on_fail
        self.max_consecutive_skips = max_consecutive_skips
        self.skip_window = skip_window
        self.snapshot_every = snapshot_every
        self.check_params = check_params
        self.max_captures = max_captures
        self.dump_all_ranks = dump_all_ranks
        self.dtype = dtype

        self._module = unwrap_model(model)
        # Fail now rather than at the first bad step, when nothing could be saved.
        self.model_factory = model_factory or callable_path(self._module)
        if self.model_factory is None:
            raise ValueError("cannot name the model's class for the capture: "
                             "pass model_factory='package.module:callable'")
        if loss_fn is not None and callable_path(loss_fn) is None:
            raise ValueError("loss_fn must be importable by name (a module-level function or an nn.Module loss)")
        # What an update can change: the optimizer's parameters (frozen weights are never written).
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._params_by_device = _by_device(self._params)
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self.device_type = device_type or self._device.type
        # What a forward can change: the buffers the capture saves (persistent ones), copied at every step's entry.
        saved = self._module.state_dict(keep_vars=True)
        self._buffers: list[tuple[str, torch.Tensor]] = [
            (name, b) for name, b in self._module.named_buffers() if saved.get(name) is b]
        # Only buffers that change are copied at entry after the first step (a causal-mask buffer that
        # never changes costs nothing): normalisation statistics (their kernels write them without
        # bumping the version counter) and any buffer whose version moved since the last entry.
        self._buffer_versions = [_version(b) for _, b in self._buffers]
        self._buffer_moves = [isinstance(self._module.get_submodule(name.rpartition(".")[0]), _NormBase)
                              for name, _ in self._buffers]
        self._buffer_copies: dict[int, torch.Tensor] = {}

        self._pg = process_group
        self._rank: int | None = None
        self._world = 1
        self._comm_device = torch.device("cpu")
        self._zero = torch.zeros((), device=self._device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            import torch.distributed as dist

            self._rank = dist.get_rank(process_group)
            self._world = dist.get_world_size(process_group)
            if self._device.type == "cuda" and "nccl" in str(dist.get_backend(process_group)):
                self._comm_device = self._device

        self.iterations = 0
        self.updates = 0
        self.skipped = 0
        self.stepped = False
        self.scale_history: list[tuple[int, float]] = []
        self.events: list[GuardEvent] = []
        self.captures = 0
        self._consecutive = 0
        self._window: deque[bool] = deque(maxlen=skip_window[0] if skip_window else 1)
        self._snapshot: _Snapshot | None = None
        # First step at whose start the weights were seen non-finite: no snapshot is taken from then on.
        self._poisoned_at: int | None = None
        self._cur: _Step | None = None
        self._closed = False
        self._hooks: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre_update),
            optimizer.register_step_post_hook(self._post_update),
            model.register_forward_pre_hook(self._on_forward),
        ]

    # ------------------------------------------------------------------ API
    def step(self, batch: Any) -> _StepContext:
        """Context manager around one training step on ``batch`` (remembered with the RNG state)."""
        if self._closed:
            raise RuntimeError("this Guard is closed")
        return _StepContext(self, batch)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hand over the step's loss to be checked (no host read here); returns it unchanged."""
        cur = self._require("loss")
        cur.loss = loss.detach()
        return loss

    def check_grads(self) -> bool:
        """Check the loss and gradients; call after ``unscale_``/clipping, before ``scaler.step``.

        With a GradScaler, reuses its ``found_inf`` (calling ``scaler.unscale_``
        if the loop did not); without one, one fused reduction over the
        gradients. One host read in all (plus one ``all_reduce`` when
        distributed). Returns True when every rank's loss and gradients are
        finite: without a GradScaler and with ``on_fail`` other than ``"raise"``,
        skip ``optimizer.step()`` when it returns False. Repeated calls in one step
        return the first answer.
        """
        cur = self._require("check_grads")
        if cur.checked:
            return cur.grads_ok
        cur.checked = True
        scaling = self._scaling()
        if scaling:
            assert self.scaler is not None
            found = self.scaler._found_inf_per_device(self.optimizer)
            if not found:
                self.scaler.unscale_(self.optimizer)
                found = self.scaler._found_inf_per_device(self.optimizer)
            infs = list(found.values())
            grads_flag = infs[0] if len(infs) == 1 else torch.stack([t.to(self._device) for t in infs]).sum()
        else:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            grads_flag = _nonfinite(grads, self._device)
        extra: list[torch.Tensor] = []
        if scaling and self.scaler is not None and self.scaler._scale is not None \
                and self.scaler._growth_tracker is not None:
            extra = [self.scaler._scale, self.scaler._growth_tracker]  # still the state the step began with
        per_rank, values = self._read([self._loss_flag(cur), grads_flag, None, None], extra)
        if values:
            self._note_scale(cur, values[0])
            cur.scale_before, cur.tracker_before = values[0], int(values[1])
        any_bits = _or(per_rank)
        cur.grads_ok = not any_bits & (_LOSS | _GRADS)
        if scaling:
            cur.local_skip = bool(per_rank[self._rank or 0] & _GRADS)
        reason = self._policy(bool(any_bits & _GRADS), cur) if scaling else None
        kind: str | None = None
        detail = ""
        ranks: tuple[int, ...] = ()
        if any_bits & _LOSS:
            kind, detail, ranks = "loss", "non-finite loss", _seen(per_rank, _LOSS)
        elif any_bits & _GRADS and not scaling:
            kind, detail, ranks = "grads", "non-finite gradients", _seen(per_rank, _GRADS)
        elif reason is not None:
            kind, detail, ranks = "skips", reason, _seen(per_rank, _GRADS)
        if kind is not None:
            # Still before scaler.step/optimizer.step: the live state is the pre-update state.
            self._trip(cur, kind, detail, ranks, per_rank, live=True, stacklevel=3)
        return cur.grads_ok

    @property
    def skip_rate(self) -> float:
        """Fraction of skipped steps among the last ``skip_window[0]`` steps."""
        return sum(self._window) / len(self._window) if self._window else 0.0

    def close(self) -> None:
        """Remove the guard's hooks from the model and optimizer; safe to call twice."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._snapshot = None
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

    def _pre_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Without a GradScaler nothing stops a non-finite update: check before it writes the weights.
        cur = self._cur
        if cur is not None and not cur.checked and not self._scaling():
            self.check_grads()

    def _post_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._cur is not None:
            self._cur.update_ran = True

    # ------------------------------------------------------------ the step
    def _enter(self, batch: Any) -> Guard:
        if self._cur is not None:
            raise RuntimeError("guard.step() is already active: steps do not nest")
        try:
            return self._open(_Step(self.iterations, batch, rng_state()))
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
        if self._buffers:
            cur.buffers = self._copy_buffers()
        if self.snapshot_every and cur.index % self.snapshot_every == 0 and self._poisoned_at is None:
            self._refresh_snapshot(cur)
        self._cur = cur
        return self

    def _copy_buffers(self) -> dict[int, torch.Tensor]:
        """Copies of the buffers as this step begins: every one at the first step, then those that
        changed since (a buffer no step has changed is saved live: it still holds its entry value)."""
        first = self.iterations == 0
        want: list[int] = []
        for k, (_, b) in enumerate(self._buffers):
            v = _version(b)
            if v != self._buffer_versions[k]:
                self._buffer_versions[k], self._buffer_moves[k] = v, True
            if first or self._buffer_moves[k]:
                want.append(k)
        old = self._buffer_copies
        copies = {k: old[k] for k in want if k in old and old[k].shape == self._buffers[k][1].shape}
        with torch.no_grad():
            if copies:  # one op, into the copies the last step used
                torch._foreach_copy_(list(copies.values()), [self._buffers[k][1] for k in copies])
            for k in want:
                if k not in copies:
                    copies[k] = self._buffers[k][1].detach().clone()
        self._buffer_copies = copies
        return copies

    def _exit(self, failed: bool, exc: BaseException | None = None) -> None:
        cur = self._cur
        assert cur is not None
        try:
            if not failed:
                self._check_exit(cur)
            elif isinstance(exc, Exception) and self._world == 1:
                self._check_aborted(cur, exc)
        except BaseException as e:
            failed = failed or not isinstance(e, Exception)  # a Ctrl-C in the checks: the step was aborted
            raise
        finally:
            self._close(cur, failed)

    def _close(self, cur: _Step, failed: bool) -> None:
        """Count the step and end it. One assignment: interrupted, every counter is as it was or all are
        updated (``_StepContext.__exit__`` ends the step in any case)."""
        stepped = cur.update_ran and not cur.local_skip
        skipped = bool(cur.local_skip) and not failed  # an aborted step attempted nothing
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
        if not (self.check_params or need_skip or need_loss):
            return
        flags: list[torch.Tensor | None] = [None, None, None, skip_flag]
        if self.check_params and cur.update_ran:  # a skipped update wrote nothing (the read still happens:
            # every rank must join the same collectives whatever its own step did)
            flags[2] = _nonfinite(self._params, self._device, self._params_by_device)
        if need_loss:
            flags[0] = self._loss_flag(cur)
        per_rank, values = self._read(flags, extra)
        if values:
            self._note_scale(cur, values[0])
        any_bits = _or(per_rank)
        if need_skip:
            cur.local_skip = bool(per_rank[self._rank or 0] & _SKIP)
        if any_bits & _PARAMS:
            self._poison(cur.index + 1)
        kind: str | None = None
        detail = ""
        ranks: tuple[int, ...] = ()
        if cur.tripped:
            pass  # already reported by check_grads in this step (on_fail="dump"/"warn")
        elif any_bits & _LOSS:
            kind, detail, ranks = "loss", "non-finite loss", _seen(per_rank, _LOSS)
        elif any_bits & _PARAMS:
            kind, detail, ranks = "params", "non-finite parameters after the update", _seen(per_rank, _PARAMS)
        # Only a step whose optimizer step was due counts towards the skip policy: it ran, or GradScaler
        # skipped it (on any rank). A micro-batch that only accumulated gradients is neither.
        if scaling and not cur.policy_done and (cur.update_ran or any_bits & _SKIP):
            reason = self._policy(bool(any_bits & _SKIP), cur)
            if reason and kind is None and not cur.tripped:
                kind, detail, ranks = "skips", reason, _seen(per_rank, _SKIP)
        if kind is not None:
            # After update(): the weights are pre-update unless the optimizer really stepped (else the
            # snapshot); the scaler state is put back to what it was when the step began.
            touched = cur.update_ran and not cur.local_skip
            self._trip(cur, kind, detail, ranks, per_rank, live=not touched, scaler_before=True, stacklevel=5)

    def _check_aborted(self, cur: _Step, exc: Exception) -> None:
        """A step that raised: a non-finite loss it was handed and did not check is still the detection.

        Recorded (event, capture, warning), never raised: the step's own exception propagates, with the
        event as a note. Only outside torch.distributed: a rank that raised cannot count on the others
        joining a collective."""
        if cur.tripped or cur.checked or cur.loss is None:
            return
        try:
            per_rank, _ = self._read([self._loss_flag(cur), None, None, None], [])
            if not per_rank[0] & _LOSS:
                return
            touched = cur.update_ran and not cur.local_skip
            event = self._trip(cur, "loss", "non-finite loss (then the step raised)", _seen(per_rank, _LOSS),
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

    def _loss_flag(self, cur: _Step) -> torch.Tensor | None:
        if cur.loss is None:
            return None
        # 0 * x is 0 for finite x and NaN for NaN/Inf: one op, no overflow on large finite losses.
        zeroed = cur.loss * 0
        return zeroed if zeroed.dim() == 0 else zeroed.sum(dtype=torch.float32)

    def _read(self, flags: list[torch.Tensor | None], extra: list[torch.Tensor]) -> tuple[list[int], list[float]]:
        """Every rank's flag bits and this rank's extra scalars, in one host read (and one all_reduce)."""
        parts = [self._zero if f is None else f for f in flags] + extra
        dev, f32 = self._device, torch.float32
        # Convert only what needs it: each tensor op costs microseconds, attribute checks don't.
        vec = torch.stack([t if t.dtype is f32 and t.device == dev and t.dim() == 0 else t.reshape(()).to(dev, f32)
                           for t in parts])
        world = self._world
        if world > 1:
            import torch.distributed as dist

            mat = torch.zeros((world, _N_FLAGS), device=self._comm_device)
            mat[self._rank or 0] = vec[:_N_FLAGS].to(self._comm_device)
            dist.all_reduce(mat, group=self._pg)
            values = torch.cat([mat.reshape(-1), vec[_N_FLAGS:].to(self._comm_device)]).tolist()
        else:
            values = vec.tolist()
        n = world * _N_FLAGS
        # NaN != 0 is True: a NaN flag (a NaN that reached the reduction) counts as set.
        per_rank = [sum(1 << i for i in range(_N_FLAGS) if values[r * _N_FLAGS + i] != 0) for r in range(world)]
        return per_rank, [float(v) for v in values[n:]]

    def _note_scale(self, cur: _Step, scale: float) -> None:
        cur.scale = scale
        if not self.scale_history or self.scale_history[-1][1] != scale:
            self.scale_history.append((cur.index, scale))

    def _policy(self, skip: bool, cur: _Step) -> str | None:
        """Record whether this step was skipped (on any rank); the reason to stop, if any."""
        cur.policy_done = True
        self._window.append(skip)
        if not skip:
            self._consecutive = 0
            return None
        self._consecutive += 1
        reason = None
        if self.max_consecutive_skips is not None and self._consecutive >= self.max_consecutive_skips:
            reason = (f"GradScaler skipped {self._consecutive} steps in a row "
                      f"(max_consecutive_skips={self.max_consecutive_skips})")
        elif self.skip_window is not None:
            n, rate = self.skip_window
            k = sum(self._window)
            if k > rate * n:
                reason = f"GradScaler skipped {k} of the last {len(self._window)} steps (more than {rate:.0%} of {n})"
        if reason is not None:
            self._consecutive = 0
            self._window.clear()
        return reason

    # ------------------------------------------------------------- capture
    def _trip(self, cur: _Step, kind: str, detail: str, ranks: tuple[int, ...], per_rank: list[int], *,
              live: bool, scaler_before: bool = False, propagate: bool = True, stacklevel: int = 3) -> GuardEvent:
        """Report a detection: capture (this rank's, if it saw it), event, then raise/warn/continue.

        ``live``: the live weights are those the step began with (nothing updated them yet).
        ``propagate=False``: never raise (another exception is propagating)."""
        cur.tripped = True
        began = live  # the live weights are this step's starting weights, its buffers the entry copies
        bad_update = cur.index  # the step whose update the capture should hold the state before
        if live and kind != "params":
            # Were the weights already non-finite when this step began? Then an earlier update is the
            # culprit, not this step. All the model's weights: another optimizer, or an update check_params
            # did not watch, may have written them. Failure path only; every rank is here at the same time,
            # so the all_reduce in the read is safe.
            p_rank, _ = self._read([None, None, _nonfinite(self._weights(), self._device), None], [])
            if _or(p_rank) & _PARAMS:
                self._poison(cur.index)
                kind, detail, ranks, per_rank = ("params", f"{detail}; the weights were already non-finite when the "
                                                 f"step began (written by an earlier update)",
                                                 _seen(p_rank, _PARAMS), p_rank)
                live, bad_update = False, (self._poisoned_at or cur.index) - 1
        rank = self._rank
        mine = self._world == 1 or bool(per_rank[rank or 0]) or self.dump_all_ranks
        ck = bt = err = None
        captured: int | None = None
        pre_update = False
        if mine and self.captures < self.max_captures:
            snap = None if live else self._snapshot
            try:
                ck, bt = self._paths(cur.index)
                with _both_or_neither(ck, bt) as (ck_tmp, bt_tmp):
                    if snap is not None:
                        self._save_snapshot(snap, cur, ck_tmp, bt_tmp)
                    else:
                        self._save_live(cur, ck_tmp, bt_tmp, scaler_before=scaler_before, began=began)
                captured, pre_update = (snap.step, snap.step == bad_update) if snap is not None else (cur.index, live)
                self.captures += 1
            except Exception as e:  # the detection matters more than the file: report, don't mask
                err, ck, bt = f"{type(e).__name__}: {e}", None, None
        elif mine:
            err = f"max_captures={self.max_captures} already written"
        else:
            err = "another rank saw it; its capture holds the step"
        event = GuardEvent(
            step=cur.index, kind=kind, detail=detail, rank=rank, ranks=ranks if rank is not None else (),
            checkpoint=ck, batch=bt, captured_step=captured, pre_update=pre_update, capture_error=err,
            iterations=self.iterations, updates=self.updates, skipped=self.skipped, scale=cur.scale,
        )
        self.events.append(event)
        if ck is not None:
            self._write_event(event)
        if self.on_fail == "raise" and propagate:
            raise GuardError(event)
        if self.on_fail == "warn":
            warnings.warn(event.describe(), GuardWarning, stacklevel=stacklevel)
        return event

    def _weights(self) -> list[torch.Tensor]:
        """The model's parameters, and any other parameter the optimizer updates."""
        weights = list(self._module.parameters())
        ids = {id(p) for p in weights}
        return weights + [p for p in self._params if id(p) not in ids]

    def _poison(self, step: int) -> None:
        if self._poisoned_at is None:
            self._poisoned_at = step

    def _paths(self, step: int) -> tuple[str, str]:
        os.makedirs(self.dump_dir, exist_ok=True)
        stem = os.path.join(self.dump_dir, f"step{step:06d}" + (f"-rank{self._rank}" if self._rank is not None else ""))
        return stem + "-checkpoint.pt", stem + "-batch.pt"

    def _write_event(self, event: GuardEvent) -> None:
        assert event.checkpoint is not None
        path = event.checkpoint[: -len("checkpoint.pt")] + "event.json"
        data = {**event.to_dict(), "describe": event.describe(), "scale_history": self.scale_history[-50:]}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)

    def _capture_dtype(self, cur: _Step) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        if cur.autocast is not None:
            return cur.autocast
        if cur.forward_seen:
            return torch.float32  # the forward ran without autocast; float32 replays it so
        return torch.float16 if self._scaling() else torch.float32

    def _save_kwargs(self, cur: _Step) -> dict[str, Any]:
        return {
            "loss_fn": self.loss_fn, "model_factory": self.model_factory, "model_kwargs": self.model_kwargs,
            "device_type": self.device_type, "dtype": self._capture_dtype(cur),
        }

    def _save_live(self, cur: _Step, ck: str, bt: str, *, scaler_before: bool, began: bool) -> None:
        scaler = self.scaler if self._scaling() else None
        state = None
        if scaler is not None and scaler_before:
            state = _scaler_state(scaler, cur.scale_before, cur.tracker_before)
        model_state = None
        if began and cur.buffers is not None:
            # The weights are those the step began with; its forward has already written the buffers
            # (BatchNorm running statistics): save the copies taken at entry.
            model_state = self._module.state_dict(keep_vars=True)
            for k, copy in cur.buffers.items():
                name, live = self._buffers[k]
                if model_state.get(name) is live and copy.shape == live.shape:
                    model_state[name] = copy
        save_capture(ck, bt, model=self._module, model_state=model_state, batch=cur.batch, optimizer=self.optimizer,
                     scaler=scaler, scaler_state=state, rng=cur.rng, **self._save_kwargs(cur))

    def _refresh_snapshot(self, cur: _Step) -> None:
        """Copy the state this step begins with to the CPU; keep it only if its weights are finite."""
        scaler = None
        if self._scaling():
            assert self.scaler is not None
            scaler = _scaler_state(self.scaler, cur.scale_before, cur.tracker_before)
        model = {k: v.detach().to("cpu", copy=True) for k, v in self._module.state_dict().items()}
        weights = [model[name] for name, _ in self._module.named_parameters() if name in model]
        # A local read: snapshots are a per-rank matter, no rank waits on another's.
        if weights and float(_nonfinite(weights, torch.device("cpu"))) != 0:
            self._poison(cur.index)  # and keep the last good copy
            return
        self._snapshot = _Snapshot(step=cur.index, model=model, optimizer=_cpu_copy(self.optimizer.state_dict()),
                                   scaler=scaler, batch=cur.batch, rng=cur.rng)

    def _save_snapshot(self, snap: _Snapshot, cur: _Step, ck: str, bt: str) -> None:
        """Write a capture of the snapshot; the live objects only name the classes."""
        save_capture(ck, bt, model=self._module, model_state=snap.model, batch=snap.batch, optimizer=self.optimizer,
                     optimizer_state=snap.optimizer, scaler_state=snap.scaler, rng=snap.rng,
                     **self._save_kwargs(cur))


class _StepContext:
    __slots__ = ("_guard", "_batch")

    def __init__(self, guard: Guard, batch: Any) -> None:
        self._guard = guard
        self._batch = batch

    def __enter__(self) -> Guard:
        return self._guard._enter(self._batch)  # one line: nothing runs between the step's start and the block

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._guard._exit(failed=exc_type is not None, exc=exc)
        finally:
            # Ended here too: a Ctrl-C inside _exit before its own try/finally, or inside that finally,
            # must not leave a step open (every later guard.step() would raise "steps do not nest").
            self._guard._cur = None


# ------------------------------------------------------------------ helpers
@contextmanager
def _both_or_neither(checkpoint: str, batch: str) -> Iterator[tuple[str, str]]:
    """Temporary names for a capture's two files, renamed onto theirs once both are written. On any failure
    (a batch torch.save cannot pickle, a full disk, Ctrl-C) neither file is left, so an event that says
    "no capture" never sits beside an orphan checkpoint, and an older capture under these names stays whole."""
    tmp = (checkpoint + ".partial", batch + ".partial")
    renamed = False
    try:
        for t in tmp:
            with suppress(FileNotFoundError):
                os.remove(t)  # left by a process killed mid-write (or a link: removed, never written through)
        yield tmp
        renamed = True  # set first: a Ctrl-C between the two renames must take the batch file away again
        os.replace(tmp[1], batch)
        os.replace(tmp[0], checkpoint)
    except BaseException:
        for t in (*tmp, batch) if renamed else tmp:
            with suppress(OSError):
                os.remove(t)
        raise


def _nonfinite(tensors: list[torch.Tensor], device: torch.device,
               groups: dict[torch.device, list[torch.Tensor]] | None = None) -> torch.Tensor:
    """A float scalar on ``device``: 0 when every tensor is finite, non-zero otherwise; a fused check
    per device, no host read. On CUDA the max-norm (read-only, one multi-tensor kernel; unlike the
    2-norm it cannot overflow on large finite values, and it propagates NaN). On the CPU,
    ``_foreach_norm`` runs one op per tensor, so use GradScaler's fused check with an inverse scale
    of 1, which leaves every value as it was."""
    flags: list[torch.Tensor] = []
    with torch.no_grad():  # no per-tensor detach(): at this size the Python per tensor is the cost
        for dev, ts in (groups if groups is not None else _by_device(tensors)).items():
            if dev.type == "cpu":
                found = torch.zeros((), device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(ts, found, _one(dev))
            else:
                found = torch.stack(torch._foreach_norm(ts, math.inf, dtype=torch.float32)).amax() * 0
            flags.append(found if dev == device else found.to(device))
    if not flags:
        return torch.zeros((), device=device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum()


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    first = tensors[0].device if tensors else None
    if all(t.device == first and not t.is_sparse for t in tensors):
        return {first: tensors} if first is not None else {}
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t.coalesce()._values() if t.is_sparse else t)
    return out


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), device=device)
    return one


def _or(per_rank: list[int]) -> int:
    out = 0
    for b in per_rank:
        out |= b
    return out


def _seen(per_rank: list[int], mask: int) -> tuple[int, ...]:
    return tuple(r for r, b in enumerate(per_rank) if b & mask)


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return obj


def _scaler_state(scaler: torch.amp.GradScaler, scale: torch.Tensor | float | None,
                  tracker: torch.Tensor | int | None) -> dict[str, Any]:
    """GradScaler.state_dict() as it was when ``scale``/``tracker`` were copied (None: not yet initialised)."""
    sd = scaler.state_dict()
    sd["scale"] = float(scale) if scale is not None else scaler._init_scale
    sd["_growth_tracker"] = int(tracker) if tracker is not None else scaler._init_growth_tracker
    return sd
