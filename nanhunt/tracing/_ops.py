"""Op recording: every aten op the dispatch mode hands over becomes records of the floating
tensors it made or wrote, linked to the records of those it read.

This is the tracer's hot path (about a thousand ops per step of a small GPT): attributes are
bound to locals, the state of the other parts it reads is held here as the same objects, and
a view holding exactly its input's elements (half the ops) shares its input's record in the
first lines of :meth:`OpRecorder._on_op`.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
from collections.abc import Iterable, Sequence
from types import CodeType, FrameType
from typing import Any

import torch

from .._util import _dispatch
from ._casts import FLOAT8, measure_cast, note_operand, wrapper_links
from ._phases import NodeContext, PhaseTracker
from ._records_store import EXACT_CASTS, EXACT_DTYPES, STALE, Raw, RecordStore, Source
from ._tensors import FLOATISH, MAX_NEST, floatish, input_shapes, storage_key, tensors
from .._util._subclass import subclass_clone
from .._util._tree import map_tensors
from ._watch import NOT_USER, OriginWatch
from .locate import FACTORS, factor_negative
from ..records import Phase, Role
from .stats import full_stats

__all__ = ["OpRecorder", "read_tensors"]

_current_node = _dispatch.current_autograd_node
_node_seq = _dispatch.node_sequence_nr
_peek_seq = _dispatch.peek_sequence_nr
_in_recomputation = _dispatch.in_recomputation
_op_info = _dispatch.op_info
_version = _dispatch.tensor_version
_grad_enabled = torch.is_grad_enabled
_INFOS = _dispatch.OP_INFOS
_FORWARD = Phase.FORWARD
_LOSS = Phase.LOSS
_UPDATE = Phase.UPDATE
_SKIP_DIRS = NOT_USER  # torch's, nanhunt's, contextlib's and frozen frames: never the user's line


def _apply_caller() -> Source | None:
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


class OpRecorder:
    """The dispatch mode's handler (:meth:`_on_op`): records each op's outputs and inputs in
    ``store``, in the phase and module ``phases`` names.

    ``busy``: the tracer's own code runs (its hooks, its teardown): ops run unrecorded. ``scope``:
    module names; ops outside them run unrecorded. ``watch`` is handed every op's new records when
    it looks for origins while the step runs (``stop_at_first``, ``full_stats``).
    """

    __slots__ = ("busy", "scope", "last_seq", "catch", "caught", "_catch_seen", "_last_ctx", "_store", "_phases", "_watch",
                 "_watching", "_code_skip", "_raw", "_kd", "_known", "_writes", "_index_uses", "_zoom", "_stack",
                 "_updating", "_seqmap", "_draining", "_scanning")

    def __init__(self, store: RecordStore, phases: PhaseTracker, watch: OriginWatch, *,
                 scope: tuple[str, ...] = ()) -> None:
        self.busy = False
        self.scope = scope
        self.last_seq = -1  # the autograd sequence number after the last op seen
        # The culprit in a replay's second run, as the user sees it: (module, call, op, n), its record the n-th
        # (from 0) of that op in that call of that module. The call of the op that makes it is kept, its
        # arguments cloned before it ran, as ``caught`` (op, (args, kwargs), phase). Not a record index: a
        # wrapper's first call records more than the next (DDP rebuilds its buckets), so indices shift between runs.
        # (A record index also does, for a run that records as much as the one it came from.)
        self.catch: tuple[str | None, int, str, int] | int | None = None
        self._catch_seen = 0  # records of the catch's (module, call, op) made so far
        self.caught: tuple[Any, tuple[tuple[Any, ...], dict[str, Any]], Phase] | None = None
        self._last_ctx: NodeContext | None = None  # the last op's
        self._store = store
        self._phases = phases
        self._watch = watch
        self._watching = watch.window is not None or watch.stop_at_first
        self._code_skip: dict[CodeType, bool] = {}
        # The parts' state read on every op, held as the same objects (never rebound by their owners).
        self._raw = store.raws
        self._kd = store.kd
        self._known = store.known
        self._writes = store.writes
        self._index_uses = store.index_uses
        self._zoom = store.zoom
        self._stack = phases.stack
        self._updating = phases.updating
        self._seqmap = phases.nodes
        # While a collective's own wait runs ops (see _collective): (its name, the records it sent).
        self._draining: tuple[str, tuple[int, ...]] | None = None
        # The op whose arguments are being scanned: (its info, its args)
        self._scanning: tuple[_dispatch.OpInfo, tuple[Any, ...]] | None = None

    def _on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one aten op and record what it read and made."""
        if self.busy:
            return func(*args, **kwargs)
        node = _current_node()
        if self.scope and (not self._stack if node is None else not self._phases.recompute_depth and (
                _node_seq(node) not in self._seqmap
                # a checkpointed block recomputing ops of its own outside the scope, inside a scope node
                or (_grad_enabled() and _in_recomputation()))):
            return func(*args, **kwargs)  # outside the scope: not recorded
        info = _INFOS.get(id(func))  # OpOverload hashes in Python: key by identity
        if info is None:
            info = _op_info(func)
        run = info.run
        kd = self._kd
        if info.same_set_view and (node is None or self._phases.backward_seen):
            # Fast path, half the ops: a view holding exactly the elements of a tensor whose record is current
            # shares it. Nothing to measure or attribute unless it makes a node (the general path keeps its context).
            a: torch.Tensor = args[0]
            e = kd.get(id(a))
            if e is not None and e[0]() is a:
                try:  # inline, not _dispatch.tensor_version: no call on this path (~0.1% of a traced step)
                    ver = a._version
                except RuntimeError:
                    ver = -1
                rec = e[1]
                if rec[1] == ver and ver >= 0 and (
                        (node is not None and not _grad_enabled()) or _peek_seq() == self.last_seq):
                    out = run(*args, **kwargs)
                    if isinstance(out, torch.Tensor) and out.dtype in FLOATISH:
                        kd[id(out)] = (weakref.ref(out), (rec[0], ver))
                    return out
        module: str | None
        src: Source | None
        if node is None and self._stack and not self._updating:  # forward inside a module: inline
            module, call = self._stack[-1]
            phase, src, want_src = _FORWARD, None, True
        else:
            phase, module, call, src, want_src = self._phases.context(node)
        new_node = False
        seq = first_seq = 0
        # Forward ops make nodes; so do backward ops under create_graph (double backward).
        if node is None or _grad_enabled():
            seq = _peek_seq()
            if seq != self.last_seq:
                first_seq, self.last_seq = self.last_seq, seq
                new_node = True
        if info.constant:
            return self._constant(func, args, kwargs, phase, module, call, want_src)
        if info.collective is not None:
            return self._collective(info, args, kwargs, phase, module, call, want_src)
        ins: list[int] = []
        self._scanning = (info, args)
        try:
            if info.write_only_args or info.write_only_kwargs:  # out=, copy_'s destination: not inputs
                scalar = self._scan_read(info, args, kwargs, ins, phase, module, call)
            else:
                scalar = self._scan(args, ins, phase, module, call, None)
                if kwargs:
                    scalar = self._scan(kwargs.values(), ins, phase, module, call, scalar)
        finally:
            self._scanning = None
        if new_node and phase is _UPDATE and not self._phases.in_update() and self._phases.from_forward(ins):
            # Differentiable work on the forward's values after a backward, outside optimizer.step():
            # a second loss (backward(retain_graph=True) ran first), not an update (an EMA reads weights).
            phase = _LOSS
        if want_src and (new_node or ins):
            src = self._source()
        if new_node:
            self._node_made(first_seq, seq, module, call, src)
        else:
            self._last_ctx = (module, call, src)
        if self.catch is not None:
            return self._catching(func, info, args, kwargs, ins, phase, module, call, src, scalar, node)
        out = run(*args, **kwargs)
        if info.same_set_view and ins and isinstance(out, torch.Tensor) and out.dtype in FLOATISH:
            self._known[out] = (ins[0], _version(args[0]) if isinstance(args[0], torch.Tensor) else _version(out))
            return out
        self._outputs(info, args, kwargs, out, ins, phase, module, call, src, scalar, node)
        return out

    def _catching(self, func: Any, info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any],
                  ins: list[int], phase: Phase, module: str | None, call: int, src: Source | None,
                  scalar: str | None, node: Any) -> Any:
        """The rest of :meth:`_on_op` while a culprit is to be caught: a call of the culprit's op in the culprit's
        module call whose outputs may include the culprit's record has its arguments cloned before it runs (an
        in-place op overwrites them), and kept when it did make that record."""
        catch = self.catch
        start = len(self._raw)
        before = self._catch_seen
        first = args[0] if args else None
        n = 8 + (len(first) if isinstance(first, (list, tuple)) else 0)  # a fused op's outputs: one per tensor
        if isinstance(catch, int):  # a record index: of a run of the same step that recorded as much
            match, nth = start <= catch < start + n, catch - start
        else:
            assert catch is not None
            match = module == catch[0] and call == catch[1] and info.name == catch[2]
            nth = catch[3] - before
        saved = _cloned((args, kwargs)) if match and 0 <= nth < n else None
        out = info.run(*args, **kwargs)
        if info.same_set_view and ins and isinstance(out, torch.Tensor) and out.dtype in FLOATISH:
            self._known[out] = (ins[0], _version(args[0]) if isinstance(args[0], torch.Tensor) else _version(out))
            return out
        outs = self._outputs(info, args, kwargs, out, ins, phase, module, call, src, scalar, node)
        if match:
            made = len(self._raw) - start  # each of its records has the op's context
            self._catch_seen = before + made
            if saved is not None and nth < made:
                self.caught = (func, saved, phase)
                self.catch = None
                if not isinstance(catch, int):
                    self._zoom_caught(info, saved, ins, start + nth, outs[nth])
        return out

    def _zoom_caught(self, info: _dispatch.OpInfo, saved: tuple[tuple[Any, ...], dict[str, Any]], ins: list[int],
                     idx: int, made: torch.Tensor) -> None:
        """The culprit caught by its key measured in full, as ``zoom`` measures records by index: its output,
        the inputs it read (their values as the op read them: the clones taken before it ran) and their shapes.
        By key, not by the first run's indices, which shift when a wrapper records more in one run (DDP)."""
        raws = self._raw
        raws[idx].full = full_stats(made)
        args, kwargs = saved
        raws[idx].in_shapes = input_shapes(args, kwargs)
        for i, t in zip(ins, read_tensors(info, args, kwargs)):
            if raws[i].full is None:
                raws[i].full = full_stats(t)

    def _node_made(self, first: int, seq: int, module: str | None, call: int, src: Source | None) -> None:
        """The op running made autograd node ``seq - 1``: it is this op's, with the line that made it;
        the nodes before it since the previous op (``first``..) are that op's (:meth:`claim_nodes`)."""
        node_src = src
        if not _grad_enabled():
            # A node made while grad mode is off is a custom Function's, created by
            # .apply() before its forward ran this op: its line is the apply call.
            node_src = _apply_caller() or src
        last = self._last_ctx
        if last is not None and 0 < seq - 1 - first <= 4:
            seqmap = self._seqmap
            for s in range(first, seq - 1):
                seqmap[s] = last
        ctx = (module, call, node_src)
        self._seqmap[seq - 1] = ctx
        self._last_ctx = ctx

    def claim_nodes(self, first: int, end: int) -> None:
        """Nodes ``first``..``end-1`` were made after the last op seen had returned: autograd gives an
        in-place op on a view CopySlices for the base and a new node for the view then. They are
        that op's. A longer run means ops unseen: left unattributed."""
        if self._last_ctx is not None and 0 < end - first <= 4:
            for s in range(first, end):
                self._seqmap[s] = self._last_ctx

    def _outputs(self, info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                 ins: list[int], phase: Phase, module: str | None, call: int, src: Source | None,
                 scalar: str | None, node: Any) -> Sequence[torch.Tensor]:
        """Record an op's new values: its floating outputs (distinct) and the arguments it wrote; return those
        tensors, one per record made, in order."""
        outs, written_ids, hidden_ids = self._new_values(info, args, kwargs, out, ins)
        if not outs:
            return ()
        raws = self._raw
        # A view of uninitialised memory is no value either, until something writes it; a
        # partial write (index_put_, a slice copy) leaves some of it unwritten: still no value,
        # measured again when read (``STALE``).
        blank = info.uninitialised or (info.is_view and any(raws[i].blank for i in ins))
        partial = bool(written_ids) and not info.write_only_args and bool(ins) and raws[ins[0]].blank
        # A copy (clone, cast, copy_) holds its source's values: derive, don't measure.
        copy_of = ins[info.copy_of] if info.copy_of is not None and len(ins) == info.copy_of + 1 else None
        if copy_of is not None and raws[copy_of].dtype not in EXACT_CASTS:
            copy_of = None  # float64 sources round twice, float8 targets are not emulated: measure
        inputs = tuple(ins)
        new: list[int] = []
        view_version = _version(args[0]) if info.is_view and args and isinstance(args[0], torch.Tensor) else None
        kd = self._kd
        store = self._store
        # a fused op's i-th output comes from the i-th tensors: P inputs each, not P x P (read before the
        # outputs of an in-place one replace its inputs' records)
        fused = _fused_inputs(args, out, kd) if info.fused else None
        # a negative factor (add's alpha, mul by -2) may turn a -inf input into +inf: said to the origin rule
        negated = info.name in FACTORS and factor_negative(info.name, args, kwargs)
        # a cast to float8 (torchao's float8 training): what it lost is measured from its input and output
        cast_from = _cast_source(info, args) if info.copy_of is not None and outs[0].dtype in FLOAT8 else None
        for o in outs:
            oid = id(o)
            alias = copy_of if copy_of is not None and o.dtype in EXACT_DTYPES else None
            own = inputs if fused is None else fused.get(oid, inputs)
            raw = Raw(phase, module, call, info.name, Role.OUTPUT, o, own, src, scalar, alias)
            is_written = oid in written_ids
            if blank or partial:
                raw.blank = (blank and (info.uninitialised or not is_written)) or (partial and is_written)
            idx = store.add(raw, o)
            if negated:
                store.negated.add(idx)
            if cast_from is not None and o.dtype in FLOAT8 and (cast := measure_cast(cast_from, o)) is not None:
                raw.cast = cast
                store.casts.append(cast)
            if idx in self._zoom:
                raw.in_shapes = input_shapes(args, kwargs)
            # A view shares its base's version counter, but only once this mode has returned.
            ver = view_version if view_version is not None else _version(o)
            if is_written:
                # The autograd layer bumps the version of a written tensor after this mode returns.
                ver = ver + 1 if ver >= 0 else ver
                key = storage_key(o)
                self._writes[key] = idx
                if raw.blank or info.uninitialised:
                    ver = STALE
                writes_since = store.fresh.get(key)
                if writes_since is not None:
                    writes_since.append(idx)
            elif oid in hidden_ids:
                self._writes[storage_key(o)] = idx  # written in place, version untouched
            if info.uninitialised and not is_written:
                store.fresh[storage_key(o)] = []  # what is written into it from now on
            kd[oid] = (weakref.ref(o), (idx, ver))
            new.append(idx)
        if self._watching:
            self._watch.hold(new, args, kwargs, outs, node)
        return outs

    def _new_values(self, info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                    ins: list[int]) -> tuple[list[torch.Tensor], Sequence[int], Sequence[int]]:
        """``(tensors, ids written, ids written in place with the version untouched)``: what an op that writes
        an argument wrote (:func:`_written`), else its floating outputs, each once. An op whose outputs are all
        integers (an index, a mask) made no value: its inputs are marked as used by one."""
        if info.writes:
            return _written(info, args, kwargs, out)
        outs: list[torch.Tensor] = []
        if isinstance(out, torch.Tensor):
            outs = [out] if out.dtype in FLOATISH else []
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor) and o.dtype in FLOATISH and not any(o is p for p in outs):
                    outs.append(o)
        else:
            return [], (), ()
        if not outs:
            self._index_uses.update(ins)
        return outs, (), ()

    def _constant(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], phase: Phase,
                  module: str | None, call: int, want_src: bool) -> Any:
        """A tensor literal (``torch.tensor(nan)``, ``x[i] = inf``): recorded like a Python scalar
        argument, a value the code wrote down, never an origin."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and floatish(out):
            src = self._source(4) if want_src else None
            raw = Raw(phase, module, call, _op_info(func).name, Role.OUTPUT, out, (), src)
            raw.constant = True
            idx = self._store.add(raw, out)
            self._known[out] = (idx, _version(out))
        return out

    def _collective(self, info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], phase: Phase,
                    module: str | None, call: int, want_src: bool) -> Any:
        """A collective (all-reduce, all-gather, reduce-scatter, broadcast, ...): what it writes holds
        values that arrived from other ranks, recorded as :attr:`Role.RECEIVED` (never an origin on this
        rank) once they are there: an asynchronous collective is waited for first, else the values
        measured would be those from before it.

        A ``Work``'s wait may run ops of its own, and on every wait: gloo's reduce-scatter reduces a
        clone of its input made inside the op, and each wait copies this rank's chunk out of it. That
        wait runs here under a mode of this recorder, so the clone is recorded as received (and as the
        last write into its memory): the caller's own wait, whenever it comes, reads a known buffer,
        never an unknown tensor that would pass for one entering the step."""
        ins: list[int] = []
        self._scan([args[i] for i in info.read_args if i < len(args)], ins, phase, module, call, None)
        out = info.run(*args, **kwargs)
        if not info.received_args:  # functional: the wait is an op of its own, run unrecorded
            _dispatch.complete_collective(out, functional=True)
        else:
            mode = _dispatch.TraceMode(self._on_op)
            self._draining = (info.name, tuple(ins))
            _dispatch.push_mode(mode)
            try:
                _dispatch.complete_collective(out, functional=False)
            finally:
                _dispatch.pop_mode(mode)
                self._draining = None
        got: list[torch.Tensor] = []
        for i in info.received_args:
            if i < len(args):
                got.extend(tensors(args[i], MAX_NEST - 3))
        got.extend(tensors(out, MAX_NEST - 3))
        for k in info.written_kwargs:
            got.extend(tensors(kwargs.get(k), MAX_NEST - 1))
        # what it sent too: some backends reduce in place in the send buffer (gloo's reduce-scatter)
        for i in info.read_args:
            if i < len(args) and i not in info.received_args:
                got.extend(tensors(args[i], MAX_NEST - 3))
        src = self._source(4) if want_src else None
        seen_ids: set[int] = set()
        inputs = tuple(ins)
        for t in got:
            if id(t) in seen_ids or not floatish(t):
                continue
            seen_ids.add(id(t))
            raw = Raw(phase, module, call, info.name, Role.RECEIVED, t, inputs, src)
            idx = self._store.add(raw, t)
            self._known[t] = (idx, _version(t))
            self._writes[storage_key(t)] = idx
        return out

    def _scan(self, values: Iterable[Any], ins: list[int], phase: Phase, module: str | None, call: int,
              scalar: str | None) -> str | None:
        """Append the records of the floating tensors in ``values``; return the non-finite scalar seen."""
        lookup = self.lookup
        kd = self._kd
        for a in values:
            if isinstance(a, torch.Tensor):
                if a.dtype in FLOATISH:
                    e = kd.get(id(a))
                    if e is not None and e[0]() is a:  # known: current unless written since
                        rec = e[1]
                        ver = _version(a)
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
                        if floatish(b):
                            ins.append(lookup(b, phase, module, call))
                    elif isinstance(b, float) and not math.isfinite(b):  # per-tensor scalars (foreach)
                        scalar = "nan" if b != b else (scalar or "inf")
        return scalar

    def _scan_read(self, info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], ins: list[int],
                   phase: Phase, module: str | None, call: int) -> str | None:
        """:meth:`_scan` of the arguments an op reads (not those it only writes)."""
        scalar = self._scan([a for i, a in enumerate(args) if i not in info.write_only_args],
                            ins, phase, module, call, None)
        return self._scan([v for k, v in kwargs.items() if k not in info.write_only_kwargs],
                          ins, phase, module, call, scalar)

    def lookup(self, t: torch.Tensor, phase: Phase, module: str | None, call: int) -> int:
        """The record that holds ``t``'s current values, measuring it when unknown or changed."""
        store = self._store
        ent = self._known.get(t)
        ver = _version(t)
        if ent is not None:
            if ent[1] == ver and (ver >= 0 or store.unwritten_since(t, ent[0])):
                return int(ent[0])
            # Changed in place, perhaps through a view: link the last write into its storage. Uninitialised
            # memory written through views (in part, perhaps): what was never written is read too.
            key = storage_key(t)
            w = self._writes.get(key)
            links: tuple[int, ...] = (int(ent[0]),) if w is None or w == ent[0] else (int(ent[0]), w)
            role = Role.REMEASURED
            prior = int(ent[0])
            writes_since = store.fresh.get(key)
            raws = store.raws
            # The allocation itself is the tensor's record (every write since went through views), each write
            # since was measured (a partial write into blank memory is not: it may have written non-finite
            # values), and the op reads its values: what was never written is read too.
            if (writes_since is not None and raws[prior].blank and prior not in writes_since
                    and not any(raws[i].blank for i in writes_since) and self._reads_values(t)):
                role = Role.UNWRITTEN
                links = (prior, *writes_since)
            raw = Raw(phase, module, call, None, role, t, links, None)
        elif not _dispatch.is_plain(t) and (links := wrapper_links(t, self._known)):
            # A tensor subclass made from values the trace knows, by no op (a float8 wrapper of a cast's data
            # and its scale): those values are its inputs. Its values are what it stands for.
            raw = Raw(phase, module, call, None, Role.OUTPUT, t, links, None)
            note_operand(t, store.raws, self._known)
        elif self._draining is not None:
            # Read by a collective's own wait: a buffer of the collective's, holding what arrived (whatever
            # an earlier, freed tensor at its address was).
            raw = Raw(phase, module, call, self._draining[0], Role.RECEIVED, t, self._draining[1], None)
        elif (w := _received_into(store, self._writes.get(storage_key(t)))) is not None:
            # A new view of a buffer a collective wrote into (DDP's bucket, gloo's reduce-scatter clone), or
            # a buffer read right after a collective, before any other op: it holds what arrived from other ranks.
            raw = Raw(phase, module, call, None, Role.REMEASURED, t, (w,), None)
        elif self.scope:
            # Made outside the scope (or before the step): it enters the scope here.
            raw = Raw(phase, module, call, None, Role.INPUT, t, (), None)
        elif phase is Phase.BACKWARD:
            # Never seen in this step: state from before it (a stale .grad being accumulated into).
            raw = Raw(phase, module, call, None, Role.STATE, t, (), None)
        elif phase is _UPDATE:
            raw = Raw(phase, None, 0, None, Role.STATE, t, (), None)
        else:
            raw = Raw(Phase.INPUT, module, call, None, Role.INPUT, t, (), None)
        idx = store.add(raw, t)
        self._known[t] = (idx, ver)
        if raw.role is Role.RECEIVED:
            self._writes[storage_key(t)] = idx  # a later wait's new view of it finds it received
        return idx

    def _reads_values(self, t: torch.Tensor) -> bool:
        """Whether the op whose arguments are being scanned reads ``t``'s values: not a view of it (a slice to
        write through), not a copy (a clone carries what it holds, written later perhaps), not an in-place op
        that overwrites it in part or whole (it keeps what it does not overwrite, reading none of it as a value:
        ``index_put_``, ``masked_fill_``, ``copy_``...; ``mul_`` and ``add_`` do read it)."""
        if self._scanning is None:
            return False
        info, args = self._scanning
        if info.is_view or info.copy_of is not None:
            return False
        if info.name not in _OVERWRITES:
            return True
        return not any(t is w for i in info.written_args if i < len(args) for w in tensors(args[i], MAX_NEST - 1))

    def _source(self, depth: int = 3) -> Source | None:
        """The innermost frame outside torch and nanhunt: the user's line that ran the op.
        ``depth``: frames to skip (this one, the recorder's, the mode's)."""
        f: FrameType | None = sys._getframe(depth)
        skip_cache = self._code_skip
        while f is not None:
            code = f.f_code
            skip = skip_cache.get(code)
            if skip is None:
                fn = code.co_filename
                skip = skip_cache[code] = fn.startswith(_SKIP_DIRS)
            if not skip:
                return (code.co_filename, f.f_lineno, code.co_name)
            f = f.f_back
        return None


