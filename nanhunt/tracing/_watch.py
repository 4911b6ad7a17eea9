"""Locating origins: once when the trace ends, and while the step runs for ``stop_at_first`` and
``full_stats``, which read back what is pending and look for the first origin among the new records.

While it looks mid-step, the watch keeps the tensors of the ops since its last look, so that the
culprit op's full statistics (NaN, +/-Inf, zeros, ... counts) are measured while they are alive.
It holds no part that calls it: nothing here keeps a finished trace's records alive.

A stop (``stop_at_first``) leaves its op's tensors in ``nanhunt.last`` and on the error; :func:`land`
cuts the error's traceback after the user's frame, where a debugger's post-mortem starts.

A stop whose phase is not known yet (loss or update work outside the model, which the next model
call may show was its arguments' preprocessing: forward glue) is held, with its op's tensors, and
raised once the phase is known (:meth:`OriginWatch.settle`): at the model call that takes its value,
at a backward (when its value has an autograd graph), before an optimizer step, or when the block
ends. So it names the phase the whole trace names; the debugger lands on the user's line running
then (``nanhunt.last.source`` is the op's line). Not told apart: a value with a graph made before a
backward, or any value made before an optimizer step, that the model's next call takes after it
(the full trace: forward; the stop: loss or update).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import FrameType
from typing import Any

import torch

from .._util import _last
from .._util._errors import NonFiniteError, Stop
from ._phases import PhaseTracker
from ._records_store import RecordStore
from ._tensors import floatish, input_shapes, tensors
from .locate import LocateResult, locate, origin_kind
from ..records import Level, Occurrence
from ._casts import with_casts
from .stats import full_stats

__all__ = ["OriginWatch", "WINDOW", "land"]

WINDOW = 256  # records between read-backs while the culprit's tensors are kept (trace(full_stats=True))

# An op's tensors kept until the next look: (its new records, args, kwargs, outputs).
Held = tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any], list[torch.Tensor]]

# Frames that are not the user's: an op's source line is the innermost frame outside them (_ops), and a
# debugger's post-mortem starts below them.
NOT_USER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
             os.path.dirname(os.__file__) + os.sep + "contextlib.py", "<frozen")


class OriginWatch:
    """Runs :func:`locate` over ``store``'s records. ``keep_tensors``: keep the ops' tensors between
    looks (op level, with ``stop_at_first`` or ``full_stats``); ``stop_at_first``: raise
    :class:`NonFiniteError` inside the op that made the first origin (``stopped`` is it). ``phases``
    (op level): the trace's phase tracker; with it, a stop whose phase may still change is ``held``
    until :meth:`settle` (without it, every stop is raised in its op)."""

    __slots__ = ("level", "allow", "stop_at_first", "window", "stopped", "held", "_held_graph", "_keep", "_store",
                 "_phases")

    def __init__(self, store: RecordStore, *, level: Level = Level.OP, allow: tuple[str, ...] = (),
                 stop_at_first: bool = False, keep_tensors: bool = False, phases: PhaseTracker | None = None) -> None:
        self.level = level
        self.allow = allow
        self.stop_at_first = stop_at_first
        self.window: list[Held] | None = [] if keep_tensors else None  # None: no tensors kept
        self.stopped: Occurrence | None = None
        self.held: Stop | None = None  # a stop waiting for its phase (see settle)
        self._held_graph = False  # its value has an autograd graph: a backward settles it
        self._keep = keep_tensors
        self._store = store
        self._phases = phases if level == Level.OP else None

    def hold(self, new: list[int], args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor],
             node: Any) -> None:
        """An op made records ``new`` from ``outs`` (``node``: the backward node it runs in, if any):
        keep its tensors until the next look, and look when due."""
        if self.held is not None:  # a stop waits for its phase: a backward through its value tells it (loss)
            if node is not None and self._held_graph:
                self.settle()
            return
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
                     calls=store.calls, not_masks=store.not_masks, negated=store.negated)
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
            stop, graph = self._stop(occ, culprit, window or [], held)
            if self._phases is not None and self._phases.still_open(occ.phase):
                self.held = stop  # the next model call may show it was that call's preprocessing
                self._held_graph = graph
                return
            self.stopped = occ
            _last.stop = stop
            raise NonFiniteError(occ, stop)

    def settle(self) -> None:
        """The phase of the stop held is known now (a module call's arguments were told apart from the
        loss, or a backward or an optimizer step begins): raise it here, as its record reads now, unless
        that made it no origin (an entering -inf that turned out a model input: a mask), then look on."""
        err = self._settled()
        if err is not None:
            raise err

    def module_called(self) -> None:
        """A module call began, after its arguments' glue was told (:meth:`PhaseTracker.glue_to_forward`): one
        that took the value of the stop held settles it (forward now); one that did not (an evaluation under
        no_grad, the next step's call) leaves it open: a later call may still take it."""
        stop = self.held
        if stop is not None and not PhaseTracker.open_phase(self._store.raws[stop.record.index].phase):
            self.settle()

    def step_enter(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer step begins (torch's global pre-hook): a stop held is raised before it writes a weight."""
        if self.held is not None:
            self.settle()

    def settle_at_exit(self) -> NonFiniteError | None:
        """The block ends with a stop held: its error, to raise once the trace is undone (no frame of the
        user's is below it then: ``landing`` stays ``None``); ``None`` when none is held."""
        return self._settled(at_exit=True)

    def _settled(self, *, at_exit: bool = False) -> NonFiniteError | None:
        stop, self.held = self.held, None
        if stop is None:
            return None
        store = self._store
        raws = store.raws
        idx = stop.record.index
        if origin_kind(raws[idx], raws, may_mask=idx not in store.not_masks, negated=idx in store.negated) is None:
            self.window = [] if self._keep else None
            store.checked = idx + 1  # the records made since it are looked at by the next op
            return None
        out = store.record(idx)
        occ = dataclasses.replace(stop.occurrence, phase=out.phase, output=out,
                                  inputs=tuple(store.record(i) for i in out.inputs))
        stop = dataclasses.replace(stop, occurrence=occ, landing=None if at_exit else _landing())
        self.stopped = occ
        _last.stop = stop
        return NonFiniteError(occ, stop)

    def _stop(self, occ: Occurrence, culprit: Held | None, window: list[Held],
              held: tuple[Any, Any] | None) -> tuple[Stop, bool]:
        """The stop at ``occ`` with its tensors: the culprit op's (``culprit``), else those among the
        ops kept (``window``) or the module call's (``held``) that hold its record and its inputs'; and
        whether its value has an autograd graph (a backward may run through it)."""
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
        stop = Stop(occ, tuple(t.detach() for t in ins), tuple(t.detach() for t in out_t),
                    None if output is None else output.detach(), _landing())
        # in the op (below autograd) its output has no grad_fn yet: a graph is made when an input has one
        return stop, torch.is_grad_enabled() and any(t.requires_grad for t in ins)

    def finish(self, *, sinks_seen: bool) -> LocateResult:
        """The step is over: read everything back and locate over all records (``sinks_seen``: the
        trace saw the step's sinks, the loss and gradients, not a scope only)."""
        store = self._store
        if self.window:
            self.check()  # the last ops' tensors are still held: measure a culprit among them
        self.window = None
        self.held = None  # a stop held when the block raised its own error: the full trace answers
        store.read_back()
        store.made.clear()  # phases may have changed since a stop_at_first check made some
        found = locate(
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
            negated=store.negated,
            sinks_seen=sinks_seen,
        )
        return with_casts(found, store.raws, store.record) if store.casts else found

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
    return filename.startswith(NOT_USER)


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
        if _last.stop is stop:
            _last.stop = exc.stop
