"""The Guard's capture writer: what a step began with (buffer copies, a last-good snapshot) and the files
``nanhunt replay`` reads, written whole or not at all."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..distributed import _dcp, _fsdp1
from .._util import _dispatch
from .._util._compiled import record_of, replay_flags
from .._util._dispatch import keeps_running_stats, tensor_version
from .._util._files import append_file, new_files, write_file
from ._guard_flags import nonfinite
from ._headroom import Headroom
from ..capture._names import capture_name, confirmations, is_script, replay_problem, script_run
from .._util._wrappers import user_class, user_modules
from ..capture._construction import how_built
from ..capture._hf import _hf_model_spec
from ..capture._lowp import snapshot_copy
from ..capture.capture import capture_record, nn_spec, resolve, save_capture, unwrap_model
from ..records import GuardEvent

__all__ = ["StepEntry", "Written", "EntryBuffers", "CaptureWriter", "restore_scaler"]


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
    counts: tuple[int, int] = (0, 0)  # the guard's (updates, skipped) as the step began: what a rollback restores
    host_rng: dict[str, Any] | None = None  # Python's and NumPy's generators (kept for on_fail="rollback" only)


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
    counts: tuple[int, int] = (0, 0)
    host_rng: dict[str, Any] | None = None
    scaler_unset: bool = False


class EntryBuffers:
    """Copies of the buffers a capture saves (persistent ones), as each step began: a forward writes them
    (BatchNorm running statistics) before a check can fail."""

    def __init__(self, module: nn.Module, saved: Mapping[str, torch.Tensor] | None = None) -> None:
        # ``saved``: the persistent buffers by name, where calling state_dict() is not safe (FSDP1, ``_fsdp1``)
        saved = module.state_dict(keep_vars=True) if saved is None else saved
        self.named: list[tuple[str, torch.Tensor]] = [
            (name, b) for name, b in module.named_buffers() if saved.get(name) is b]
        # Only buffers that change are copied at entry after the first step (a causal-mask buffer that
        # never changes costs nothing): normalisation statistics (their kernels write them without
        # bumping the version counter) and any buffer whose version moved since the last entry.
        self.versions = [tensor_version(b) for _, b in self.named]  # as the last step began
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
            if v != self.versions[k]:
                self.versions[k], self._moves[k] = v, True
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
    ``snapshot_every`` steps until the weights are first seen non-finite (``poisoned_at``). Under FSDP2, a capture
    directory ``step{N}/`` that every rank writes (``_dcp``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, *,
                 dump_dir: str | os.PathLike[str], loss_fn: Any, model_factory: str | None,
                 model_kwargs: Mapping[str, Any] | None, device_type: str, dtype: torch.dtype | None,
                 snapshot_every: int | None, max_captures: int, dump_all_ranks: bool, rank: int | None) -> None:
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1 or None")
        self.module = unwrap_model(model)
        self.compiled = record_of(model)  # a torch.compile'd model: its backend and settings (its replay's ladder)
        # A DDP model (given wrapped): its capture is a directory every rank writes, each with its own batch, so a
        # replay under torchrun averages the same gradients the step did; None: per-rank files (or FSDP2's
        # directory, judged at each capture: fully_shard may come after the Guard)
        self.ddp = _dcp.ddp_options(model)
        self.group: Any = None  # the process group whose ranks stop together (the Guard's)
        # Fail now rather than at the first bad step, when nothing could be saved.
        self.model_factory = model_factory or capture_name(user_class(self.module))  # FSDP2: your class
        if self.model_factory is None:
            raise ValueError("cannot name the model's class for the capture: "
                             "pass model_factory='package.module:callable'")
        nn_spec(self.module, model_factory, model_kwargs)  # a torch.nn model (Sequential): its layers rebuild it
        # your own class: the arguments it was built with, checked now on the meta device (or why the replay would
        # not rebuild it, said with the other replay problems)
        self.construction = how_built(self.module, model_factory, model_kwargs)
        self.loss_at: tuple[int | str, ...] | None = None  # where the model's output holds its loss (nanhunt run)
        if loss_fn is not None and capture_name(loss_fn) is None:
            raise ValueError("loss_fn must be a named function or an nn.Module loss (not a lambda or a closure)")
        self.optimizer, self.scaler = optimizer, scaler
        # how the training script was started, taken now: its module-level statements read that argv
        self.script_run = script_run([self.model_factory, capture_name(loss_fn), capture_name(optimizer)])
        self.dump_dir = os.fspath(dump_dir)
        self.loss_fn = loss_fn
        self.model_kwargs = dict(model_kwargs or {})
        self.device_type, self.dtype = device_type, dtype
        self.snapshot_every, self.max_captures, self.dump_all_ranks = snapshot_every, max_captures, dump_all_ranks
        self.rank = rank
        self.step_call: str | None = None  # "training_step": the capture replays through it (Lightning)
        self.captures = 0
        self.warning_captures = 0
        self.fsdp1 = _fsdp1.top(model)  # FSDP1: the module its full state dict is gathered from (else None)
        self.buffers = EntryBuffers(self.module, None if self.fsdp1 is None else _fsdp1.persistent_buffers(self.module))
        self.snapshot: _Snapshot | None = None
        # First step at whose start the weights were seen non-finite: no snapshot is taken from then on.
        self.poisoned_at: int | None = None
        # Judged here, not on the failure path: a step's exit runs the same code at every detection.
        self._confirm = self._confirmations()
        self.headroom: Headroom | None = None  # the Guard's headroom history: its picture goes into each event file

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def replay_args(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The ``--model`` / ``--loss`` / ``--optimizer`` confirmations the printed replay command needs to work as
        printed (run from this directory), and notes for names no flag confirms."""
        return self._confirm

    def set_loss_fn(self, loss_fn: Any) -> None:
        """The loss function learnt after the Guard was made (``nanhunt run`` sees it in the first step)."""
        if capture_name(loss_fn) is None:
            raise ValueError("loss_fn must be a named function or an nn.Module loss (not a lambda or a closure)")
        self.loss_fn = loss_fn
        if self.script_run is None:  # the script's own loss: its captures record how the script was started
            self.script_run = script_run([self.model_factory, capture_name(loss_fn), capture_name(self.optimizer)])
        self._confirm = self._confirmations()

    def set_loss_at(self, at: tuple[int | str, ...]) -> None:
        """The model's loss is this element of its output (``nanhunt run`` sees the backward run from it)."""
        self.loss_at = tuple(at)

    def set_compiled(self, record: Mapping[str, Any]) -> None:
        """How the model is compiled, when it is compiled out of the Guard's sight (a transformers Trainer's
        ``torch_compile``, inside accelerate): its captures record it, and the printed command confirms it."""
        self.compiled = dict(record)
        self._confirm = self._confirmations()

    def _confirmations(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        named: list[tuple[str, str | None, Any]] = []
        cls = user_class(self.module)
        own = capture_name(cls)
        if not (self.model_factory == own and _hf_model_spec(self.module) is not None):
            factory: Any = cls
            if self.model_factory is not None and self.model_factory != own:
                try:  # a script's name is confirmed anyway, and loading it would run the script's statements now
                    factory = None if is_script(self.model_factory) else resolve(
                        self.model_factory, what="model factory", trusted=True)
                except Exception:
                    factory = None  # judged unrecognised: the command confirms it
            named.append(("model factory", self.model_factory, factory))
        if self.loss_fn is not None:
            named.append(("loss function", capture_name(self.loss_fn), self.loss_fn))
        if self.optimizer is not None:
            named.append(("optimizer class", capture_name(self.optimizer), self.optimizer))
        # a script's name: what its confirmed replay runs of the script, read now (none of it runs), so that a
        # command that would lack a name is said when the Guard is made (GuardWarning) and in the event
        self.replay_problems = tuple(p for what, name, _ in named if name is not None and is_script(name)
                                     for p in [replay_problem(name, what)] if p is not None)
        if self.construction.problem is not None:
            self.replay_problems += (self.construction.problem,)
        args, notes = confirmations(named)
        if self.compiled is not None:  # a backend of yours, settings that name programs: the replay confirms them
            args += replay_flags(self.compiled)
        return tuple(args), (*notes, *self.replay_problems)

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
        model = {k: snapshot_copy(v) for k, v in self.module.state_dict().items()}  # an NF4 weight: itself
        weights = [model[name] for name, _ in self.module.named_parameters() if name in model]
        if _dcp.sharded(self.module):
            # FSDP2: each rank holds shards of one snapshot, written together into one capture directory, so
            # the ranks agree whether it is good (an all_reduce per mesh dimension; every rank begins this step)
            bad = nonfinite([_dispatch.local_tensor(w) for w in weights], torch.device("cpu"))
            if _dcp.any_rank(bool(bad), self.module):
                self.poison(entry.index)
                return
        elif self.ddp is not None:
            # DDP: one capture directory of every rank; the replicas agree (one all_reduce, every rank begins it)
            if _dcp.agree_any(bool(weights) and float(nonfinite(weights, torch.device("cpu"))) != 0, self.group):
                self.poison(entry.index)
                return
        # A local read: snapshots are a per-rank matter, no rank waits on another's.
        elif weights and float(nonfinite(weights, torch.device("cpu"))) != 0:
            self.poison(entry.index)  # and keep the last good copy
            return
        self.snapshot = _Snapshot(step=entry.index, model=model, optimizer=_cpu_copy(self.optimizer.state_dict()),
                                  scaler=scaler, batch=entry.batch, rng=entry.rng, counts=entry.counts,
                                  host_rng=entry.host_rng, scaler_unset=entry.scaler_unset)

    # --------------------------------------------------------------- the files
    def capture(self, entry: StepEntry, *, seen_here: bool, live: bool, began: bool, bad_update: int,
                scaler_before: bool, ranks: tuple[int, ...] = (), group: Any = None,
                counted: bool = True) -> Written:
        """Write this rank's capture of a detection (if it saw it, or every rank's with ``dump_all_ranks``).
        ``counted=False``: a warning's capture (single process), neither limited by ``max_captures`` nor
        counted in ``captures`` but in ``warning_captures``.

        ``live``: the live weights are those the step began with (nothing updated them yet); else the snapshot,
        if any. ``began``: the live buffers are to be replaced by the entry copies. ``bad_update``: the step
        whose update the capture should hold the state before. ``scaler_before``: save the scaler state the
        step began with. A failure to write is reported in ``error``, never raised (the detection matters more).
        ``ranks`` saw the failure first; ``group``: the process group whose ranks stop together.
        """
        # ---- FSDP2 (DTensor weights) or DDP: one capture directory that every rank of ``group`` writes (_dcp.py)
        if self.ddp is not None or _dcp.sharded(self.module):
            return self._capture_dir(entry, live=live, began=began, bad_update=bad_update, scaler_before=scaler_before,
                                     ranks=ranks, group=group)
        # ----
        if self.fsdp1 is not None:  # FSDP1: every rank gathers the full state, the ranks that saw it save it
            return self._capture_fsdp1(entry, live=live, began=began, scaler_before=scaler_before,
                                       writes=self.dump_all_ranks or (self.rank in ranks if ranks else seen_here))
        if not (seen_here or self.dump_all_ranks):
            return Written(None, None, None, False, "another rank saw it; its capture holds the step")
        if counted and self.captures >= self.max_captures:
            return Written(None, None, None, False, f"max_captures={self.max_captures} already written")
        snap = None if live else self.snapshot
        try:
            ck, bt = self._paths(entry.index)
            if snap is not None:  # both files or neither (save_capture)
                self._save_snapshot(snap, entry, ck, bt)
            else:
                self._save_live(entry, ck, bt, scaler_before=scaler_before, began=began)
            captured, pre_update = (snap.step, snap.step == bad_update) if snap is not None else (entry.index, live)
            if counted:
                self.captures += 1
            else:
                self.warning_captures += 1
        except Exception as e:  # the detection matters more than the file: report, don't mask
            return Written(None, None, None, False, f"{type(e).__name__}: {e}")
        return Written(ck, bt, captured, pre_update, None)

    def _capture_fsdp1(self, entry: StepEntry, *, live: bool, began: bool, scaler_before: bool,
                       writes: bool) -> Written:
        """FSDP1: the ordinary per-rank files of the full state dict and unflattened optimizer state (``_fsdp1``),
        written by the ranks that saw the failure (the event's ``ranks``: a rank whose gradients were only reduced
        from theirs replays clean). The gather is a collective every rank joins, whether or not it writes, so
        every rank counts it towards ``max_captures`` alike; all ranks decide from the same numbers. No snapshot
        (refused under FSDP1): weights an update wrote non-finite are saved as they are (``pre_update`` False)."""
        if self.captures >= self.max_captures:
            return Written(None, None, None, False, f"max_captures={self.max_captures} already written")
        self.captures += 1
        try:
            model_sd, optim_sd = _fsdp1.full_state(self.fsdp1 or self.module, self.optimizer)
        except Exception as e:  # raised alike on every rank (the same model and optimizer), before or after its gathers
            return Written(None, None, None, False, f"FSDP1 full state dict: {type(e).__name__}: {e}")
        if not writes:
            return Written(None, None, None, False, "another rank saw it; its capture holds the step")
        try:
            if began:  # the buffers as the step began (its forward wrote them): the entry copies
                for k, c in (entry.buffers or {}).items():
                    name = _fsdp1.user_name(self.buffers.named[k][0])
                    if name in model_sd and c.shape == model_sd[name].shape:
                        model_sd[name] = c
            optimizer, names = _dcp.optimizer_by_index(optim_sd, "the FSDP1 optimizer state")
            scaler = self.scaler if self._scaling() else None
            scaler_state = (_scaler_state(scaler, entry.scale_before, entry.tracker_before)
                            if scaler is not None and scaler_before else None)
            ckpt, bfile = capture_record(model=self.module, model_state=model_sd, optimizer=self.optimizer,
                                         optimizer_state=optimizer, batch=entry.batch, scaler=scaler,
                                         scaler_state=scaler_state, rng=entry.rng, **self._save_kwargs(entry))
            ckpt["optimizer_params"] = names  # by the user's names: the live groups hold flat parameters
            ckpt["module_training"] = {n: m.training for n, m in user_modules(self.module).items()}
            ck, bt = self._paths(entry.index)
            with new_files(ck, bt) as (ck_file, bt_file):  # both or neither
                torch.save(ckpt, ck_file)
                torch.save(bfile, bt_file)
        except Exception as e:  # the detection matters more than the file: report, don't mask
            return Written(None, None, None, False, f"{type(e).__name__}: {e}")
        return Written(ck, bt, entry.index, live, None)

    def _capture_dir(self, entry: StepEntry, *, live: bool, began: bool, bad_update: int, scaler_before: bool,
                     ranks: tuple[int, ...], group: Any) -> Written:
        """``step{N}/``: DCP shards of the live state (or, when ``live`` is False, of the last good snapshot:
        each rank's shards of it), each rank's batch, a manifest (``_dcp``). Every rank takes part, whether or
        not it saw the failure: DCP's save is a collective; the ranks agreed on the snapshot when it was taken.
        Under DDP the state is the same on every rank: DCP writes each tensor once."""
        if self.captures >= self.max_captures:  # every rank counts alike: all of them write every capture
            return Written(None, None, None, False, f"max_captures={self.max_captures} already written")
        state: Any
        fields: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        snap = None if live else self.snapshot
        try:
            scaler = self.scaler if self._scaling() else None
            scaler_state = None
            if snap is not None:  # the state (weights, optimizer, scaler) and batch of the step it began
                fields, batch = capture_record(model=self.module, model_state={}, optimizer=self.optimizer,
                                               optimizer_state={}, batch=snap.batch, scaler_state=snap.scaler,
                                               rng=snap.rng, **self._save_kwargs(entry))
                fields.update(captured_step=snap.step, pre_update=snap.step == bad_update)
                state = {"model": snap.model,
                         "optimizer": _dcp.optimizer_by_name(snap.optimizer or {}, self.module, self.optimizer)}
            else:
                if scaler is not None and scaler_before:
                    scaler_state = _scaler_state(scaler, entry.scale_before, entry.tracker_before)
                fields, batch = capture_record(model=self.module, model_state={}, optimizer=self.optimizer,
                                               optimizer_state={}, batch=entry.batch, scaler=scaler,
                                               scaler_state=scaler_state, rng=entry.rng, **self._save_kwargs(entry))
                buffers = {self.buffers.named[k][0]: c for k, c in (entry.buffers or {}).items()} if began else {}
                state = _dcp.sharded_state(self.module, self.optimizer, buffers)
        except Exception as e:  # said to the other ranks, which then write nothing either
            state = e
        for k in ("nanhunt_capture", "model", "optimizer", "optimizer_params", "nf4_parts"):
            fields.pop(k, None)  # the tensors and the parameter names are in the shards
        if self.ddp is not None:
            fields["ddp"] = self.ddp
        path = os.path.join(self.dump_dir, f"step{entry.index:06d}")
        error = _dcp.write_capture_dir(path, state=state, fields=fields, batch=batch, ranks_seen=ranks,
                                       step=entry.index, wrapper="fsdp2" if self.ddp is None else "ddp", group=group)
        self.captures += 1
        if error is not None:
            return Written(None, None, None, False, error)
        if snap is not None:
            return Written(path, None, snap.step, snap.step == bad_update, None)
        return Written(path, None, entry.index, live, None)

    def write_event(self, event: GuardEvent, scale_history: list[tuple[int, float]],
                    failed: Callable[[str, OSError], None]) -> None:
        """The event file beside its capture, written new and renamed in; one that cannot be written (a link or a
        FIFO at its name, a full disk) is ``failed(what, error)`` (the Guard warns): the training goes on."""
        assert event.checkpoint is not None
        path = (os.path.join(event.checkpoint, f"event-rank{self.rank}.json") if event.batch is None  # a directory
                else event.checkpoint[: -len("checkpoint.pt")] + "event.json")
        data = {**event.to_dict(), "describe": event.describe(), "scale_history": scale_history[-50:]}
        if self.headroom is not None:
            data["headroom"] = self.headroom.picture(event.step)
        try:
            write_file(path, json.dumps(data, indent=2))
        except OSError as e:
            failed("the event file", e)

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
            "script_run": self.script_run, "compiled": self.compiled, "construction": self.construction,
            "loss_at": self.loss_at,
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

    # --------------------------------------------------------------- rollback
    def unrestorable_buffers(self, entry: StepEntry) -> list[str]:
        """Buffers the step wrote that have no entry copy (their first change in this guard's life): the live
        state cannot give them back, only a snapshot can."""
        copies = entry.buffers or {}
        versions = self.buffers.versions
        return [name for k, (name, b) in enumerate(self.buffers.named)
                if k not in copies and tensor_version(b) != versions[k]]

    def restore_buffers(self, entry: StepEntry) -> None:
        """Write the entry copies back into the buffers the step's forward changed (BatchNorm statistics)."""
        pairs = [(self.buffers.named[k][1], c) for k, c in (entry.buffers or {}).items()
                 if c.shape == self.buffers.named[k][1].shape]
        if pairs:
            with torch.no_grad():
                _dispatch.foreach_copy([live for live, _ in pairs], [c for _, c in pairs])

    def snapshot_problem(self, snap: _Snapshot) -> str | None:
        """Why ``snap`` cannot be written back into the live model and optimizer (None: it can)."""
        live = self.module.state_dict(keep_vars=True)
        if live.keys() != snap.model.keys():
            return "the model's state_dict keys changed since the snapshot"
        moved = [k for k, v in live.items() if v.shape != snap.model[k].shape or v.dtype != snap.model[k].dtype]
        if moved:
            return f"{moved[0]} changed shape or dtype since the snapshot"
        ids = {id(t) for t in live.values()}
        outside = sum(id(p) not in ids for g in self.optimizer.param_groups for p in g["params"])
        if outside:
            return f"the optimizer updates {outside} tensor(s) outside the model, which the snapshot does not hold"
        groups = (snap.optimizer or {}).get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optimizer.param_groups]:
            return "the optimizer's parameter groups changed since the snapshot"
        return None

    def restore_snapshot(self, snap: _Snapshot) -> None:
        """The model's parameters and buffers and the optimizer's state and hyper-parameters as ``snap`` holds
        them, written into the live tensors: the optimizer and the user keep their references."""
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                t.copy_(snap.model[name])
        assert snap.optimizer is not None
        _restore_optimizer(self.optimizer, snap.optimizer)

    def write_log(self, event: GuardEvent) -> str:
        """Append ``event`` to ``dump_dir/rollbacks[-rank{R}].jsonl``, one JSON object a line; returns the path.
        Raises OSError when it cannot (a link or a FIFO at its name is refused: ``_files.append_file``)."""
        os.makedirs(self.dump_dir, exist_ok=True)
        name = "rollbacks" + (f"-rank{self.rank}" if self.rank is not None else "") + ".jsonl"
        path = os.path.join(self.dump_dir, name)
        line = json.dumps({**event.to_dict(), "describe": event.describe()})
        append_file(path, (line + "\n").encode("utf-8"))
        return path