# In-place ops whose written argument's old values are kept or replaced, never combined into the new ones.
_OVERWRITES = frozenset(f"aten::{n}" for n in (
    "copy_", "fill_", "zero_", "index_put_", "_index_put_impl_", "index_copy_", "index_fill_", "masked_fill_",
    "masked_scatter_", "scatter_", "put_", "set_", "resize_", "uniform_", "normal_", "bernoulli_", "random_",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "fill_diagonal_", "slice_scatter", "select_scatter"))


def _cast_source(info: _dispatch.OpInfo, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The tensor a copy op casts from (``_to_copy``'s input, ``copy_``'s source), when it is not float8."""
    if info.copy_of is None:
        return None
    src = args[1] if info.write_only_args and len(args) > 1 else args[0] if args else None
    return src if isinstance(src, torch.Tensor) and src.dtype in FLOATISH and src.dtype not in FLOAT8 else None


def _received_into(store: RecordStore, written: int | None) -> int | None:
    """The collective's record an unknown tensor holds the values of: the last write into its
    storage, or else the last record made, when a collective made it; else ``None``."""
    raws = store.raws
    if written is not None:
        return written if raws[written].role is Role.RECEIVED else None
    return raws[-1].index if raws and raws[-1].role is Role.RECEIVED else None


def _written(info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any],
             out: Any) -> tuple[list[torch.Tensor], list[int], Sequence[int]]:
    """An op that writes arguments: its distinct floating outputs and written tensors, the ids of
    those the schema says it writes and of those it writes without saying (batch norm's running
    statistics, while training)."""
    outs: list[torch.Tensor] = []
    if isinstance(out, torch.Tensor):
        outs.append(out)
    elif isinstance(out, (tuple, list)):
        outs.extend(o for o in out if isinstance(o, torch.Tensor))
    written: list[torch.Tensor] = []
    for i in info.written_args:
        if i < len(args):
            written.extend(tensors(args[i], MAX_NEST - 1))
    for k in info.written_kwargs:
        written.extend(tensors(kwargs.get(k), MAX_NEST - 1))
    outs.extend(written)
    hidden_ids: Sequence[int] = ()
    if info.hidden_writes and len(args) > 5 and args[5] is True:
        hidden = [args[i] for i in info.hidden_writes if isinstance(args[i], torch.Tensor)]
        outs.extend(hidden)
        hidden_ids = [id(h) for h in hidden]
    unique: list[torch.Tensor] = []
    seen_ids: set[int] = set()
    for o in outs:
        if id(o) not in seen_ids and o.dtype in FLOATISH:
            seen_ids.add(id(o))
            unique.append(o)
    return unique, [id(w) for w in written], hidden_ids


def read_tensors(info: _dispatch.OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The floating tensors an op reads, in the order :meth:`OpRecorder._scan` records them (the op's ``ins``)."""
    write_only = bool(info.write_only_args or info.write_only_kwargs)
    values = [*(a for i, a in enumerate(args) if not (write_only and i in info.write_only_args)),
              *(v for k, v in kwargs.items() if not (write_only and k in info.write_only_kwargs))]
    out: list[torch.Tensor] = []
    for a in values:
        if isinstance(a, torch.Tensor):
            if a.dtype in FLOATISH:
                out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, torch.Tensor) and floatish(b))
    return out


