"""A Guard's event: what it detected, where, and what it did; and the headroom history its capture holds."""

from __future__ import annotations

import enum
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import _serial
from ._serial import JSONData, absent
from ._trace import DTYPE_MAX


@dataclass(frozen=True)
class GuardEvent(JSONData):
    """One detection of :class:`nanhunt.Guard`: what went wrong, at which step, and where the capture is.

    ``step`` is the guard's 0-based iteration index. ``ranks`` are the ranks whose
    check saw it at that step (the first to see it); ``rank`` is this process's
    rank (both empty/None outside ``torch.distributed``). ``captured_step`` is the
    step whose starting state the capture holds: the failing step itself, or an
    earlier last-good snapshot. ``pre_update`` is True when the capture's weights
    are those the failing step started from.

    :meth:`nanhunt.Guard.rollback` appends events of two more kinds. ``"rollback"``: the detection of ``step``
    (its ``detail`` and capture) was undone, back to the state ``restored_step`` began with, ``rollbacks`` so
    far; or, with ``rollback_error``, it could not be. ``"change"``: ``changes`` of policy made before the
    loop resumed at ``step`` (a float32 region, the autocast dtype, a note), an experiment to judge, not a fix.
    ``updates`` and ``skipped`` are then the counters after the rollback.

    Kind ``"warning"``: a finite step whose headroom history warned (``on_warn``), before any non-finite value.
    ``condition`` says what was judged (``"output"``, ``"output gradient"``, ``"scale"``, ``"loss"``,
    ``"gradient norm"``, ``"weights"``, ``"optimizer state"`` or ``"float8 underflow"``), ``module`` the module or
    tensor it is about,
    ``measured`` the largest magnitude (or the loss, norm or scale), ``limit`` the dtype's largest finite value and
    ``forecast_step`` the step where the trend meets it; with ``on_warn="capture"`` the capture holds that step.
    """

    step: int
    kind: str  # "loss", "grads", "params" or "skips"; "rollback" or "change"; "warning"
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
    # what `nanhunt replay` needs besides the two files to work as printed: --model / --loss confirmations of
    # the user's own code, and notes for names no flag confirms (defined in a notebook)
    replay_args: tuple[str, ...] = ()
    replay_notes: tuple[str, ...] = ()
    restored_step: int | None = None  # "rollback": the step whose starting state was restored
    changes: tuple[str, ...] = ()  # "rollback", "change": changes of policy recorded before resuming
    rollbacks: int = 0  # "rollback": rollbacks done so far, this one included
    rollback_error: str | None = None  # "rollback": why it was refused (nothing was restored)
    condition: str | None = None  # "warning": what was judged
    module: str | None = None  # "warning": the module or tensor it is about (None: the step's loss, norm, scale)
    measured: float | None = None  # "warning": the value measured
    limit: float | None = None  # "warning": the dtype's largest finite value
    forecast_step: int | None = None  # "warning": where the trend meets the limit
    last_checkpoint: str | None = None  # the last checkpoint the framework saved before (the callbacks)

    def is_detection(self) -> bool:
        """A non-finite value or too many GradScaler skips was detected (not a rollback, change or warning),
        whether or not its capture could be written."""
        return self.kind in ("loss", "grads", "params", "skips")

    def replay_command(self) -> str | None:
        """``nanhunt replay CKPT BATCH [--model ...] [--loss ...]``, quoted for a POSIX shell; None without a capture.
        A capture directory (FSDP2: ``batch`` is None) is replayed alone: ``nanhunt replay DIR``."""
        if not self.checkpoint:
            return None
        files = (self.checkpoint,) if self.batch is None else (self.checkpoint, self.batch)
        return " ".join(shlex.quote(a) for a in ("nanhunt", "replay", *files, *self.replay_args))

    def describe(self) -> str:
        where = f"step {self.step}"
        if self.rank is not None:
            seen = ", ".join(map(str, self.ranks)) or "none"
            where += f" (rank {self.rank}; seen first by rank(s) {seen})"
        if self.kind == "change":
            return f"nanhunt.Guard: change of policy before {where} (an experiment): {'; '.join(self.changes)}"
        if self.kind == "warning":
            text = f"nanhunt.Guard: warning at {where}: {self.detail}"
            if self.checkpoint:
                text += f"; capture of the warned step (finite): {self.replay_command()}"
            return text
        text = f"nanhunt.Guard: {self.detail} at {where}"
        if self.kind == "rollback":
            if self.rollback_error is not None:
                text += f"; cannot roll back: {self.rollback_error}"
            else:
                first = self.step if self.restored_step is None else self.restored_step
                undone = f"step {first}" if first == self.step else f"steps {first} to {self.step}"
                text += (f"; rolled back (#{self.rollbacks}) to the state step {first} began with, "
                         f"{undone} undone and skipped")
                if self.changes:
                    text += f"; changes before resuming (an experiment): {'; '.join(self.changes)}"
            if self.checkpoint:
                text += f"; capture: {self.replay_command()}"
            return text
        if self.checkpoint:
            what = "the pre-update state"
            if self.captured_step is not None and self.captured_step != self.step:
                what = f"the last good snapshot (start of step {self.captured_step}"
                what += ", before the update that wrote them)" if self.pre_update else f"; re-run to step {self.step})"
            elif not self.pre_update:
                what = "the state with the weights already non-finite (pass snapshot_every=1 for the state before)"
            text += f"; capture of {what}: {self.replay_command()}"
            text += "".join(f" ({n})" for n in self.replay_notes)
        elif self.capture_error:
            text += f"; no capture: {self.capture_error}"
        if self.last_checkpoint:
            text += f"; checkpoints are not saved until a clean step, the last good one: {self.last_checkpoint}"
        return text