def restore_scaler(scaler: torch.amp.GradScaler, scale: torch.Tensor | float | None,
                   tracker: torch.Tensor | int | None, unset: bool) -> None:
    """The GradScaler as a step began: its scale and growth tracker written into its own tensors (or not yet
    created again, ``unset``), and no optimizer marked as unscaled or stepped, as ``update()`` leaves it."""
    if unset:
        scaler._scale, scaler._growth_tracker = None, None
    elif scale is not None and tracker is not None and scaler._scale is not None \
            and scaler._growth_tracker is not None:
        for live, value in ((scaler._scale, scale), (scaler._growth_tracker, tracker)):
            if isinstance(value, torch.Tensor):
                live.copy_(value)
            else:
                live.fill_(value)
    scaler._per_optimizer_states.clear()  # a defaultdict: each optimizer starts afresh at its next unscale_


def _restore_optimizer(opt: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """``opt.load_state_dict(saved)`` in place: state tensors copied into the live ones, keys and groups as saved."""
    params: dict[int, Any] = {}
    for g, sg in zip(opt.param_groups, saved["param_groups"]):
        params.update(zip(sg["params"], g["params"]))
    states = saved["state"]
    with torch.no_grad():
        for idx, p in params.items():
            want = states.get(idx)
            if want is None:
                opt.state.pop(p, None)  # no state yet at the snapshot: the optimizer creates it afresh
                continue
            cur = opt.state.get(p)
            if cur is None:
                cur = opt.state[p] = {}
            for k in [k for k in cur if k not in want]:
                del cur[k]
            for k, v in want.items():
                old = cur.get(k)
                if isinstance(v, torch.Tensor):
                    if isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                        old.copy_(v)
                    else:  # Adam's "step" stays on the CPU, as the optimizer keeps it
                        cur[k] = v.clone() if k == "step" else v.to(p.device, copy=True)
                else:
                    cur[k] = copy.deepcopy(v)
        for g, sg in zip(opt.param_groups, saved["param_groups"]):
            for k in [k for k in g if k != "params" and k not in sg]:
                del g[k]
            for k, v in sg.items():
                old = g.get(k)
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape:
                    old.copy_(v)
                else:
                    g[k] = copy.deepcopy(v)


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