def _cloned(obj: Any) -> Any:
    """``obj`` with every tensor inside cloned (detached), containers kept (a tensor subclass through its own clone
    or its inner tensors)."""
    return map_tensors(obj, lambda t: t.detach().clone() if _dispatch.is_plain(t) else subclass_clone(t.detach()))


def _fused_inputs(args: tuple[Any, ...], out: Any, kd: dict[int, Any]) -> dict[int, tuple[int, ...]]:
    """For a fused multi-tensor op: each output tensor (by id) -> the records of the tensors at its position
    in every list argument, and of the shared tensor arguments (a scale, found_inf). An output at no position
    (GradScaler's found_inf) keeps all the op's inputs."""
    def rec(t: Any) -> int | None:
        e = kd.get(id(t)) if isinstance(t, torch.Tensor) else None
        return int(e[1][0]) if e is not None and e[0]() is t else None

    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return {}
    shared = tuple(i for i in (rec(a) for a in args if isinstance(a, torch.Tensor)) if i is not None)
    per = [tuple(i for i in (rec(lst[k]) for lst in lists if k < len(lst)) if i is not None) + shared
           for k in range(len(lists[0]))]
    made = out if isinstance(out, (list, tuple)) and len(out) == len(per) else ()
    result = {id(t): per[k] for lst in lists for k, t in enumerate(lst) if k < len(per)}  # every written list
    result.update({id(t): per[k] for k, t in enumerate(made) if isinstance(t, torch.Tensor)})
    return result
