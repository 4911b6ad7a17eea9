"""The Guard's capture writer: what a step began with (buffer copies, a last-good snapshot) and the files
``nanhunt replay`` reads, written whole or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _dispatch
from ._dispatch import keeps_running_stats, tensor_version
from ._guard_flags import nonfinite
from .capture import callable_path, save_capture, unwrap_model
from .records import GuardEvent

__all__ = ["StepEntry", "Written", "EntryBuffers", "CaptureWriter"]


@dataclass
class StepEntry:
    """One guarded step as a capture needs it: where it began and how its forward ran."""

    index: int
    batch: Any
    rng: dict[str, Any]
    # GradScaler state the step began with: tensor copies taken at entry, or the numbers check_grads read
    scale_before: torch.Tensor | float | None = None
    tracker_before: torch.Tensor | int | None = None
    scaler_unset: bool = False  # the scale did not exist yet at entry (created lazily by scaler.scale)
    buffers: dict[int, torch.Tensor] | None = None  # entry copies of the buffers a step changes (EntryBuffers' index)
    autocast: torch.dtype | None = None
    forward_seen: bool = False


class Written(NamedTuple):
    """What :meth:`CaptureWriter.capture` did: the two files, or why there are none."""

    checkpoint: str | None
    batch: str | None
    captured_step: int | None  # the step whose starting state the files hold
    pre_update: bool
    error: str | None


@dataclass
class _Snapshot:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scaler: dict[str, Any] | None
    batch: Any
    rng: dict[str, Any]


class EntryBuffers:
    """Copies of the buffers a capture saves (persistent ones), as each step began: a forward writes them
    (BatchNorm running statistics) before a check can fail."""

    def __init__(self, module: nn.Module) -> None:
        saved = module.state_dict(keep_vars=True)
        self.named: list[tuple[str, torch.Tensor]] = [
            (name, b) for name, b in module.named_buffers() if saved.get(name) is b]
        # Only buffers that change are copied at entry after the first step (a causal-mask buffer that
        # never changes costs nothing): normalisation statistics (their kernels write them without
        # bumping the version counter) and any buffer whose version moved since the last entry.
        self._versions = [tensor_version(b) for _, b in self.named]
        self._moves = [keeps_running_stats(module.get_submodule(name.rpartition(".")[0])) for name, _ in self.named]
        self.copies: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.named)

    def copy(self, first: bool) -> dict[int, torch.Tensor]:
        """Copies of the buffers as this step begins: every one at the ``first`` step, then those that
        changed since (a buffer no step has changed is saved live: it still holds its entry value)."""
        want: list[int] = []
        for k, (_, b) in enumerate(self.named):
            v = tensor_version(b)
            if v != self._versions[k]:
                self._versions[k], self._moves[k] = v, True
            if first or self._moves[k]:
                want.append(k)
        old = self.copies
        copies = {k: old[k] for k in want if k in old and old[k].shape == self.named[k][1].shape}
        with torch.no_grad():
            if copies:  # one op, into the copies the last step used
                _dispatch.foreach_copy(list(copies.values()), [self.named[k][1] for k in copies])
            for k in want:
                if k not in copies:
                    copies[k] = self.named[k][1].detach().clone()
        self.copies = copies
        return copies


class CaptureWriter:
    """Writes ``step{N}[-rank{R}]-checkpoint.pt``, ``-batch.pt`` and ``-event.json`` into ``dump_dir``: the live
    state (with the buffers and scaler state the step began with) or the last-good snapshot, taken every
    ``snapshot_every`` steps until the weights are first seen non-finite (``poisoned_at``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, *,
                 dump_dir: str | os.PathLike[str], loss_fn: Any, model_factory: str | None,
                 model_kwargs: Mapping[str, Any] | None, device_type: str, dtype: torch.dtype | None,
                 snapshot_every: int | None, max_captures: int, dump_all_ranks: bool, rank: int | None) -> None:
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1 or None")
        self.module = unwrap_model(model)
        # Fail now rather than at the first bad step, when nothing could be saved.
        self.model_factory = model_factory or callable_path(self.module)
        if self.model_factory is None:
            raise ValueError("cannot name the model's class for the capture: "
                             "pass model_factory='package.module:callable'")
        if loss_fn is not None and callable_path(loss_fn) is None:
            raise ValueError("loss_fn must be importable by name (a module-level function or an nn.Module loss)")
        self.optimizer, self.scaler = optimizer, scaler
        self.dump_dir = os.fspath(dump_dir)
        self.loss_fn = loss_fn
        self.model_kwargs = dict(model_kwargs or {})
        self.device_type, self.dtype = device_type, dtype
        self.snapshot_every, self.max_captures, self.dump_all_ranks = snapshot_every, max_captures, dump_all_ranks
        self.rank = rank
        self.step_call: str | None = None  # "training_step": the capture replays through it (Lightning)
        self.captures = 0
        self.buffers = EntryBuffers(self.module)
        self.snapshot: _Snapshot | None = None
        # First step at whose start the weights were seen non-finite: no snapshot is taken from then on.
        self.poisoned_at: int | None = None

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    # ------------------------------------------------------------ a step begins
    def begin(self, entry: StepEntry, *, first: bool) -> None:
        """Keep what a capture of this step needs (its scaler state is already in ``entry``)."""
        if self.buffers:
            entry.buffers = self.buffers.copy(first)
        if self.snapshot_every and entry.index % self.snapshot_every == 0 and self.poisoned_at is None:
            self._refresh_snapshot(entry)

    def poison(self, step: int) -> None:
        if self.poisoned_at is None:
            self.poisoned_at = step

    def _refresh_snapshot(self, entry: StepEntry) -> None:
        """Copy the state this step begins with to the CPU; keep it only if its weights are finite."""
        scaler = None
        if self._scaling():
            assert self.scaler is not None
            scaler = _scaler_state(self.scaler, entry.scale_before, entry.tracker_before)
        model = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        weights = [model[name] for name, _ in self.module.named_parameters() if name in model]
        # A local read: snapshots are a per-rank matter, no rank waits on another's.
        if weights and float(nonfinite(weights, torch.device("cpu"))) != 0:
            self.poison(entry.index)  # and keep the last good copy
            return
        self.snapshot = _Snapshot(step=entry.index, model=model, optimizer=_cpu_copy(self.optimizer.state_dict()),
                                  scaler=scaler, batch=entry.batch, rng=entry.rng)

    # --------------------------------------------------------------- the files
    def capture(self, entry: StepEntry, *, seen_here: bool, live: bool, began: bool, bad_update: int,
                scaler_before: bool) -> Written:
        """Write this rank's capture of a detection (if it saw it, or every rank's with ``dump_all_ranks``).

        ``live``: the live weights are those the step began with (nothing updated them yet); else the snapshot,
        if any. ``began``: the live buffers are to be replaced by the entry copies. ``bad_update``: the step
        whose update the capture should hold the state before. ``scaler_before``: save the scaler state the
        step began with. A failure to write is reported in ``error``, never raised (the detection matters more).
        """
        if not (seen_here or self.dump_all_ranks):
            return Written(None, None, None, False, "another rank saw it; its capture holds the step")
        if self.captures >= self.max_captures:
            return Written(None, None, None, False, f"max_captures={self.max_captures} already written")
        snap = None if live else self.snapshot
        try:
            ck, bt = self._paths(entry.index)
            with _both_or_neither(ck, bt) as (ck_tmp, bt_tmp):
                if snap is not None:
                    self._save_snapshot(snap, entry, ck_tmp, bt_tmp)
                else:
                    self._save_live(entry, ck_tmp, bt_tmp, scaler_before=scaler_before, began=began)
            captured, pre_update = (snap.step, snap.step == bad_update) if snap is not None else (entry.index, live)
            self.captures += 1
        except Exception as e:  # the detection matters more than the file: report, don't mask
            return Written(None, None, None, False, f"{type(e).__name__}: {e}")
        return Written(ck, bt, captured, pre_update, None)

    def write_event(self, event: GuardEvent, scale_history: list[tuple[int, float]]) -> None:
        assert event.checkpoint is not None
        path = event.checkpoint[: -len("checkpoint.pt")] + "event.json"
        data = {**event.to_dict(), "describe": event.describe(), "scale_history": scale_history[-50:]}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)

    def _paths(self, step: int) -> tuple[str, str]:
        os.makedirs(self.dump_dir, exist_ok=True)
        stem = os.path.join(self.dump_dir, f"step{step:06d}" + (f"-rank{self.rank}" if self.rank is not None else ""))
        return stem + "-checkpoint.pt", stem + "-batch.pt"

    def _capture_dtype(self, entry: StepEntry) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        if entry.autocast is not None:
            return entry.autocast
        if entry.forward_seen:
            return torch.float32  # the forward ran without autocast; float32 replays it so
        return torch.float16 if self._scaling() else torch.float32

    def _save_kwargs(self, entry: StepEntry) -> dict[str, Any]:
        return {
            "loss_fn": self.loss_fn, "model_factory": self.model_factory, "model_kwargs": self.model_kwargs,
            "device_type": self.device_type, "dtype": self._capture_dtype(entry), "step_call": self.step_call,
        }

    def _save_live(self, entry: StepEntry, ck: str, bt: str, *, scaler_before: bool, began: bool) -> None:
        scaler = self.scaler if self._scaling() else None
        state = None
        if scaler is not None and scaler_before:
            state = _scaler_state(scaler, entry.scale_before, entry.tracker_before)
        model_state = None
        if began and entry.buffers is not None:
            # The weights are those the step began with; its forward has already written the buffers
            # (BatchNorm running statistics): save the copies taken at entry.
            model_state = self.module.state_dict(keep_vars=True)
            for k, copy in entry.buffers.items():
                name, live = self.buffers.named[k]
                if model_state.get(name) is live and copy.shape == live.shape:
                    model_state[name] = copy
        save_capture(ck, bt, model=self.module, model_state=model_state, batch=entry.batch, optimizer=self.optimizer,
                     scaler=scaler, scaler_state=state, rng=entry.rng, **self._save_kwargs(entry))

    def _save_snapshot(self, snap: _Snapshot, entry: StepEntry, ck: str, bt: str) -> None:
        """Write a capture of the snapshot; the live objects only name the classes."""
        save_capture(ck, bt, model=self.module, model_state=snap.model, batch=snap.batch, optimizer=self.optimizer,
                     optimizer_state=snap.optimizer, scaler_state=snap.scaler, rng=snap.rng,
                     **self._save_kwargs(entry))


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
