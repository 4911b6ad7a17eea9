"""``nanhunt.trace``: observe one step and find where its first non-finite value was born.

The tracer installs module hooks (module stack, call indices), a dispatch mode
that sees every aten op of forward, loss, backward and update, and
post-accumulate-grad hooks on the parameters. Every floating tensor becomes a
record whose statistics stay on the device until the trace ends, when they are
read back in one copy per (device, dtype). It owns every handle and removes
them all on exit, also when the block raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import struct
import sys
import warnings
import weakref
from collections.abc import Iterable, Sequence
from types import CodeType, FrameType, TracebackType
from typing import Any, Generic, TypeVar

import torch
import torch.optim.optimizer as _optim
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from . import _dispatch
from ._errors import NanhuntError, NonFiniteError, TraceStateError
from .locate import LocateResult, locate
from .records import FullStats, Occurrence, Phase, RangeStats, Record, Role
from .stats import PendingStats, full_stats

__all__ = ["trace", "Trace"]

_V = TypeVar("_V")
_LEVELS = ("op", "module")
_current_node = _dispatch.current_autograd_node
_peek_seq = _dispatch.peek_sequence_nr
_grad_enabled = torch.is_grad_enabled
_INFOS = _dispatch.OP_INFOS
_FORWARD = Phase.FORWARD
_LOSS = Phase.LOSS
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANHUNT_DIR = os.path.dirname(__file__) + os.sep
_SKIP_DIRS = (_TORCH_DIR, _NANHUNT_DIR, os.path.dirname(os.__file__) + os.sep + "contextlib.py")
_MAX_NEST = 6  # how deep module inputs/outputs are searched for tensors


class _TensorMap(Generic[_V]):
    """tensor -> value (a record index and version; an owner's name), keyed by identity without
    keeping the tensor alive.

    A plain dict on ``id`` with a weak reference to check that the id still names the
    same tensor (ids are reused once a tensor dies): cheaper than WeakIdKeyDictionary,
    which builds a reference object on every lookup.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref[torch.Tensor], _V]] = {}

    def get(self, t: torch.Tensor) -> _V | None:
        e = self.entries.get(id(t))
        if e is None or e[0]() is not t:
            return None
        return e[1]

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def __setitem__(self, t: torch.Tensor, value: _V) -> None:
        self.entries[id(t)] = (weakref.ref(t), value)


class _StepRun:
    """One ``optimizer.step()`` running: whether it began inside a backward node (a post-accumulate-grad
    hook stepping), the module depth then, the first record it made, and whether a module was called
    since at that depth (a closure: its forward, loss and backward are no update)."""

    __slots__ = ("in_node", "depth", "start", "closure")

    def __init__(self, in_node: bool, depth: int, start: int) -> None:
        self.in_node, self.depth, self.start = in_node, depth, start
        self.closure = False


class _Raw(RangeStats):
    """A record under construction: its statistics stay on the device until the trace
    reads them back (``min``/``max`` NaN until then). The locator reads these directly;
    a :class:`Record` is made only for what a user or a report looks at."""

    __slots__ = ("index", "phase", "module", "call_index", "op", "role", "dtype", "shape", "inputs", "source",
                 "nonfinite_scalar", "alias_of", "full", "blank", "in_shapes", "min", "max", "constant")

    def __init__(
        self,
        phase: Phase,
        module: str | None,
        call: int,
        op: str | None,
        role: Role,
        t: torch.Tensor,
        inputs: tuple[int, ...],
        source: tuple[str, int, str] | None,
        scalar: str | None = None,
        alias_of: int | None = None,
    ) -> None:
        self.index = -1  # set when appended
        self.min = self.max = math.nan
        self.phase = phase
        self.module = module
        self.call_index = call
        self.op = op
        self.role = role
        self.dtype = _DTYPE_NAMES[t.dtype]
        self.shape = t.shape
        self.inputs = inputs
        self.source = source
        self.nonfinite_scalar = scalar
        self.alias_of = alias_of
        self.full: FullStats | None = None
        self.blank = False  # uninitialised memory: no value to measure, counts as finite
        self.in_shapes: tuple[tuple[int, ...], ...] | None = None
        self.constant = False  # a tensor literal: its non-finite value counts as a scalar argument's


_DTYPE_NAMES: dict[torch.dtype, str] = {d: str(d).replace("torch.", "") for d in vars(torch).values()
                                        if isinstance(d, torch.dtype)}
# Tensors whose values can be NaN/Inf: floating (float8 included) and complex.
_FLOATISH = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex))


def _floatish(t: torch.Tensor) -> bool:
    return t.dtype in _FLOATISH

_WINDOW = 256  # records between read-backs while the culprit's tensors are kept (trace(full_stats=True))
_STALE = -2  # a version no tensor has: the record must be measured again when read
# Casts among these are derived exactly by _cast_value (one rounding, overflow to inf).
_EXACT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_EXACT_CASTS = frozenset({"float16", "bfloat16", "float32"})


def _cast_value(x: float, dtype: str) -> float:
    """``x`` rounded to ``dtype`` as a tensor cast does it (nearest even; overflow to inf)."""
    if x != x or x in (math.inf, -math.inf) or dtype in ("float64", ""):
        return x
    try:
        if dtype == "float16":
            return float(struct.unpack("<e", struct.pack("<e", x))[0])
        if dtype == "float32":
            return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)
    if dtype == "bfloat16":
        try:
            bits = struct.unpack("<I", struct.pack("<f", x))[0]
        except OverflowError:
            return math.copysign(math.inf, x)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return float(struct.unpack("<f", struct.pack("<I", bits))[0])
    return x


def _cast_pair(lo: float, hi: float, dtype: str) -> tuple[float, float]:
    """min/max of a tensor cast to ``dtype``: casting is monotone (rounding, overflow to inf),
    so they are the cast of the source's min/max."""
    return _cast_value(lo, dtype), _cast_value(hi, dtype)


_version = _dispatch.tensor_version


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """Where and how ``t`` lies in memory (two live tensors with the same layout and version
    counter value hold the same values)."""
    try:
        return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
    except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass, meta)
        return (id(t),)


