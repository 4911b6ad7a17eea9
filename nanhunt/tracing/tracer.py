"""``nanhunt.trace``: observe one step and find where its first non-finite value was born.

The tracer installs module hooks (module stack, call indices), a dispatch mode
that sees every aten op of forward, loss, backward and update, and
post-accumulate-grad hooks on the parameters. Every floating tensor becomes a
record whose statistics stay on the device until the trace ends, when they are
read back in one copy per (device, dtype). It owns every handle and removes
them all on exit, also when the block raises.

:class:`Trace` is a facade over its parts: the record store (``_records_store``), the phase
state machine (``_phases``), op recording (``_ops``), module hooks (``_modules``), the scope gate
(``_scope``) and the origin watch (``_watch``: ``locate`` while the step runs and at its end). It
builds them, runs their lifecycle and answers from their results.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.optim.optimizer as _optim
from torch import nn

from . import _ranks, _watch
from .._util import _dispatch
from .._util._errors import NanhuntError, NonFiniteError, TraceStateError
from ._modules import ModuleHooks
from ._ops import OpRecorder
from ._phases import PhaseTracker
from ._records_store import RecordStore
from ._restore import ModelState
from ._records_store import cast_value as _cast_value  # noqa: F401  (tests import it from here)
from ._scope import ScopeGate
from ._watch import OriginWatch
from .locate import LocateResult
from ..records import Level, Occurrence, Phase, Record, Role

__all__ = ["trace", "Trace", "as_level"]

_LEVELS = tuple(lv.value for lv in Level)


def _debugging() -> bool:
    """A debugger (pdb, ``breakpoint()``, an IDE's bdb-based one) is tracing this thread: the block ran at its
    prompt."""
    import sys

    bdb = sys.modules.get("bdb")
    return bdb is not None and isinstance(getattr(sys.gettrace(), "__self__", None), bdb.Bdb)


def as_level(level: str) -> Level:
    """``level`` as :func:`trace` and :func:`nanhunt.replay` take it: ``"op"``, ``"module"`` or a :class:`Level`."""
    try:
        return Level(level)
    except ValueError:
        raise ValueError(f"level must be one of {_LEVELS}, not {level!r}") from None


class Trace:
    """Observes one training step; after the ``with`` block, ``first`` says where NaN/Inf was born.

    Use :func:`trace` to make one. Attributes, readable only once the block has
    exited: ``first`` (an :class:`Occurrence` or ``None``), ``origins`` (every
    origin, in execution order), ``path`` (records from the first origin to the
    loss or gradients), ``records``.
    """

    def __init__(
        self,
        model: nn.Module | None,
        *,
        level: str = "op",
        stop_at_first: bool = False,
        allow: Iterable[str] = (),
        scope: Iterable[str] = (),
        full_stats: bool = False,
        distributed: bool | None = None,
        restore: bool = False,
    ) -> None:
        self.level = as_level(level)
        self.restore = restore
        self._saved: ModelState | None = None
        if isinstance(allow, str):
            allow = (allow,)
        if distributed and not _ranks.available():
            raise ValueError("distributed=True needs an initialised torch.distributed process group")
        # stop_at_first leaves the block early on one rank: a gather there would meet other ranks' collectives
        self.distributed = _ranks.available() and not stop_at_first if distributed is None else distributed
        self._ranks: _ranks.RankView | None = None
        self.stop_at_first = stop_at_first
        self.full_stats = full_stats
        self.allow: tuple[str, ...] = tuple(allow)
        self.compiled = False
        orig = None if model is None else _dispatch.compiled_original(model)
        if orig is not None:
            # torch.compile: trace the eager original; compiled graphs hide their ops.
            model = orig
            self.compiled = True
        self._model_ref = None if model is None else weakref.ref(model)
        self.scope: tuple[str, ...] = (scope,) if isinstance(scope, str) else tuple(scope)
        if self.scope and (model is None or self.level != Level.OP):
            raise ValueError("scope= restricts an op-level trace of a model to some of its modules")
        self._state = "new"
        self._result: LocateResult | None = None
        self._failure: str | None = None  # why __exit__ could not finish
        self._handles: list[Any] = []  # every hook handle of every part
        self._mode: _dispatch.TraceMode | None = None
        self._entered = False  # the mode entered for the whole block (no scope)
        self._eager: contextlib.AbstractContextManager[None] | None = None  # compiled code runs eagerly
        # The parts, each holding only those below it (no cycle keeps a finished trace's records alive).
        self._store = RecordStore()
        self._phases = PhaseTracker(self._store)
        # Op level: the ops since the last read-back are kept with their tensors, so that the
        # culprit's full statistics can be measured while they are alive.
        self._watch = OriginWatch(self._store, level=self.level, allow=self.allow, stop_at_first=stop_at_first,
                                  keep_tensors=self.level == Level.OP and (full_stats or stop_at_first), phases=self._phases)
        self._ops = OpRecorder(self._store, self._phases, self._watch, scope=self.scope)
        self._gate = ScopeGate(self._ops, self._phases, self._handles) if self.scope else None
        self._modules = ModuleHooks(self._store, self._phases, self._ops, self._gate, self._watch, self._handles,
                                    level=self.level, scope=self.scope, stop_at_first=stop_at_first)

    @property
    def _on_op(self) -> Any:
        """The dispatch mode's handler (the op recorder's)."""
        return self._ops._on_op

    # ------------------------------------------------------------- lifecycle
    @classmethod
    def _zooming(cls, model: nn.Module, zoom: Iterable[int], *, catch: Occurrence | None = None,
                 catch_records: Sequence[Record] | None = None, **options: Any) -> Trace:
        """A trace that also measures in full the records ``zoom`` names (their statistics and their inputs'
        shapes): the second run of a replay, on the culprit the first one found. With ``catch`` (an origin of an
        earlier run of the same step, whose records were ``catch_records``), the call of the op that makes that
        origin's record is kept, its arguments cloned before it ran (:attr:`_caught`): the repro's inputs.
        Without ``catch_records``, the op that makes the record of the origin's index (a run that records
        exactly as the earlier one did). Not public API."""
        t = cls(model, **options)
        t._store.zoom = frozenset(zoom)
        t._ops._zoom = t._store.zoom
        if catch is not None and catch_records is None:
            t._ops.catch = catch.output.index
        elif catch is not None and catch_records is not None and catch.op is not None:
            # (module, call, op, n-th): no phase, which the tracer may change after an op ran (loss work found
            # to be the next model call's glue turns forward)
            out = catch.output
            nth = sum(1 for r in catch_records[:out.index]
                      if r.module == out.module and r.call_index == out.call_index and r.op == catch.op)
            t._ops.catch = (out.module, out.call_index, catch.op, nth)
        return t

    @property
    def _caught(self) -> tuple[Any, tuple[tuple[Any, ...], dict[str, Any]], Phase] | None:
        """The op call ``_zooming(catch=...)`` kept: (op, (args, kwargs) as the kernel received them, phase)."""
        return self._ops.caught

    def __enter__(self) -> Trace:
        if self._state != "new":
            raise TraceStateError("this trace was already started; make a new nanhunt.trace(...) for each step")
        self._state = "running"
        try:
            if self.restore:
                self._saved = ModelState(self._model_ref() if self._model_ref is not None else None)
            self._start()
        except BaseException:
            self._teardown()
            self._put_back()
            self._state = "failed"
            raise
        return self

    def _put_back(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            saved.put_back()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Remove everything, then read the statistics back and locate. A failure of nanhunt's own
        here never hides the block's exception: that one propagates unchanged, with a note (a
        warning before Python 3.11). Without one, a failed finish raises a :class:`NanhuntError`
        (an interrupt, KeyboardInterrupt or SystemExit, propagates as itself)."""
        if isinstance(exc, NonFiniteError) and exc.occurrence is self._watch.stopped:
            _watch.land(exc)  # a post-mortem debugger starts on the user's line, not in torch's or nanhunt's
        held: NonFiniteError | None = None
        failure: BaseException | None = None
        try:
            try:
                self._teardown()
            finally:
                self._put_back()  # restore=True: also when the block raised, or the teardown did
        except BaseException as e:
            failure = e
        if failure is None:
            try:
                # A stop still held for its phase when the block ends (its phase is final): raised once undone.
                held = self._watch.settle_at_exit() if exc is None and self._watch.held is not None else None
                self._finish()
            except BaseException as e:
                failure = e
        if failure is None:
            self._state = "done"
            if not self.restore and exc is None and self._model_ref is not None and _debugging():
                warnings.warn("nanhunt: this trace ran the step inside its block, at a debugger's prompt: its random "
                              "draws and its gradients (and an optimizer step, if it ran one) are the script's now, "
                              "so continuing runs the script's own step from there; nanhunt.trace(model, "
                              "restore=True) puts the model and the generators back when the block exits",
                              stacklevel=2)
            if held is not None:
                raise held
            if self.compiled and exc is None and self.first is None:
                # the compiled kernels never ran here: a NaN only they make is not seen
                warnings.warn("nanhunt: the eager original of the torch.compile'd model stayed finite; a NaN that "
                              "only the compiled step makes is not seen by a trace: nanhunt.replay(compiled_model, "
                              "batch, ...) replays the step compiled too and names the first non-finite node of "
                              "the compiled graph", stacklevel=2)
            return
        self._state = "failed"
        self._result = None
        self._failure = f"{type(failure).__name__}: {failure}"
        message = f"nanhunt: the trace could not finish ({self._failure}); it has no results"
        if exc is not None:
            add_note = getattr(exc, "add_note", None)
            if add_note is not None:
                add_note(message)
            else:  # pragma: no cover - Python 3.10
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return  # the block's own exception propagates
        if not isinstance(failure, Exception):
            raise failure  # an interrupt during the finish: the user's, not nanhunt's
        raise NanhuntError(message) from failure

    def _start(self) -> None:
        model = None if self._model_ref is None else self._model_ref()
        if self.compiled:
            warnings.warn(
                "nanhunt: the model is torch.compile'd; tracing its eager original (compiled kernels can differ)",
                stacklevel=3,
            )
        self._modules.running = True
        if self._gate is not None:
            self._gate.running = True
        # Compiled code runs eagerly inside the block: its ops are seen one by one, and dynamo
        # does not trace into the tracer's own hooks.
        self._eager = _dispatch.eager_only()
        self._eager.__enter__()
        if model is not None:
            self._modules.install(model)
            # FSDP2's all-gather buffers, kept from the last step, hold whatever their regrown memory holds
            _dispatch.fsdp_fresh_buffers(_dispatch.fsdp_modules(model), reshard=False)
        # Casts autocast cached before the trace would enter as unknown tensors: recompute them.
        torch.clear_autocast_cache()
        if self.level == Level.OP:
            if self.stop_at_first:  # first: a stop held for its phase is raised before the step changes anything
                self._handles.append(_optim.register_optimizer_step_pre_hook(self._watch.step_enter))
            self._handles.append(_optim.register_optimizer_step_pre_hook(self._phases.step_enter))
            self._handles.append(_optim.register_optimizer_step_post_hook(self._phases.step_leave))
            self._ops.last_seq = _dispatch.peek_sequence_nr()
            self._mode = _dispatch.TraceMode(self._ops._on_op)
            if self._gate is not None:
                # With scope= the mode is on the stack only while the scope runs: its forward (module
                # hooks) and its backward nodes (node hooks); every other op runs at full speed.
                self._gate.mode = self._mode
            else:
                self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                self._entered = True

    def _teardown(self) -> None:
        """Remove everything installed. Safe to call twice; every step runs even if one fails."""
        errors: list[BaseException] = []
        # Nothing is recorded from here on, even if some step below fails.
        self._ops.busy = True
        self._modules.running = False
        if self._gate is not None:
            self._gate.running = False
            self._gate.mode = None
        mode, self._mode = self._mode, None
        entered, self._entered = self._entered, False
        try:
            if mode is not None and entered:
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            elif mode is not None:
                _dispatch.pop_mode(mode)  # a scoped forward interrupted before its exit hook
        except BaseException as e:  # pragma: no cover - defensive
            errors.append(e)
        handles = list(self._handles)
        self._handles.clear()  # the parts append to this same list
        for h in handles:
            try:
                h.remove()
            except BaseException as e:  # pragma: no cover - defensive
                errors.append(e)
        eager, self._eager = self._eager, None
        if eager is not None:
            try:
                eager.__exit__(None, None, None)
            except BaseException as e:  # pragma: no cover - defensive
                errors.append(e)
        self._phases.stack.clear()
        self._modules.mstack.clear()
        # Whatever may still call in (a mode some thread's stack kept, a hook autograd copied)
        # from now on just runs: nothing is recorded after the block.
        if errors:
            raise errors[0]

    def _finish(self) -> None:
        try:
            self._result = self._watch.finish(sinks_seen=not self.scope)
        finally:
            if self.distributed:
                # every rank joins the gather, even one whose locate failed: no rank is left waiting
                res = self._result
                self._ranks = _ranks.gather_ranks(None if res is None else res.first, self._received())
        # Drop references that could keep user objects alive (the raws hold no tensor).
        self._store.release()
        self._phases.nodes.clear()

    # --------------------------------------------------------------- results
    def _done(self) -> LocateResult:
        if self._state == "running":
            raise TraceStateError("the trace is still running: read its results after the `with nanhunt.trace(...)` block")
        if self._failure is not None:
            raise TraceStateError(f"the trace could not finish ({self._failure}); it has no results")
        if self._result is None:
            raise TraceStateError("the trace has not run: use it as `with nanhunt.trace(model) as t:`")
        return self._result

    @property
    def first(self) -> Occurrence | None:
        """The first origin in execution order that is not allowed, or ``None`` when all stayed finite."""
        if self._watch.stopped is not None and self._state != "running":
            return self._watch.stopped
        return self._done().first

    @property
    def origins(self) -> list[Occurrence]:
        return list(self._done().origins)

    @property
    def path(self) -> list[Record]:
        return [self._store.record(i) for i in self._done().path]

    @property
    def records(self) -> list[Record]:
        self._done()
        return [self._store.record(i) for i in range(len(self._store.raws))]

    @property
    def tainted(self) -> frozenset[int]:
        """Indices of the origins' records and of every non-finite record they fed."""
        return self._done().tainted

    @property
    def finite(self) -> bool:
        """True when every recorded tensor stayed finite."""
        return all(r.finite for r in self.records)

    def _received(self) -> Record | None:
        raws = self._store.raws
        return next((self._store.record(r.index) for r in raws if r.role is Role.RECEIVED and not r.finite), None)

    @property
    def received(self) -> Record | None:
        """The first record holding a non-finite value that arrived from another rank through a
        collective (role ``received``; never an origin here), or ``None``."""
        self._done()
        return self._received()

    @property
    def received_note(self) -> str | None:
        """``NaN arrived from another rank through the gradient all-reduce (c10d::allreduce_, phase backward)``."""
        r = self.received
        if r is None:
            return None
        what = "NaN" if r.has_nan else "Inf"
        return f"{what} arrived from another rank through the {_ranks.received_through(r)} ({r.op}, phase {r.phase})"

    def _rank_view(self) -> _ranks.RankView:
        self._done()
        if self._ranks is None:
            raise TraceStateError("not a distributed trace: use nanhunt.trace(..., distributed=True) under "
                                  "an initialised process group")
        return self._ranks

    @property
    def first_rank(self) -> int | None:
        """Distributed trace: the rank whose origin came first in the step (phase, then op order);
        the lowest one on a tie (``first_ranks`` lists them all); ``None`` when no rank made one."""
        return self._rank_view().first_rank

    @property
    def first_ranks(self) -> tuple[int, ...]:
        return self._rank_view().first_ranks

    @property
    def ranks(self) -> dict[int, str | None]:
        """Distributed trace: rank -> its first origin, described (``None``: it made none)."""
        return dict(self._rank_view().ranks)

    @property
    def rank_summary(self) -> str | None:
        """``rank 1: Inf born in phase forward, module fc1 ...; rank 0 received it through the gradient all-reduce``."""
        return self._rank_view().summary()

    def module_classes(self) -> dict[str, str]:
        return dict(self._store.classes)


