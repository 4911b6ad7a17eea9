"""The Guard's rollback: back to the state the failing update began with, then the changes made before resuming.

A part the Guard composes (as it does the skip policy and the capture writer): it keeps the last detection
(:class:`Plan`) until the next step begins, puts the state back from the live weights or the capture writer's
snapshot, counts the rollbacks and records them, lists the batches they skipped (``_skip_list``, with the
dataset indices the loop gave ``guard.step``), and notes the changes of policy made before the loop resumes.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ..distributed import _fsdp1
from .._util._errors import GuardError
from .._util._interrupt import atomic
from .._util._text import dtype_name
from ..records import GuardEvent
from ..step.step import set_rng_state
from ._guard_capture import CaptureWriter, StepEntry, _Snapshot, restore_scaler
from ._guard_flags import Detector
from ._skip_list import SkipList

__all__ = ["Plan", "Rollback", "check_indices", "host_rng"]

_KEPT = 1024  # steps whose dataset indices are kept for the skip list, at most


@dataclass
class Plan:
    """What rolling back the last detection means: back to the state step ``target`` began with (the failing
    update's). ``live``: at the detection, the live weights and optimizer state were that state."""

    event: GuardEvent
    entry: StepEntry
    target: int
    live: bool
    # the step's update ran and stands: set when the step ends, before any rollback of it (True until then:
    # a step never ended is rolled back from a snapshot or not at all)
    updated: bool = True


class _Owner(Protocol):
    """What a rollback reads and puts back on its Guard: the counters, and the parts that hold the state."""

    updates: int
    skipped: int
    stepped: bool
    bad_since: int | None
    _bad_at: int | None

    @property
    def iterations(self) -> int: ...
    @property
    def scaler(self) -> torch.amp.GradScaler | None: ...
    @property
    def scale_history(self) -> list[tuple[int, float]]: ...
    @property
    def _capture(self) -> CaptureWriter: ...
    @property
    def _detect(self) -> Detector: ...
    def _scaling(self) -> bool: ...
    def _record(self, event: GuardEvent) -> None: ...
    def _write_failed(self, what: str, e: OSError) -> None: ...


class Rollback:
    """Undo a detection: the weights, persistent buffers, optimizer state, GradScaler state and RNG put back,
    bit for bit and into the same tensors, every ``.grad`` dropped, the counters as they were at that state.

    From the live state when nothing updated the weights yet (the step's own changes undone: the buffers its
    forward wrote, the GradScaler's backoff, the RNG), else from the capture writer's snapshot; without one it
    refuses. No collective: under torch.distributed every rank saw the same detection at the same step (one
    all_reduce) and decides from the same configuration, so all ranks roll back together. Each rollback adds
    the batches it undid to the skip list (``skips``), each rank its own file."""

    def __init__(self, guard: _Owner, max_rollbacks: int) -> None:
        self._guard = guard
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        self.plan: Plan | None = None  # the last step's detection, until the next step begins
        self._changes: list[str] = []  # changes of policy noted, not yet in an event
        self._regions = _fp32_regions(guard._capture.module)  # float32 regions as last looked at
        self._resumed: StepEntry | None = None  # the step rolled back, until the loop resumes (changes looked for)
        self._watch_dtype: StepEntry | None = None  # ... and until the resumed step's forward (its autocast dtype)
        # the dataset indices the loop gave for each step a rollback could undo (from the snapshot's on), as given
        self._indices: dict[int, list[Any]] = {}
        self._kept_from = 0  # the first step whose indices are still kept, once the loop gave some
        self.skips = SkipList(guard._detect.rank)
        self.no_indices = "the loop gave no indices (guard.step(batch, indices=...))"  # a step's, in the skip list

    # ------------------------------------------------------------ the Guard's step
    def begin(self, entry: StepEntry, indices: Any = None) -> None:
        """A step begins, on the batch of dataset ``indices`` (None: not given); the changes made since a
        rollback (or a note) are recorded. The plan is dropped by the Guard in the same assignment that opens
        the step."""
        if self._indices:
            # a rollback undoes at most the steps since the snapshot; while it is stale (the weights were seen
            # non-finite and the run went on) the indices of the last _KEPT steps only
            snap = self._guard._capture.snapshot
            self._kept_from = max(snap.step if snap is not None else entry.index, entry.index - _KEPT + 1)
            for k in [k for k in self._indices if k < self._kept_from]:
                del self._indices[k]
        if indices is not None:  # kept as given: read on a rollback only (a tensor on the device: no sync here)
            self._indices.setdefault(entry.index, []).append(indices)
        if self._resumed is not None or self._changes:
            self._resumed = None
            changes = self._take_changes()
            if changes:
                self._guard._record(self._change_event(entry, changes))

    def forward(self, entry: StepEntry) -> None:
        """The step's forward began (its autocast dtype is known): a dtype other than the rolled-back step's is
        a change."""
        was, self._watch_dtype = self._watch_dtype, None
        if was is not None and was is not entry and was.forward_seen and was.autocast != entry.autocast:
            self._guard._record(self._change_event(entry, (f"autocast dtype {_dtype_name(was.autocast)} -> "
                                                           f"{_dtype_name(entry.autocast)}",)))

    def ended(self, entry: StepEntry, updated: bool) -> None:
        """The step ``entry`` ended; ``updated``: its update ran and stands."""
        plan = self.plan
        if plan is not None and plan.entry is entry:
            plan.updated = updated

    # ------------------------------------------------------------------ API
    def note_change(self, text: str) -> None:
        self._changes.append(" ".join(str(text).split()))

    def rollback(self, change: str | None = None) -> GuardEvent:
        """:meth:`Guard.rollback`, once the Guard made sure no step is open."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("nothing to roll back: the last guard step saw no detection, or was rolled back already")
        if change is not None:
            self.note_change(change)
        return self.roll(plan)

    def roll(self, plan: Plan) -> GuardEvent:
        """Roll back ``plan``'s detection, or record why not and raise :class:`GuardError` (nothing restored)."""
        g, cur = self._guard, plan.entry
        snap = None
        reason: str | None = None
        if g._capture.fsdp1 is not None:
            reason = _fsdp1.NO_ROLLBACK
        elif self.rollbacks >= self.max_rollbacks:
            reason = f"max_rollbacks={self.max_rollbacks} reached (pass a larger max_rollbacks to nanhunt.Guard)"
        else:
            live = plan.live and plan.target == cur.index and not plan.updated
            lost = g._capture.unrestorable_buffers(cur) if live else []
            if not live or lost:
                snap = g._capture.snapshot
                if snap is None or snap.step > plan.target:
                    why = (f"buffer {lost[0]} was first changed by step {cur.index}, which kept no copy of it" if lost
                           else f"the update of step {plan.target} wrote the weights and no snapshot holds them "
                                f"from before it")
                    reason = f"{why}: pass snapshot_every=1 to nanhunt.Guard"
                else:
                    reason = g._capture.snapshot_problem(snap)
        if reason is not None:
            event = dataclasses.replace(plan.event, kind="rollback", rollback_error=reason, rollbacks=self.rollbacks,
                                        iterations=g.iterations, updates=g.updates, skipped=g.skipped)
            g._record(event)
            raise GuardError(event)
        return self._restore(plan, snap)

    # ------------------------------------------------------------ restoring
    @atomic
    def _restore(self, plan: Plan, snap: _Snapshot | None) -> GuardEvent:
        """Put the state back, count, record: runs to its end despite Ctrl-C (a SIGINT waits until all is done)."""
        g, cur = self._guard, plan.entry
        if snap is None:  # the live weights and optimizer state are the target's: the rest is the step's
            g._capture.restore_buffers(cur)
            scale, tracker, unset = cur.scale_before, cur.tracker_before, cur.scaler_unset
            rng, host, counts, restored = cur.rng, cur.host_rng, cur.counts, cur.index
        else:
            g._capture.restore_snapshot(snap)
            saved = snap.scaler or {}
            scale, tracker, unset = saved.get("scale"), saved.get("_growth_tracker"), snap.scaler_unset
            rng, host, counts, restored = snap.rng, snap.host_rng, snap.counts, snap.step
        if g._scaling():
            assert g.scaler is not None
            restore_scaler(g.scaler, scale, tracker, unset)
        for p in (*g._capture.module.parameters(), *g._detect.params):
            p.grad = None
        set_rng_state(rng)
        if host is not None:
            set_rng_state(host)
        scale_now = None if unset or scale is None else float(scale)
        if scale_now is not None and (not g.scale_history or g.scale_history[-1][1] != scale_now):
            g.scale_history.append((g.iterations, scale_now))
        event = dataclasses.replace(
            plan.event, kind="rollback", restored_step=restored, changes=self._take_changes(),
            rollbacks=self.rollbacks + 1, iterations=g.iterations, updates=counts[0], skipped=counts[1],
            scale=scale_now)
        g.updates, g.skipped, g.stepped, self.rollbacks, self.plan = (
            counts[0], counts[1], False, self.rollbacks + 1, None)
        g._capture.poisoned_at = None  # the weights are good again: snapshots resume
        g.bad_since = g._bad_at = None
        self._resumed = self._watch_dtype = cur
        g._record(event)
        try:
            self.skips.add(g._capture.dump_dir, self._skip_entry(plan.event, event))
        except OSError as e:
            g._write_failed("the skip list", e)
        return event

    def _skip_entry(self, detection: GuardEvent, event: GuardEvent) -> dict[str, Any]:
        """The skip list's entry for a rollback: the batches it undid, with their dataset indices if given."""
        restored = event.restored_step if event.restored_step is not None else detection.step
        batches, missing = [], []
        for k in range(restored, detection.step + 1):
            given = self._indices.get(k)
            if given is not None:
                indices, why = _indices(given)
            elif k < self._kept_from:
                indices, why = None, f"not kept: more than {_KEPT} steps back"
            else:
                indices, why = None, self.no_indices
            batches.append({"step": k, "indices": indices})
            if why is not None:
                missing.append(f"step {k}: {why}")
        return {"step": detection.step, "kind": detection.kind, "detail": detection.detail,
                "event": self._event_file(detection), "rollback": event.rollbacks, "restored_step": restored,
                "batches": batches, "indices_note": "; ".join(missing) or None}

    def _event_file(self, detection: GuardEvent) -> str | None:
        """The detection's event file, relative to the dump directory (named as the capture writer names it),
        if it was written (a link planted at its name, which the writer refused, is not it)."""
        ck = detection.checkpoint
        if ck is None:
            return None
        rank = self._guard._detect.rank
        path = os.path.join(ck, f"event-rank{rank}.json") if detection.batch is None \
            else ck[: -len("checkpoint.pt")] + "event.json"
        written = os.path.isfile(path) and not os.path.islink(path)
        return os.path.relpath(path, self._guard._capture.dump_dir) if written else None

    # ------------------------------------------------------------ changes
    def _take_changes(self) -> tuple[str, ...]:
        """The changes noted, and the float32 regions added or removed since last looked at."""
        regions = _fp32_regions(self._guard._capture.module)
        found = [f"float32 region added: {n} (nanhunt.keep_fp32_permanently)"
                 for n in regions if n not in self._regions]
        found += [f"float32 region removed: {n}" for n in self._regions if n not in regions]
        changes = (*self._changes, *found)
        self._changes, self._regions = [], regions
        return changes

    def _change_event(self, entry: StepEntry, changes: tuple[str, ...]) -> GuardEvent:
        g = self._guard
        return GuardEvent(step=entry.index, kind="change", detail="changes of policy before resuming",
                          rank=g._detect.rank, changes=changes, iterations=g.iterations, updates=g.updates,
                          skipped=g.skipped, rollbacks=self.rollbacks)


def _indices(given: list[Any]) -> tuple[list[int] | None, str | None]:
    """The dataset indices of a step's batch (its micro-batches' in turn) as plain ints, or None and why."""
    out: list[int] = []
    try:
        for part in given:
            flat = part.detach().flatten().tolist() if isinstance(part, torch.Tensor) else \
                np.asarray(part).reshape(-1).tolist()
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in flat):
                return None, f"the indices given are not integers ({type(part).__name__})"
            out += flat
    except (TypeError, ValueError, RuntimeError) as e:
        return None, f"the indices given could not be read ({type(e).__name__}: {e})"
    return out, None


def check_indices(indices: Any) -> None:
    """``guard.step(indices=...)``'s type, checked when the step begins (what they hold, only at a rollback)."""
    if indices is not None and (isinstance(indices, (str, bytes)) or
                                not isinstance(indices, (torch.Tensor, np.ndarray, Sequence))):
        raise TypeError("guard.step(indices=...) takes the dataset indices of the batch: a sequence, NumPy array or "
                        f"tensor of ints, not {type(indices).__name__}")


def host_rng() -> dict[str, Any]:
    """Python's and NumPy's global generators (torch's is in every step entry already): kept at every step's
    entry under ``on_fail="rollback"`` only (85 us a step)."""
    return {"python": random.getstate(), "numpy": np.random.get_state()}


def _fp32_regions(model: nn.Module) -> tuple[str, ...]:
    """The submodules ``nanhunt.keep_fp32_permanently`` (or an open ``keep_fp32``) runs in float32 now."""
    return tuple(name for name, m in model.named_modules()
                 if getattr(m.__dict__.get("forward"), "__nanhunt_fp32__", False))


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "float32 (no autocast)" if dtype is None else dtype_name(dtype)