@dataclass(frozen=True)
class HeadroomSeries(JSONData):
    """One module's headroom history as a Guard kept it: log2 of the largest magnitude of its ``condition``
    (``"output"`` or ``"output gradient"``, unscaled) at each sampled step of ``steps`` (at most the last 24),
    rounded to 1e-4; ``limit`` the largest finite value of the dtype it ran in (the autocast dtype's). Its robust
    trend: ``growth`` the factor per 100 steps (None: fewer than 6 samples), ``forecast_step`` where it meets
    ``limit`` (None: not rising by 2x over the samples)."""

    module: str = field(metadata=absent(""))
    condition: str = "output"
    limit: float = 65504.0
    steps: tuple[int, ...] = ()
    log2max: tuple[float, ...] = ()
    growth: float | None = None
    forecast_step: int | None = None

    def __post_init__(self) -> None:
        # read from files (a capture's event, a saved report): the renderers draw and divide what they are given
        if len(self.steps) != len(self.log2max) or not self.steps:
            raise ValueError(f"headroom series of {self.module!r}: {len(self.steps)} steps, "
                             f"{len(self.log2max)} values")
        _check_steps(*self.steps)
        if not (all(-1074 <= v < 1024 for v in self.log2max) and 0 < self.limit <= DTYPE_MAX["float64"]):
            raise ValueError(f"headroom series of {self.module!r}: a value or its limit is not a positive finite "
                             f"number")


@dataclass(frozen=True)
class HeadroomNote(JSONData):
    """One warning of a Guard's headroom history (an event of kind ``"warning"``): the ``step`` it was given at,
    its ``condition`` and ``module`` (None: the step's loss, gradient norm or scale) and its ``detail``."""

    step: int = field(metadata=absent(0))
    condition: str = ""
    module: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        _check_steps(self.step)


@dataclass(frozen=True)
class HeadroomTrack(JSONData):
    """One of the step's own numbers over a Guard's headroom history: ``name`` is ``"loss"``, ``"gradient norm"``
    or ``"scale"`` (the GradScaler's); ``values`` its finite values at ``steps``. Every step the Guard saw, or,
    over more than 120 steps, 120 runs of consecutive steps, each as its last step and its largest value (a
    scale's smallest: a spike or a backoff is never thinned away)."""

    name: str = field(metadata=absent(""))
    steps: tuple[int, ...] = ()
    values: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # read from files, as a series is: the chart scales and draws what it is given
        if len(self.steps) != len(self.values) or not self.steps:
            raise ValueError(f"headroom track {self.name!r}: {len(self.steps)} steps, {len(self.values)} values")
        _check_steps(*self.steps)
        if not all(math.isfinite(v) for v in self.values):
            raise ValueError(f"headroom track {self.name!r}: a value is not a finite number")


@dataclass(frozen=True)
class HeadroomHistory(JSONData):
    """What a Guard's capture says of the run before it: the ``series`` of the modules nearest their dtype's
    limit (those warned about first), as the Guard kept them, and the ``warnings`` it gave (the first 20), up to
    ``step``, the step of the capture's event; the ``tracks`` of the loss, the gradient norm and the scale beside
    them (none in a file from before they were kept). Written into the capture's ``-event.json`` (key
    ``headroom``) and carried into the replay's :class:`Report`."""

    step: int = field(metadata=absent(0))
    series: tuple[HeadroomSeries, ...] = ()
    warnings: tuple[HeadroomNote, ...] = ()
    tracks: tuple[HeadroomTrack, ...] = ()

    def __post_init__(self) -> None:
        _check_steps(self.step)



def _check_steps(*steps: int) -> None:
    if not all(0 <= s < 2 ** 63 for s in steps):
        raise ValueError("a headroom history's step is not a non-negative integer")


_serial.prepare(JSONData.__subclasses__())  # every class above, resolved once at import