def trace(
    model: nn.Module | None = None,
    *,
    level: str = "op",
    stop_at_first: bool = False,
    allow: Iterable[str] = (),
    scope: Iterable[str] = (),
    full_stats: bool = False,
    distributed: bool | None = None,
    restore: bool = False,
) -> Trace:
    """Observe everything run inside the block and find where the first NaN/Inf was born.

    Args:
        model: the model whose modules name the records (``named_modules()`` names, as
            you wrote them: the parts torch's wrappers add, DDP's ``module.``, FSDP1's
            ``_fsdp_wrapped_module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``, are
            left out). ``None`` traces ops only. A ``torch.compile``d model is traced
            through its eager original (with a warning).
        level: ``"op"`` records every aten op (forward, loss, backward, update);
            ``"module"`` records module boundaries and gradients only, for speed (or the
            :class:`~nanhunt.records.Level`; ``t.level`` is one).
        stop_at_first: raise :class:`nanhunt.NonFiniteError` inside the op that
            created the first non-finite value, so a debugger lands there. Reads
            statistics back after every op: slow, for interactive use. An op outside
            the model in loss or update phase (which the next model call may show was
            its preprocessing) raises once its phase is known, as the full trace names
            it: at the next model call, backward or optimizer step, or the block's end.
        allow: module names (a module covers its submodules) or op names
            (``"aten::softmax"`` or ``"softmax"``) whose non-finite values are
            intentional: listed in ``origins``, never ``first``.
        scope: module names: record ops only inside these modules (and their
            submodules), forward and backward; everything else runs untraced.
            The zoom pass after a cheap ``level="module"`` trace found the module.
            A tensor made outside the scope is recorded where it enters it
            (role ``input``, phase of the op that reads it).
        full_stats: op level: read the statistics back every 256 records (not once at
            the end) and keep those forward ops' tensors until then, so that a culprit in
            forward, loss or update gets the full counts (NaN, +/-Inf, zeros, smallest
            non-zero, beyond float16/bfloat16, subnormal) while they are alive; stops at the
            first origin. Costs memory and time (about +20% on a small GPT step), so off by
            default: ``nanhunt.replay`` and ``stop_at_first`` measure the culprit in full anyway.
        distributed: under an initialised ``torch.distributed`` process group (the default then,
            unless ``stop_at_first``), every rank's leading origin is gathered once when the block
            exits (one ``all_gather_object``: every rank must leave its block) and ``first_rank``,
            ``ranks`` and ``rank_summary`` name the rank whose origin came first. A value that
            arrived through a collective is never an origin (``received``, ``received_note``).
        restore: put back, when the block exits (also on an exception), what the step run inside it changed:
            the random generators (torch's CPU and CUDA ones, Python's, NumPy's), and the model's parameters,
            their ``.grad`` and its buffers. For tracing a step at a ``breakpoint()``: continuing the script then
            runs its own step from the state it was about to run from. The optimizer's and the GradScaler's state
            are not the model's and are not put back (leave ``optimizer.step()`` out of the block, or use
            :func:`nanhunt.replay`, which restores them too). Costs a copy of the model while the block runs.

    Example::

        with nanhunt.trace(model) as t:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
        print(t.first)   # e.g. NaN born in phase forward, module encoder.1.fc ...
    """
    return Trace(model, level=level, stop_at_first=stop_at_first, allow=allow, scope=scope, full_stats=full_stats,
                 distributed=distributed, restore=restore)