def _storage_key(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return -id(t)


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside module arguments/outputs: tuples, lists, dicts, ModelOutput, dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    _collect(obj, depth, found)
    return found


def _collect(obj: Any, depth: int, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif depth >= _MAX_NEST:
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                found.append(o)
            elif o is not None:
                _collect(o, depth + 1, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, depth + 1, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name, None), depth + 1, found)


def _stashed(module: nn.Module) -> list[torch.Tensor]:
    """Tensors with a graph that a module and its submodules keep as plain attributes (a cache,
    an auxiliary output read later): their backward runs through the module's nodes too."""
    return [v for m in module.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and v.grad_fn is not None]


def _apply_caller() -> tuple[str, int, str] | None:
    """The user's frame that called ``Function.apply`` (the innermost one on the stack)."""
    f: FrameType | None = sys._getframe(2)
    found = False
    while f is not None:
        code = f.f_code
        if found and not code.co_filename.startswith(_SKIP_DIRS):
            return (code.co_filename, f.f_lineno, code.co_name)
        if code.co_name == "apply" and code.co_filename.endswith(os.path.join("autograd", "function.py")):
            found = True
        f = f.f_back
    return None


def _input_shapes(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """Shapes of an op's floating tensor inputs, in the order the tracer records them."""
    shapes: list[tuple[int, ...]] = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and _floatish(t):
                shapes.append(tuple(t.shape))
    return tuple(shapes)


def _format_source(src: tuple[str, int, str] | None) -> str | None:
    if src is None:
        return None
    return f"{src[0]}:{src[1]} in {src[2]}"


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
        _zoom: Iterable[int] = (),
    ) -> None:
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, not {level!r}")
        if isinstance(allow, str):
            allow = (allow,)
        self.level = level
        self.stop_at_first = stop_at_first
        self.full_stats = full_stats
        self.allow: tuple[str, ...] = tuple(allow)
        self.compiled = False
        if model is not None and hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            # torch.compile: trace the eager original; compiled graphs hide their ops.
            model = model._orig_mod
            self.compiled = True
        self._model_ref = None if model is None else weakref.ref(model)
        self._zoom = frozenset(_zoom)
        self.scope: tuple[str, ...] = (scope,) if isinstance(scope, str) else tuple(scope)
        if self.scope and (model is None or level != "op"):
            raise ValueError("scope= restricts an op-level trace of a model to some of its modules")
        self._state = "new"
        self._result: LocateResult | None = None
        self._made: dict[int, Record] = {}
        self._stopped: Occurrence | None = None
        self._failure: str | None = None  # why __exit__ could not finish
        self._reset()

    # ----------------------------------------------------------------- state
    def _reset(self) -> None:
        self._raw: list[_Raw] = []
        self._pending = PendingStats()
        self._known: _TensorMap[tuple[int, int]] = _TensorMap()  # tensor -> (record index, version)
        self._kd = self._known.entries  # the same, read directly on the op path
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._classes: dict[str, str] = {}
        self._owner: _TensorMap[str] = _TensorMap()  # param -> owning module name
        self._root_name: str | None = None
        self._direct: dict[str, tuple[int, ...]] = {}  # module -> records of its own weights
        self._stack: list[tuple[str, int]] = []
        self._recompute_depth = 0  # module calls entered inside backward (torch.utils.checkpoint)
        # module level, per module call running: (start, input records, its children's output records so far)
        self._mstack: list[tuple[int, tuple[int, ...], list[int]]] = []
        self._calls: dict[str, int] = {}
        self._seqmap: dict[int, tuple[str | None, int, tuple[str, int, str] | None]] = {}
        self._last_seq = -1
        self._last_ctx: tuple[str | None, int, tuple[str, int, str] | None] | None = None  # the last op's
        self._forward_seen = False
        self._backward_seen = False
        self._accumulated = False
        self._updating: list[_StepRun] = []  # optimizer steps running (torch's global step hooks)
        self._step_spans: list[tuple[int, int]] = []  # record index ranges made inside optimizer steps
        self._loss_pending: list[int] = []
        self._root_outputs: set[int] = set()
        self._spans: dict[int, int] = {}
        self._calls_made: list[tuple[int, int, str, int]] = []  # module level: (start, end, module, call)
        self._handles: list[Any] = []
        self._mode: _dispatch.TraceMode | None = None
        self._entered = False  # the mode entered for the whole block (no scope)
        self._gate: list[bool] = []  # scope= : per scope entry, whether it put the mode on the stack
        self._hooked: set[int] = set()  # scope= : sequence numbers of the nodes given gate hooks
        self._busy = False
        self._checked = 0
        # Op level: the ops since the last read-back, with their tensors, so that the culprit's
        # full statistics can be measured while they are alive (None: not kept).
        self._window: list[tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any], list[torch.Tensor]]] | None = (
            [] if self.level == "op" and (self.full_stats or self.stop_at_first) else None)
        self._code_skip: dict[CodeType, bool] = {}
        self._eager: contextlib.AbstractContextManager[None] | None = None  # compiled code runs eagerly
        self._writes: dict[int, int] = {}  # storage data_ptr -> last record that wrote into it
        self._nograd_calls: dict[tuple[int, str], list[int]] = {}  # (last node's sequence nr, module) -> calls
        self._not_masks: set[int] = set()  # records that cannot be -inf masks (running statistics)
        self._consumed: set[int] = set()  # module level: records some module call took as an argument
        self._index_uses: set[int] = set()  # op level: records an op with no floating output took in (a cast to long)
        # Module level: module outputs by memory layout, for the aliases of them a module receives
        # (a user's full backward hook hands the next module a new tensor over the same memory).
        self._layouts: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], int, int]] = {}

    # ------------------------------------------------------------- lifecycle
    def __enter__(self) -> Trace:
        if self._state != "new":
            raise TraceStateError("this trace was already started; make a new nanhunt.trace(...) for each step")
        self._state = "running"
        try:
            self._start()
        except BaseException:
            self._teardown()
            self._state = "failed"
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Remove everything, then read the statistics back and locate. A failure of nanhunt's own
        here never hides the block's exception: that one propagates unchanged, with a note (a
        warning before Python 3.11). Without one, a failed finish raises a :class:`NanhuntError`
        (an interrupt, KeyboardInterrupt or SystemExit, propagates as itself)."""
        failure: BaseException | None = None
        try:
            self._teardown()
        except BaseException as e:
            failure = e
        if failure is None:
            try:
                self._finish()
            except BaseException as e:
                failure = e
        if failure is None:
            self._state = "done"
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
        # Compiled code runs eagerly inside the block: its ops are seen one by one, and dynamo
        # does not trace into the tracer's own hooks.
        self._eager = _dispatch.eager_only()
        self._eager.__enter__()
        if model is not None:
            self._install(model)
        # Casts autocast cached before the trace would enter as unknown tensors: recompute them.
        torch.clear_autocast_cache()
        if self.level == "op":
            self._handles.append(_optim.register_optimizer_step_pre_hook(self._update_enter))
            self._handles.append(_optim.register_optimizer_step_post_hook(self._update_leave))
            self._last_seq = _dispatch.peek_sequence_nr()
            self._mode = _dispatch.TraceMode(self._on_op)
            if not self.scope:
                self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                self._entered = True
            # With scope= the mode is on the stack only while the scope runs: its forward (module
            # hooks) and its backward nodes (node hooks); every other op runs at full speed.

    def _teardown(self) -> None:
        """Remove everything installed. Safe to call twice; every step runs even if one fails."""
        errors: list[BaseException] = []
        # Nothing is recorded from here on, even if some step below fails.
        self._busy = True
        mode, self._mode = self._mode, None
        entered, self._entered = self._entered, False
        try:
            if mode is not None and entered:
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            elif mode is not None:
                _dispatch.pop_mode(mode)  # a scoped forward interrupted before its exit hook
        except BaseException as e:  # pragma: no cover - defensive
            errors.append(e)
        handles, self._handles = self._handles, []
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
        self._stack.clear()
        self._mstack.clear()
        # Whatever may still call in (a mode some thread's stack kept, a hook autograd copied)
        # from now on just runs: nothing is recorded after the block.
        if errors:
            raise errors[0]

    def _finish(self) -> None:
        if self._window:
            self._check()  # the last ops' tensors are still held: measure a culprit among them
        self._window = None
        self._fill(self._pending.read(), 0)
        self._made = {}  # phases may have changed since a stop_at_first check made some
        self._result = locate(
            self._raw,
            level=self.level,
            classes=self._classes,
            root_outputs=frozenset(self._root_outputs),
            spans=self._spans,
            allow=self.allow,
            materialize=self._record,
            index_uses=frozenset(self._index_uses),
            calls=self._calls_made,
            not_masks=self._not_masks,
            sinks_seen=not self.scope,
        )
        # Drop references that could keep user objects alive (the raws hold no tensor).
        self._known = _TensorMap()
        self._kd = self._known.entries
        self._seqmap = {}

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
        if self._stopped is not None and self._state != "running":
            return self._stopped
        return self._done().first

    @property
    def origins(self) -> list[Occurrence]:
        return list(self._done().origins)

    @property
    def path(self) -> list[Record]:
        return [self._record(i) for i in self._done().path]

    @property
    def records(self) -> list[Record]:
        self._done()
        return [self._record(i) for i in range(len(self._raw))]

    @property
    def tainted(self) -> frozenset[int]:
        """Indices of the origins' records and of every non-finite record they fed."""
        return self._done().tainted

    @property
    def finite(self) -> bool:
        """True when every recorded tensor stayed finite."""
        return all(r.finite for r in self.records)

    def module_classes(self) -> dict[str, str]:
        return dict(self._classes)

    # ------------------------------------------------------------ recording
    def _new(self, raw: _Raw, t: torch.Tensor) -> int:
        idx = raw.index = len(self._raw)
        self._raw.append(raw)
        if raw.blank:
            self._pending.values[idx] = (0.0, 0.0)
        elif raw.alias_of is None:
            self._pending.add(idx, t)
        if idx in self._zoom:
            raw.full = full_stats(t)
        if raw.phase is _LOSS:
            self._loss_pending.append(idx)
        return idx

    def _source(self, depth: int = 3) -> tuple[str, int, str] | None:
        """The innermost frame outside torch and nanhunt: the user's line that ran the op.
        ``depth``: frames to skip (this one, the tracer's, the mode's)."""
        f: FrameType | None = sys._getframe(depth)
        skip_cache = self._code_skip
        while f is not None:
            code = f.f_code
            skip = skip_cache.get(code)
            if skip is None:
                fn = code.co_filename
                skip = skip_cache[code] = fn.startswith(_SKIP_DIRS) or fn.startswith("<frozen")
            if not skip:
                return (code.co_filename, f.f_lineno, code.co_name)
            f = f.f_back
        return None

    def _update_enter(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._updating.append(_StepRun(_current_node() is not None, len(self._stack), len(self._raw)))

    def _update_leave(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._updating:
            self._step_spans.append((self._updating.pop().start, len(self._raw)))

    def _in_update(self) -> bool:
        """An optimizer step's own ops run (not a closure's forward, loss and backward inside it)."""
        u = self._updating
        return bool(u) and not u[-1].closure and len(self._stack) <= u[-1].depth

    def _context(self, node: Any) -> tuple[Phase, str | None, int, tuple[str, int, str] | None, bool]:
        """Phase, module, call index and (for backward) the forward source line of the current op."""
        if node is not None:
            if self._updating and self._updating[-1].in_node and self._in_update():  # stepped by a backward hook
                return Phase.UPDATE, None, 0, None, True
            if not self._backward_seen:
                self._backward_seen = True
                self._loss_pending.clear()
            if self._recompute_depth and self._stack:
                # A forward recomputed during backward: it belongs to the module running it.
                name, call = self._stack[-1]
                return Phase.BACKWARD, name, call, None, True
            ctx = self._seqmap.get(node._sequence_nr())
            if ctx is not None:
                return Phase.BACKWARD, ctx[0], ctx[1], ctx[2], False
            var = getattr(node, "variable", None)  # AccumulateGrad: the parameter it fills
            owner = self._owner.get(var) if isinstance(var, torch.Tensor) else None
            return Phase.BACKWARD, owner, 0, None, False
        if self._updating and self._in_update():  # optimizer.step(), also run from a module's forward
            return Phase.UPDATE, None, 0, None, True
        if self._stack:
            name, call = self._stack[-1]
            return Phase.FORWARD, name, call, None, True
        if self._accumulated:  # after a backward that filled .grad (autograd.grad alone does not)
            return Phase.UPDATE, None, 0, None, True
        if self._forward_seen:
            return Phase.LOSS, None, 0, None, True
        return Phase.FORWARD, None, 0, None, True  # glue code before the model: no module

    def _unwritten_since(self, t: torch.Tensor, idx: int) -> bool:
        """Inference tensors have no version counter: ask whether an op wrote into the
        storage after record ``idx`` was made (a write through a view, say)."""
        w = self._writes.get(_storage_key(t))
        return w is None or w <= idx

    def _lookup(self, t: torch.Tensor, phase: Phase, module: str | None, call: int) -> int:
        """The record that holds ``t``'s current values, measuring it when unknown or changed."""
        ent = self._known.get(t)
        ver = _version(t)
        if ent is not None:
            if ent[1] == ver and (ver >= 0 or self._unwritten_since(t, ent[0])):
                return int(ent[0])
            # Changed in place, perhaps through a view: link the last write into its storage.
            w = self._writes.get(_storage_key(t))
            links = (int(ent[0]),) if w is None or w == ent[0] else (int(ent[0]), w)
            raw = _Raw(phase, module, call, None, Role.REMEASURED, t, links, None)
        elif self.scope:
            # Made outside the scope (or before the step): it enters the scope here.
            raw = _Raw(phase, module, call, None, Role.INPUT, t, (), None)
        elif phase is Phase.BACKWARD:
            # Never seen in this step: state from before it (a stale .grad being accumulated into).
            raw = _Raw(phase, module, call, None, Role.STATE, t, (), None)
        elif phase is Phase.UPDATE:
            raw = _Raw(phase, None, 0, None, Role.STATE, t, (), None)
        else:
            raw = _Raw(Phase.INPUT, module, call, None, Role.INPUT, t, (), None)
        idx = self._new(raw, t)
        self._known[t] = (idx, ver)
        return idx

    # ------------------------------------------------------------- op level
    def _on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._busy:
            return func(*args, **kwargs)
        node = _current_node()
        if self.scope and (not self._stack if node is None else not self._recompute_depth and (
                node._sequence_nr() not in self._seqmap
                # a checkpointed block recomputing ops of its own outside the scope, inside a scope node
                or (_grad_enabled() and _dispatch.in_recomputation()))):
            return func(*args, **kwargs)  # outside the scope: not recorded
        info = _INFOS.get(id(func))  # OpOverload hashes in Python: key by identity
        if info is None:
            info = _dispatch.op_info(func)
        run = info.run
        kd = self._kd
        if info.same_set_view and (node is None or self._backward_seen):
            # Fast path, half the ops of a step: a view holding exactly the elements of a tensor
            # whose record is current shares that record. Nothing to measure or attribute
            # unless the op makes an autograd node (then the general path keeps its context).
            a: torch.Tensor = args[0]
            e = kd.get(id(a))
            if e is not None and e[0]() is a:
                try:
                    ver = a._version
                except RuntimeError:
                    ver = -1
                rec = e[1]
                if rec[1] == ver and ver >= 0 and (
                        (node is not None and not _grad_enabled()) or _peek_seq() == self._last_seq):
                    out = run(*args, **kwargs)
                    if isinstance(out, torch.Tensor) and out.dtype in _FLOATISH:
                        kd[id(out)] = (weakref.ref(out), (rec[0], ver))
                    return out
        module: str | None
        src: tuple[str, int, str] | None
        if node is None and self._stack and not self._updating:  # forward inside a module: inline
            phase = _FORWARD
            module, call = self._stack[-1]
            src = None
            want_src = True
        else:
            phase, module, call, src, want_src = self._context(node)
        new_node = False
        seq = first_seq = 0
        # Forward ops make nodes; so do backward ops under create_graph (double backward).
        if node is None or _grad_enabled():
            seq = _peek_seq()
            if seq != self._last_seq:
                first_seq, self._last_seq = self._last_seq, seq
                new_node = True
        if info.constant:
            return self._constant(func, args, kwargs, phase, module, call, want_src)
        ins: list[int] = []
        if info.write_only_args or info.write_only_kwargs:  # out=, copy_'s destination: not inputs
            scalar = self._scan([a for i, a in enumerate(args) if i not in info.write_only_args],
                                ins, phase, module, call, None)
            scalar = self._scan([v for k, v in kwargs.items() if k not in info.write_only_kwargs],
                                ins, phase, module, call, scalar)
        else:
            scalar = self._scan(args, ins, phase, module, call, None)
            if kwargs:
                scalar = self._scan(kwargs.values(), ins, phase, module, call, scalar)
        if new_node and phase is Phase.UPDATE and not self._in_update() and self._from_forward(ins):
            # Differentiable work on the forward's values after a backward, outside optimizer.step():
            # a second loss (backward(retain_graph=True) ran first), not an update (an EMA reads weights).
            phase = _LOSS
        if want_src and (new_node or ins):
            src = self._source()
        if new_node:
            node_src = src
            if not _grad_enabled():
                # A node made while grad mode is off is a custom Function's, created by
                # .apply() before its forward ran this op: its line is the apply call.
                node_src = _apply_caller() or src
            # This op's node is the last one made; those before it, since the previous op, are that op's.
            self._claim_nodes(first_seq, seq - 1)
            ctx = (module, call, node_src)
            self._seqmap[seq - 1] = ctx
            self._last_ctx = ctx
        else:
            self._last_ctx = (module, call, src)

        out = run(*args, **kwargs)

        if info.same_set_view and ins and isinstance(out, torch.Tensor) and out.dtype in _FLOATISH:
            self._known[out] = (ins[0], _version(args[0]) if isinstance(args[0], torch.Tensor) else _version(out))
            return out
        if not info.writes:
            # No argument written: only the outputs are new values.
            if isinstance(out, torch.Tensor):
                if out.dtype not in _FLOATISH:
                    self._index_uses.update(ins)
                    return out
                outs: list[torch.Tensor] = [out]
            elif isinstance(out, (tuple, list)):
                outs = []
                for o in out:
                    if isinstance(o, torch.Tensor) and o.dtype in _FLOATISH and not any(o is p for p in outs):
                        outs.append(o)
                if not outs:
                    self._index_uses.update(ins)
                    return out
            else:
                return out
            self._outputs(info, args, kwargs, outs, (), (), ins, phase, module, call, src, scalar, node)
            return out
        outs = []
        if isinstance(out, torch.Tensor):
            outs.append(out)
        elif isinstance(out, (tuple, list)):
            outs.extend(o for o in out if isinstance(o, torch.Tensor))
        written: list[torch.Tensor] = []
        for i in info.written_args:
            if i < len(args):
                written.extend(_tensors(args[i], _MAX_NEST - 1))
        for k in info.written_kwargs:
            written.extend(_tensors(kwargs.get(k), _MAX_NEST - 1))
        hidden: list[torch.Tensor] = []
        if info.hidden_writes and len(args) > 5 and args[5] is True:
            hidden = [args[i] for i in info.hidden_writes if isinstance(args[i], torch.Tensor)]
        outs.extend(written)
        outs.extend(hidden)
        unique: list[torch.Tensor] = []
        seen_ids: set[int] = set()
        for o in outs:
            if id(o) not in seen_ids and o.dtype in _FLOATISH:
                seen_ids.add(id(o))
                unique.append(o)
        if unique:
            self._outputs(info, args, kwargs, unique, [id(w) for w in written], [id(h) for h in hidden], ins,
                          phase, module, call, src, scalar, node)
        return out

    def _outputs(self, info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any],
                 outs: list[torch.Tensor], written_ids: Sequence[int], hidden_ids: Sequence[int], ins: list[int],
                 phase: Phase, module: str | None, call: int, src: tuple[str, int, str] | None, scalar: str | None,
                 node: Any) -> None:
        """Record an op's new values: its floating outputs (distinct) and the arguments it wrote."""
        raws = self._raw
        # A view of uninitialised memory is no value either, until something writes it; a
        # partial write (index_put_, a slice copy) leaves some of it unwritten: still no value,
        # measured again when read (``_STALE``).
        blank = info.uninitialised or (info.is_view and any(raws[i].blank for i in ins))
        partial = bool(written_ids) and not info.write_only_args and bool(ins) and raws[ins[0]].blank
        # A copy (clone, cast, copy_) holds its source's values: derive, don't measure.
        copy_of = ins[info.copy_of] if info.copy_of is not None and len(ins) == info.copy_of + 1 else None
        if copy_of is not None and raws[copy_of].dtype not in _EXACT_CASTS:
            copy_of = None  # float64 sources round twice, float8 targets are not emulated: measure
        inputs = tuple(ins)
        new: list[int] = []
        view_version = _version(args[0]) if info.is_view and args and isinstance(args[0], torch.Tensor) else None
        kd = self._kd
        for o in outs:
            oid = id(o)
            alias = copy_of if copy_of is not None and o.dtype in _EXACT_DTYPES else None
            raw = _Raw(phase, module, call, info.name, Role.OUTPUT, o, inputs, src, scalar, alias)
            is_written = oid in written_ids
            if blank or partial:
                raw.blank = (blank and (info.uninitialised or not is_written)) or (partial and is_written)
            idx = self._new(raw, o)
            if idx in self._zoom:
                raw.in_shapes = _input_shapes(args, kwargs)
            # A view shares its base's version counter, but only once this mode has returned.
            if view_version is not None:
                ver = view_version
            else:
                try:
                    ver = o._version
                except RuntimeError:
                    ver = -1
            if is_written:
                # The autograd layer bumps the version of a written tensor after this mode returns.
                ver = ver + 1 if ver >= 0 else ver
                self._writes[_storage_key(o)] = idx
                if raw.blank or info.uninitialised:
                    ver = _STALE
            elif oid in hidden_ids:
                self._writes[_storage_key(o)] = idx  # written in place, version untouched
            kd[oid] = (weakref.ref(o), (idx, ver))
            new.append(idx)
        # Held tensors are not kept across backward ops: a gradient referenced elsewhere makes
        # AccumulateGrad copy it instead of stealing it (more memory, extra ops in the user's step).
        if self._window is not None and (node is None or self.stop_at_first):
            self._window.append((tuple(new), args, kwargs, outs))
            if self.stop_at_first or len(raws) - self._checked >= _WINDOW:
                self._check()
        elif self.stop_at_first:
            self._check()

    def _claim_nodes(self, first: int, end: int) -> None:
        """Nodes ``first``..``end-1`` were made after the last op seen had returned: autograd gives an
        in-place op on a view CopySlices for the base and a new node for the view then. They are
        that op's. A longer run means ops unseen: left unattributed."""
        if self._last_ctx is not None and 0 < end - first <= 4:
            for s in range(first, end):
                self._seqmap[s] = self._last_ctx

    def _constant(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], phase: Phase,
                  module: str | None, call: int, want_src: bool) -> Any:
        """A tensor literal (``torch.tensor(nan)``, ``x[i] = inf``): recorded like a Python scalar
        argument, a value the code wrote down, never an origin."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and _floatish(out):
            src = self._source(4) if want_src else None
            raw = _Raw(phase, module, call, _dispatch.op_info(func).name, Role.OUTPUT, out, (), src)
            raw.constant = True
            idx = self._new(raw, out)
            self._known[out] = (idx, _version(out))
        return out

    def _scan(self, values: Iterable[Any], ins: list[int], phase: Phase, module: str | None, call: int,
              scalar: str | None) -> str | None:
        """Append the records of the floating tensors in ``values``; return the non-finite scalar seen."""
        lookup = self._lookup
        kd = self._kd
        for a in values:
            if isinstance(a, torch.Tensor):
                if a.dtype in _FLOATISH:
                    e = kd.get(id(a))
                    if e is not None and e[0]() is a:  # known: current unless written since
                        rec = e[1]
                        try:
                            ver = a._version
                        except RuntimeError:
                            ver = -1
                        if rec[1] == ver and ver >= 0:
                            ins.append(rec[0])
                            continue
                    ins.append(lookup(a, phase, module, call))
            elif isinstance(a, float):
                if a != a:
                    scalar = "nan"
                elif scalar is None and (a == math.inf or a == -math.inf):
                    scalar = "inf"
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        if _floatish(b):
                            ins.append(lookup(b, phase, module, call))
                    elif isinstance(b, float) and not math.isfinite(b):  # per-tensor scalars (foreach)
                        scalar = "nan" if b != b else (scalar or "inf")
        return scalar

    def _fill(self, values: dict[int, tuple[float, float]], start: int) -> None:
        """Put the read-back statistics on the raw records from ``start`` on (copies derived)."""
        raws = self._raw
        for i in range(start, len(raws)):
            r = raws[i]
            if r.alias_of is not None:
                base = raws[r.alias_of]
                lo, hi = base.min, base.max
                if base.dtype != r.dtype:
                    lo, hi = _cast_pair(lo, hi, r.dtype)
            else:
                lo, hi = values.get(i, (math.nan, math.nan))
            r.min, r.max = lo, hi
            if r.constant and not r.finite:
                r.nonfinite_scalar = "nan" if r.has_nan else "inf"

    def _record(self, i: int) -> Record:
        """The :class:`Record` of index ``i``, made on first use."""
        rec = self._made.get(i)
        if rec is None:
            r = self._raw[i]
            rec = self._made[i] = Record(
                index=i, phase=r.phase, module=r.module, call_index=r.call_index, op=r.op, role=r.role,
                dtype=r.dtype, shape=tuple(r.shape), min=r.min, max=r.max, inputs=r.inputs,
                source=_format_source(r.source), nonfinite_scalar=r.nonfinite_scalar, full=r.full,
                input_shapes=r.in_shapes,
            )
        return rec

    def _check(self) -> None:
        """Read back what is pending (one copy per dtype group) and look for the first origin
        among the new records. Found: measure the culprit op's full statistics while its tensors
        are alive, stop keeping tensors, and with ``stop_at_first`` raise here, inside the op."""
        raws = self._raw
        self._fill(self._pending.read(), self._checked)
        res = locate(raws, level=self.level, classes=self._classes, root_outputs=frozenset(),
                     spans=self._spans, allow=self.allow, start=self._checked, final=False, materialize=self._record,
                     calls=self._calls_made, not_masks=self._not_masks)
        self._checked = len(raws)
        window = self._window
        if window is not None:
            self._window = []
        occ = res.first
        if occ is None:
            return
        if window is not None:
            self._window = None  # the first origin is found: no more tensors kept, no more reads
            for new, args, kwargs, outs in window:
                if occ.output.index in new:
                    self._measure_culprit(occ.output.index, new, args, kwargs, outs)
                    occ = dataclasses.replace(occ, output=self._record(occ.output.index),
                                              inputs=tuple(self._record(i) for i in occ.output.inputs))
                    break
        if self.stop_at_first:
            self._stopped = occ
            raise NonFiniteError(occ)

    def _measure_culprit(self, idx: int, new: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                         outs: list[torch.Tensor]) -> None:
        """Full statistics of an op's output and inputs (not of inputs it wrote into or that changed
        since: they no longer hold what the op read)."""
        raw = self._raw[idx]
        out_t = [o for o in outs if _floatish(o)]
        pos = new.index(idx)
        if pos < len(out_t):
            raw.full = full_stats(out_t[pos])
        raw.in_shapes = _input_shapes(args, kwargs)
        out_ids = {id(o) for o in outs}
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor) and _floatish(t)]
        if len(tensors) == len(raw.inputs):
            for i, t in zip(raw.inputs, tensors):
                ent = self._known.get(t)
                if id(t) not in out_ids and ent is not None and ent[0] == i and self._raw[i].full is None:
                    self._raw[i].full = full_stats(t)
                    self._made.pop(i, None)
        self._made.pop(idx, None)

    # ---------------------------------------------------------- module hooks
    def _in_scope(self, name: str) -> bool:
        return any(name == s or s == "" or name.startswith(s + ".") for s in self.scope)

    def _install(self, model: nn.Module) -> None:
        """One walk over the modules: names, hooks, weight records, parameter grad hooks."""
        seen: set[int] = set()
        pre, post, grad = self._pre_hook, self._post_hook, self._grad_hook
        if self.scope:
            table = dict(model.named_modules())
            missing = [n for n in self.scope if n not in table]
            if missing:
                raise KeyError(f"scope names no module of the model: {', '.join(missing)} (see model.named_modules())")
        for name, mod in model.named_modules():
            self._names[mod] = name
            self._classes[name] = type(mod).__name__
            if self.scope and not self._in_scope(name):
                for p in mod._parameters.values():
                    if isinstance(p, torch.Tensor) and p not in self._owner:
                        self._owner[p] = name
                continue
            direct: list[int] = []
            for role, tensors in ((Role.PARAM, mod._parameters), (Role.BUFFER, mod._buffers)):
                for t in tensors.values():
                    if not isinstance(t, torch.Tensor) or not _floatish(t):
                        continue
                    if id(t) in seen:  # shared weights: recorded once, owned by the first module
                        ent = self._known.get(t)
                        if ent is not None:
                            direct.append(ent[0])
                        continue
                    seen.add(id(t))
                    idx = self._new(_Raw(Phase.WEIGHTS, name, 0, None, role, t, (), None), t)
                    if role is Role.BUFFER and isinstance(mod, _NormBase):
                        self._not_masks.add(idx)  # running statistics: a -inf there is no mask
                    self._known[t] = (idx, _version(t))
                    self._owner[t] = name
                    direct.append(idx)
                    if role is Role.PARAM and t.requires_grad:
                        self._handles.append(t.register_post_accumulate_grad_hook(grad))  # type: ignore[no-untyped-call]
            self._direct[name] = tuple(direct)
            # prepend: the user's own pre-hooks (weight_norm...) run inside the module, after ours
            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            self._handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
        self._root_name = self._names.get(model)

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self._names.get(module)
        if name is None:
            return
        self._busy = True
        try:
            if self.scope and not self._stack and self._mode is not None:
                self._gate.append(self._open_gate())
                # Entering the scope: nodes made outside it must not be taken for this op's.
                self._last_seq = _peek_seq()
            node = _dispatch.current_autograd_node()
            if node is not None:
                # Recomputation (torch.utils.checkpoint) inside backward: same call, not a new one.
                calls = self._nograd_calls.get((node._sequence_nr(), name))
                call = calls.pop(0) if calls else max(self._calls.get(name, 1) - 1, 0)
                self._stack.append((name, call))
                self._recompute_depth += 1
                if self.level == "module":
                    self._mstack.append((len(self._raw), (), []))
                return
            upd = self._updating
            if upd and not upd[-1].closure and len(self._stack) == upd[-1].depth:
                upd[-1].closure = True  # a closure (LBFGS): its forward, loss and backward are no update
            # A new step (or micro-batch) starts; a forward under no_grad (an eval, a teacher) does not.
            new_step = self._accumulated and _grad_enabled()
            if new_step:
                self._accumulated = self._backward_seen = False
            # What made this call's arguments since the last call (or backward) was forward glue, not
            # loss or update; the rest of the ops pending as loss were the last call's loss.
            glue = (Phase.UPDATE, Phase.LOSS) if new_step else (Phase.LOSS,) if self._loss_pending else ()
            self._loss_pending.clear()
            parent = self._stack[-1] if self._stack else None
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            self._stack.append((name, call))
            self._forward_seen = True
            if not _grad_enabled():
                # A reentrant checkpoint runs its function under no_grad right after making its
                # node: keyed by that node, the calls its recomputation in backward repeats, in order.
                self._nograd_calls.setdefault((_peek_seq() - 1, name), []).append(call)
            ins: list[int] = []
            for t in _tensors((args, kwargs)):
                if not _floatish(t):
                    continue
                ent = self._known.get(t)
                if ent is not None and ent[1] == _version(t):
                    ins.append(int(ent[0]))
                    continue
                if self.level == "module":
                    key = _layout(t)
                    same = self._layouts.get(key)
                    # the same memory, layout and version as a live module output that still lies
                    # there (not re-pointed by `.data = ...`): the same values
                    if same is not None and same[2] == _version(t) >= 0 and (
                            (o := same[0]()) is not None and _layout(o) == key):
                        ins.append(same[1])
                        self._known[t] = (same[1], same[2])
                        continue
                if self.level == "module" and parent is not None:
                    # Not seen at a module boundary: made by the parent's own code between child calls,
                    # from what that call had: its arguments and its children's outputs so far.
                    made = (*frame[1], *frame[2]) if (frame := self._mstack[-1] if self._mstack else None) else ()
                    raw = _Raw(Phase.FORWARD, parent[0], parent[1], None, Role.OUTPUT, t, made, None)
                else:  # from outside the step (or, with scope=, from outside the scope)
                    raw = _Raw(Phase.FORWARD if self.scope else Phase.INPUT, name, call, None, Role.INPUT, t, (), None)
                idx = self._new(raw, t)
                self._known[t] = (idx, _version(t))
                ins.append(idx)
            if glue:
                self._glue_to_forward(ins, glue)
            if self.level == "module":
                self._consumed.update(ins)
                ins.extend(self._direct.get(name, ()))
                self._mstack.append((len(self._raw), tuple(ins), []))
        finally:
            self._busy = False

    def _from_forward(self, ins: Sequence[int]) -> bool:
        raws = self._raw
        return any(raws[i].role is Role.OUTPUT and raws[i].phase in (_FORWARD, _LOSS) for i in ins)

    def _glue_to_forward(self, ins: Sequence[int], phases: tuple[Phase, ...]) -> None:
        """A module call after a backward (``phases`` update and loss) or after a model call (loss):
        the ops since then that made its arguments (the next micro-batch's preprocessing) were
        forward glue; what entered them, input. An optimizer step's own ops stay update (it may
        train the model's input)."""
        raws = self._raw
        todo = [i for i in ins if raws[i].phase in phases]
        seen: set[int] = set()
        steps = self._step_spans
        while todo:
            i = todo.pop()
            if i in seen or any(a <= i < b for a, b in steps):
                continue
            seen.add(i)
            r = raws[i]
            if r.role is Role.STATE:
                r.phase, r.role = Phase.INPUT, Role.INPUT
            else:
                r.phase = Phase.FORWARD
            self._made.pop(i, None)
            todo.extend(j for j in r.inputs if raws[j].phase in phases)

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        name = self._names.get(module)
        if name is None or not self._stack or self._stack[-1][0] != name:
            return
        _, call = self._stack.pop()
        in_backward = _dispatch.current_autograd_node() is not None
        if in_backward and self._recompute_depth:
            self._recompute_depth -= 1
        self._busy = True
        try:
            start, ins, children = self._mstack.pop() if self.level == "module" and self._mstack else (0, (), [])
            if in_backward:
                return
            made = (*ins, *children)  # module level: its output came from its arguments and its children's
            if self.level == "module":
                self._calls_made.append((start, len(self._raw), name, call))
            is_root = name == self._root_name
            for t in _tensors(output):
                if not _floatish(t):
                    continue
                if self.level == "module":
                    ent = self._known.get(t)
                    if ent is not None and ent[1] == _version(t) and ent[0] >= start:
                        idx = int(ent[0])  # a child's output returned as is
                    else:
                        idx = self._new(_Raw(Phase.FORWARD, name, call, None, Role.OUTPUT, t, made, None), t)
                        self._known[t] = (idx, _version(t))
                        self._spans[idx] = start
                        self._layouts[_layout(t)] = (weakref.ref(t), idx, _version(t))
                    if t.requires_grad and torch.is_grad_enabled():
                        self._handles.append(
                            t.register_hook(self._grad_output_hook(name, call, is_root, idx)))  # type: ignore[no-untyped-call]
                    if self._mstack:
                        self._mstack[-1][2].append(idx)
                else:
                    idx = self._lookup(t, Phase.FORWARD, name, call)
                if is_root:
                    self._root_outputs.add(idx)
            if self.stop_at_first and self.level == "module":
                self._check()
        finally:
            self._busy = False
            if self.scope and not self._stack and self._gate:
                self._close_gate(self._gate.pop(), (output, args, kwargs, _stashed(module)))

    # ------------------------------------------------------------ scope gate
    def _open_gate(self) -> bool:
        """Put the dispatch mode on the stack unless it is there; True when this call put it."""
        mode = self._mode
        if mode is None or self._state != "running" or _dispatch.mode_on_stack(mode):
            return False
        _dispatch.push_mode(mode)
        return True

    def _close_gate(self, opened: bool, values: Any) -> None:
        """Leaving the scope: take the mode off the stack again and give the backward nodes the
        scope's ops made (reachable from its outputs, or from inputs it changed in place) gate hooks."""
        seq = _peek_seq()
        self._claim_nodes(self._last_seq, seq)  # made after the scope's last op returned
        self._last_seq = seq
        if opened and self._mode is not None:
            _dispatch.pop_mode(self._mode)
        if self._state == "running":
            self._hook_nodes(_tensors(values))

    def _hook_nodes(self, tensors: Iterable[torch.Tensor]) -> None:
        """Pre/post hooks on the scope's not yet hooked backward nodes: the mode is on the stack
        while such a node runs (autograd restores the thread's mode stack after every node)."""
        seqmap, hooked = self._seqmap, self._hooked
        todo = [g for g in (t.grad_fn for t in tensors) if g is not None]
        while todo:
            node = todo.pop()
            seq = node._sequence_nr()
            if seq in hooked or seq not in seqmap:
                continue  # done already, or made outside the scope
            hooked.add(seq)
            self._handles.append(node.register_prehook(self._node_enter))
            self._handles.append(node.register_hook(self._node_leave))
            todo.extend(f for f, _ in node.next_functions if f is not None)

    def _node_enter(self, grad_outputs: Any) -> None:
        # No pop in a post hook: the engine sums the node's gradients into the next nodes' inputs
        # after it (ops of this node too), and restores the thread's mode stack after each node.
        self._open_gate()
        # Nodes made since this node's last op were made by ops outside the scope, unseen.
        self._last_seq = _peek_seq()

    def _node_leave(self, grad_inputs: Any, grad_outputs: Any) -> None:
        if self._state == "running" and _grad_enabled():  # create_graph: this node's backward made nodes
            self._hook_nodes(g for g in grad_inputs if isinstance(g, torch.Tensor))

    def _grad_output_hook(self, name: str, call: int, is_root: bool, forward_idx: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._state != "running" or not _floatish(grad):
                return
            self._busy = True
            try:
                # The gradient w.r.t. the root output is made by the loss's backward, also when the
                # root returned its child's output as is (an nn.Sequential): this child's hook fires
                # first. Unless a module took that output too (features returned beside a head's).
                root = is_root or (forward_idx in self._root_outputs and forward_idx not in self._consumed)
                phase, module = (Phase.LOSS, None) if root else (Phase.BACKWARD, name)
                # The edge from the forward output lets locate name the module whose backward made it.
                ent = self._known.get(grad)
                ver = _version(grad)
                if ent is not None and ent[1] == ver and ver >= 0:
                    # The same gradient again (a residual add hands one tensor to both branches, a
                    # container returns its child's output): same values, derived, not read again.
                    raw = _Raw(phase, module, call, None, Role.GRAD_OUTPUT, grad, (forward_idx, ent[0]), None,
                               alias_of=ent[0])
                else:
                    raw = _Raw(phase, module, call, None, Role.GRAD_OUTPUT, grad, (forward_idx,), None)
                idx = self._new(raw, grad)
                self._known[grad] = (idx, ver)
                if self.stop_at_first:
                    self._check()
            finally:
                self._busy = False

        return hook

    def _grad_hook(self, p: torch.Tensor) -> None:
        self._accumulated = True
        g = p.grad
        if self._state != "running" or g is None or not _floatish(g):
            return
        self._busy = True
        try:
            owner = self._owner.get(p)
            ent = self._known.get(g)
            if ent is not None and ent[1] == _version(g):
                raw = _Raw(Phase.BACKWARD, owner, 0, None, Role.GRAD, g, (int(ent[0]),), None, alias_of=int(ent[0]))
            else:
                prev = () if ent is None else (int(ent[0]),)
                raw = _Raw(Phase.BACKWARD, owner, 0, None, Role.GRAD, g, prev, None)
            idx = self._new(raw, g)
            self._known[g] = (idx, _version(g))
        finally:
            self._busy = False


def trace(
    model: nn.Module | None = None,
    *,
    level: str = "op",
    stop_at_first: bool = False,
    allow: Iterable[str] = (),
    scope: Iterable[str] = (),
    full_stats: bool = False,
) -> Trace:
    """Observe everything run inside the block and find where the first NaN/Inf was born.

    Args:
        model: the model whose modules name the records (``named_modules()`` names).
            ``None`` traces ops only. A ``torch.compile``d model is traced through its
            eager original (with a warning).
        level: ``"op"`` records every aten op (forward, loss, backward, update);
            ``"module"`` records module boundaries and gradients only, for speed.
        stop_at_first: raise :class:`nanhunt.NonFiniteError` inside the op that
            created the first non-finite value, so a debugger lands there. Reads
            statistics back after every op: slow, for interactive use.
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

    Example::

        with nanhunt.trace(model) as t:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
        print(t.first)   # e.g. NaN born in phase forward, module encoder.1.fc ...
    """
    return Trace(model, level=level, stop_at_first=stop_at_first, allow=allow, scope=scope, full_stats=full_stats)
