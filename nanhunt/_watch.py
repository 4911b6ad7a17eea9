"""Locating origins: once when the trace ends, and while the step runs for ``stop_at_first`` and
``full_stats``, which read back what is pending and look for the first origin among the new records.

While it looks mid-step, the watch keeps the tensors of the ops since its last look, so that the
culprit op's full statistics (NaN, +/-Inf, zeros, ... counts) are measured while they are alive.
It holds no part that calls it: nothing here keeps a finished trace's records alive.

A stop (``stop_at_first``) leaves its op's tensors in ``nanhunt.last`` and on the error; :func:`land`
cuts the error's traceback after the user's frame, where a debugger's post-mortem starts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import FrameType
from typing import Any

import torch

import nanhunt

from ._errors import NonFiniteError, Stop
from ._records_store import RecordStore
from ._tensors import floatish, input_shapes, tensors
from .locate import LocateResult, locate
from .records import Occurrence
from .stats import full_stats

__all__ = ["OriginWatch", "WINDOW", "land"]

WINDOW = 256  # records between read-backs while the culprit's tensors are kept (trace(full_stats=True))

# An op's tensors kept until the next look: (its new records, args, kwargs, outputs).
Held = tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any], list[torch.Tensor]]

# Frames that are not the user's: a debugger's post-mortem starts below them (as _ops' source lines skip them).
_NOT_USER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep,
             os.path.dirname(os.__file__) + os.sep + "contextlib.py", "<frozen")


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

    def check(self, held: tuple[Any, Any] | None = None) -> None:
        """Read back what is pending (one copy per dtype group) and look for the first origin
        among the new records. Found: measure the culprit op's full statistics while its tensors
        are alive, stop keeping tensors, and with ``stop_at_first`` raise here, inside the op.
        ``held``: (arguments, results) of the module call or hook that looks (module level), the
        tensors a stop hands over when no op's are kept."""
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
        culprit: Held | None = None
        if window is not None:
            self.window = None  # the first origin is found: no more tensors kept, no more reads
            for entry in window:
                new, args, kwargs, outs = entry
                if occ.output.index in new:
                    self._measure_culprit(occ.output.index, new, args, kwargs, outs)
                    occ = dataclasses.replace(occ, output=store.record(occ.output.index),
                                              inputs=tuple(store.record(i) for i in occ.output.inputs))
                    culprit = entry
                    break
        if self.stop_at_first:
            self.stopped = occ
            stop = self._stop(occ, culprit, window or [], held)
            nanhunt.last = stop
            raise NonFiniteError(occ, stop)

    def _stop(self, occ: Occurrence, culprit: Held | None, window: list[Held],
              held: tuple[Any, Any] | None) -> Stop:
        """The stop at ``occ`` with its tensors: the culprit op's (``culprit``), else those among the
        ops kept (``window``) or the module call's (``held``) that hold its record and its inputs'."""
        idx = occ.output.index
        if culprit is not None:
            new, args, kwargs, outs = culprit
            out_t = [o for o in outs if floatish(o)]
            pos = new.index(idx)
            ins = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor) and floatish(t)]
            output = out_t[pos] if pos < len(out_t) else None
        else:
            pools = [(tensors((a, k)), list(o)) for _, a, k, o in window]
            if held is not None:
                pools.append((tensors(held[0]), tensors(held[1])))
            known = self._store.known
            by_rec: dict[int, torch.Tensor] = {}  # record index -> a live tensor holding its values
            for ins_, outs_ in pools:
                for t in (*ins_, *outs_):
                    if floatish(t) and (e := known.get(t)) is not None:
                        by_rec.setdefault(e[0], t)
            output = by_rec.get(idx)
            out_t = [] if output is None else [output]
            ins = [by_rec[i] for i in occ.output.inputs if i in by_rec]
            if held is not None and occ.op is None and any(output is o for o in tensors(held[1])):
                ins = [t for t in tensors(held[0]) if floatish(t)]  # a module call's output: its arguments
        return Stop(occ, tuple(t.detach() for t in ins), tuple(t.detach() for t in out_t),
                    None if output is None else output.detach(), _landing())

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


def _not_user(filename: str) -> bool:
    return filename.startswith(_NOT_USER)


def _landing() -> str | None:
    """``file:line in function`` of the innermost frame on the stack that is the user's."""
    f: FrameType | None = sys._getframe(1)
    while f is not None and _not_user(f.f_code.co_filename):
        f = f.f_back
    return None if f is None else f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def land(exc: NonFiniteError) -> None:
    """Cut ``exc``'s traceback after its innermost frame that is the user's (the frame of the op's
    line; in backward, the one that ran the backward): a post-mortem debugger (``python -m pdb``,
    ``%debug``, ``pdb.post_mortem``) starts at a traceback's last frame. Call it once the error has
    left that frame (the trace's ``__exit__``); the frames dropped are torch's and nanhunt's."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        if not _not_user(tb.tb_frame.f_code.co_filename):
            last = tb
        tb = tb.tb_next
    if last is None:
        return
    last.tb_next = None
    stop = exc.stop
    if stop is not None and stop.landing is None:  # raised where no frame was the user's (autograd's device thread)
        code = last.tb_frame.f_code
        exc._landed(f"{code.co_filename}:{last.tb_lineno} in {code.co_name}")
        if nanhunt.last is stop:
            nanhunt.last = exc.stop
