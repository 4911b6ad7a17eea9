"""Locating origins: once when the trace ends, and while the step runs for ``stop_at_first`` and
``full_stats``, which read back what is pending and look for the first origin among the new records.

While it looks mid-step, the watch keeps the tensors of the ops since its last look, so that the
culprit op's full statistics (NaN, +/-Inf, zeros, ... counts) are measured while they are alive.
It holds no part that calls it: nothing here keeps a finished trace's records alive.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._errors import NonFiniteError
from ._records_store import RecordStore
from ._tensors import floatish, input_shapes
from .locate import LocateResult, locate
from .records import Occurrence
from .stats import full_stats

__all__ = ["OriginWatch", "WINDOW"]

WINDOW = 256  # records between read-backs while the culprit's tensors are kept (trace(full_stats=True))

# An op's tensors kept until the next look: (its new records, args, kwargs, outputs).
Held = tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any], list[torch.Tensor]]


class OriginWatch:
    """Runs :func:`locate` over ``store``'s records. ``keep_tensors``: keep the ops' tensors between
    looks (op level, with ``stop_at_first`` or ``full_stats``); ``stop_at_first``: raise
    :class:`NonFiniteError` inside the op that made the first origin (``stopped`` is it)."""

    __slots__ = ("level", "allow", "stop_at_first", "window", "stopped", "_store")

    def __init__(self, store: RecordStore, *, level: str = "op", allow: tuple[str, ...] = (),
                 stop_at_first: bool = False, keep_tensors: bool = False) -> None:
        self.level = level
        self.allow = allow
        self.stop_at_first = stop_at_first
        self.window: list[Held] | None = [] if keep_tensors else None  # None: no tensors kept
        self.stopped: Occurrence | None = None
        self._store = store

    def hold(self, new: list[int], args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor],
             node: Any) -> None:
        """An op made records ``new`` from ``outs`` (``node``: the backward node it runs in, if any):
        keep its tensors until the next look, and look when due."""
        # Held tensors are not kept across backward ops: a gradient referenced elsewhere makes
        # AccumulateGrad copy it instead of stealing it (more memory, extra ops in the user's step).
        if self.window is not None and (node is None or self.stop_at_first):
            self.window.append((tuple(new), args, kwargs, outs))
            if self.stop_at_first or len(self._store.raws) - self._store.checked >= WINDOW:
                self.check()
        elif self.stop_at_first:
            self.check()

    def check(self) -> None:
        """Read back what is pending (one copy per dtype group) and look for the first origin
        among the new records. Found: measure the culprit op's full statistics while its tensors
        are alive, stop keeping tensors, and with ``stop_at_first`` raise here, inside the op."""
        store = self._store
        raws = store.raws
        store.read_back(store.checked)
        res = locate(raws, level=self.level, classes=store.classes, root_outputs=frozenset(),
                     spans=store.spans, allow=self.allow, start=store.checked, final=False, materialize=store.record,
                     calls=store.calls, not_masks=store.not_masks)
        store.checked = len(raws)
        window = self.window
        if window is not None:
            self.window = []
        occ = res.first
        if occ is None:
            return
        if window is not None:
            self.window = None  # the first origin is found: no more tensors kept, no more reads
            for new, args, kwargs, outs in window:
                if occ.output.index in new:
                    self._measure_culprit(occ.output.index, new, args, kwargs, outs)
                    occ = dataclasses.replace(occ, output=store.record(occ.output.index),
                                              inputs=tuple(store.record(i) for i in occ.output.inputs))
                    break
        if self.stop_at_first:
            self.stopped = occ
            raise NonFiniteError(occ)

    def finish(self, *, sinks_seen: bool) -> LocateResult:
        """The step is over: read everything back and locate over all records (``sinks_seen``: the
        trace saw the step's sinks, the loss and gradients, not a scope only)."""
        store = self._store
        if self.window:
            self.check()  # the last ops' tensors are still held: measure a culprit among them
        self.window = None
        store.read_back()
        store.made.clear()  # phases may have changed since a stop_at_first check made some
        return locate(
            store.raws,
            level=self.level,
            classes=store.classes,
            root_outputs=frozenset(store.root_outputs),
            spans=store.spans,
            allow=self.allow,
            materialize=store.record,
            index_uses=frozenset(store.index_uses),
            calls=store.calls,
            not_masks=store.not_masks,
            sinks_seen=sinks_seen,
        )

    def _measure_culprit(self, idx: int, new: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                         outs: list[torch.Tensor]) -> None:
        """Full statistics of an op's output and inputs (not of inputs it wrote into or that changed
        since: they no longer hold what the op read)."""
        store = self._store
        raw = store.raws[idx]
        out_t = [o for o in outs if floatish(o)]
        pos = new.index(idx)
        if pos < len(out_t):
            raw.full = full_stats(out_t[pos])
        raw.in_shapes = input_shapes(args, kwargs)
        out_ids = {id(o) for o in outs}
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor) and floatish(t)]
        if len(tensors) == len(raw.inputs):
            for i, t in zip(raw.inputs, tensors):
                ent = store.known.get(t)
                if id(t) not in out_ids and ent is not None and ent[0] == i and store.raws[i].full is None:
                    store.raws[i].full = full_stats(t)
                    store.forget(i)
        store.forget(idx)
