"""Which phase of the step runs (forward, loss, backward, update) and in which module call.

:class:`PhaseTracker` is told of module calls (``enter``/``leave``), of ``optimizer.step()``
(``step_enter``/``step_leave``, torch's global step hooks) and of gradients accumulated into
parameters; ``context(node)`` then names the phase, module and call of the op running now, given
the autograd node running it (``None`` outside backward). Backward work belongs to the forward
module whose op made the node: ``nodes`` holds that context by the node's sequence number. A
module call inside backward (``reenter``) is torch.utils.checkpoint recomputing a forward: it
repeats the calls of that forward in order, so it takes their call indices, nested checkpoints too.

Some phases are known only later: ops between two model calls were loss until the next call
shows they made its arguments (forward glue, :meth:`PhaseTracker.glue_to_forward`). A stop
(``stop_at_first``) in such an op waits for that answer (:meth:`PhaseTracker.still_open`).
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import torch

from .._util import _dispatch
from ._records_store import RecordStore, Source
from ._tensors import TensorMap
from ..records import Phase, Role

__all__ = ["PhaseTracker", "StepRun", "Context", "NodeContext"]

# phase, module, call index, source line (a backward op: its forward op's), whether the op's own line is wanted
Context = tuple[Phase, str | None, int, Source | None, bool]
NodeContext = tuple[str | None, int, Source | None]  # the forward module, call and line that made a node

_current_node = _dispatch.current_autograd_node
_node_seq = _dispatch.node_sequence_nr
_peek_seq = _dispatch.peek_sequence_nr
_checkpoint_frames = _dispatch.checkpoint_frames
_grad_enabled = torch.is_grad_enabled
_FORWARD = Phase.FORWARD
_LOSS = Phase.LOSS
_UPDATE = Phase.UPDATE
_BACKWARD = Phase.BACKWARD


class StepRun:
    """One ``optimizer.step()`` running: whether it began inside a backward node (a post-accumulate-grad
    hook stepping), the module depth then, the first record it made, and whether a module was called
    since at that depth (a closure: its forward, loss and backward are no update)."""

    __slots__ = ("in_node", "depth", "start", "closure")

    def __init__(self, in_node: bool, depth: int, start: int) -> None:
        self.in_node, self.depth, self.start = in_node, depth, start
        self.closure = False


class PhaseTracker:
    """The phase state machine of one step, over the records of ``store``.

    ``stack``, ``updating`` and ``nodes`` are read on the op path directly (the same objects for
    the whole trace: never rebound).
    """

    __slots__ = ("store", "stack", "calls", "log_seqs", "log", "regions", "replays", "recompute_depth",
                 "forward_seen", "backward_seen", "accumulated", "updating", "step_spans", "loss_mark", "nodes",
                 "owners")

    def __init__(self, store: RecordStore) -> None:
        self.store = store
        self.stack: list[tuple[str, int]] = []  # module calls running: (name, call index)
        self.calls: dict[str, int] = {}  # calls made, per module
        # Every module call in the order it began, with the autograd sequence number then: a reentrant checkpoint's
        # node is made just before its function runs, so its calls are the first ones after the node's number.
        self.log_seqs: list[int] = []
        self.log: list[tuple[str, int]] = []
        # A non-reentrant checkpoint's frame -> the calls made while its forward ran (nested ones included)
        self.regions: weakref.WeakKeyDictionary[Any, list[tuple[str, int]]] = weakref.WeakKeyDictionary()
        # A recomputation running -> [its identity, the calls it repeats, the position of its next call]
        self.replays: dict[Any, list[Any]] = {}
        self.recompute_depth = 0  # module calls entered inside backward (torch.utils.checkpoint)
        self.forward_seen = False
        self.backward_seen = False
        self.accumulated = False  # a backward filled some .grad (autograd.grad alone does not)
        self.updating: list[StepRun] = []  # optimizer steps running
        self.step_spans: list[tuple[int, int]] = []  # record index ranges made inside optimizer steps
        self.loss_mark = 0  # loss records from this index on are pending: glue or loss, the next call tells
        self.nodes: dict[int, NodeContext] = {}  # autograd node sequence nr -> the forward context that made it
        self.owners: TensorMap[str] = TensorMap()  # parameter -> its module's name

    # -------------------------------------------------------- optimizer.step()
    def step_enter(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.updating.append(StepRun(_current_node() is not None, len(self.stack), len(self.store.raws)))

    def step_leave(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.updating:
            self.step_spans.append((self.updating.pop().start, len(self.store.raws)))

    def in_update(self) -> bool:
        """An optimizer step's own ops run (not a closure's forward, loss and backward inside it)."""
        u = self.updating
        return bool(u) and not u[-1].closure and len(self.stack) <= u[-1].depth

    @staticmethod
    def open_phase(phase: Phase) -> bool:
        """Records in ``phase`` may turn forward glue (:meth:`glue_to_forward`) when a later module call takes them."""
        return phase is _LOSS or phase is _UPDATE

    def still_open(self, phase: Phase) -> bool:
        """A record made now in ``phase`` may still turn forward glue, when a later module call takes what it
        made: loss or update work outside backward and outside an optimizer step."""
        return self.open_phase(phase) and not self.in_update() and _current_node() is None

    def grad_accumulated(self) -> None:
        """A backward filled a parameter's ``.grad``: ops after it outside a module are update."""
        self.accumulated = True

    # ------------------------------------------------------------- the op now
    def context(self, node: Any) -> Context:
        """Phase, module, call index and (for backward) the forward source line of the current op."""
        if node is not None:
            if self.updating and self.updating[-1].in_node and self.in_update():  # stepped by a backward hook
                return _UPDATE, None, 0, None, True
            if not self.backward_seen:
                self.backward_seen = True
                self.loss_mark = len(self.store.raws)
            if self.recompute_depth and self.stack:
                # A forward recomputed during backward: it belongs to the module running it.
                name, call = self.stack[-1]
                return _BACKWARD, name, call, None, True
            ctx = self.nodes.get(_node_seq(node))
            if ctx is not None:
                return _BACKWARD, ctx[0], ctx[1], ctx[2], False
            var = getattr(node, "variable", None)  # AccumulateGrad: the parameter it fills
            owner = self.owners.get(var) if isinstance(var, torch.Tensor) else None
            return _BACKWARD, owner, 0, None, False
        if self.updating and self.in_update():  # optimizer.step(), also run from a module's forward
            return _UPDATE, None, 0, None, True
        if self.stack:
            name, call = self.stack[-1]
            return _FORWARD, name, call, None, True
        if self.accumulated:  # after a backward that filled .grad (autograd.grad alone does not)
            return _UPDATE, None, 0, None, True
        if self.forward_seen:
            return _LOSS, None, 0, None, True
        return _FORWARD, None, 0, None, True  # glue code before the model: no module

    # ----------------------------------------------------------- module calls
    def enter(self, name: str) -> tuple[int, tuple[Phase, ...]]:
        """A module's forward call starts: its call index, and the phases of records made since the
        last call (or backward) that, when they made its arguments, were forward glue."""
        upd = self.updating
        if upd and not upd[-1].closure and len(self.stack) == upd[-1].depth:
            upd[-1].closure = True  # a closure (LBFGS): its forward, loss and backward are no update
        # A new step (or micro-batch) starts; a forward under no_grad (an eval, a teacher) does not.
        new_step = self.accumulated and _grad_enabled()
        if new_step:
            self.accumulated = self.backward_seen = False
        # What made this call's arguments since the last call (or backward) was forward glue, not
        # loss or update; the rest of the ops pending as loss were the last call's loss.
        glue = (_UPDATE, _LOSS) if new_step else (_LOSS,) if self.store.last_loss >= self.loss_mark else ()
        self.loss_mark = len(self.store.raws)
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        self.stack.append((name, call))
        self.forward_seen = True
        if self.replays:
            self.replays.clear()  # the recomputations of the last backward are over
        self._logged(name, call, _checkpoint_frames()[0])
        return call, glue

    def reenter(self, name: str, node: Any) -> int:
        """A module call inside backward (``node`` runs): torch.utils.checkpoint recomputing a forward
        call, the same call again, not a new one. A recomputation repeats its forward's module calls in
        order; the innermost one running names which: a non-reentrant checkpoint's by its frame, a
        reentrant one's by its node (``node``)."""
        opened, recomputing = _checkpoint_frames()
        if recomputing is not None:
            key: Any = id(recomputing[0])  # its pack hook, made for this recomputation
            rep = self.replays.get(key)
            if rep is None or rep[0] is not recomputing[0]:
                rep = self.replays[key] = [recomputing[0], self.regions.get(recomputing[1], []), 0]
        else:
            seq = _node_seq(node)
            key = (seq, _dispatch.graph_task_id())  # a retained graph's second backward recomputes anew
            rep = self.replays.get(key)
            if rep is None:
                rep = self.replays[key] = [key, self.log, bisect_right(self.log_seqs, seq)]
        calls: list[tuple[str, int]] = rep[1]
        pos: int = rep[2]
        if pos < len(calls) and calls[pos][0] == name:
            call = calls[pos][1]
            rep[2] = pos + 1
        else:  # not the call its forward made here (its code took another branch): the module's last call
            call = max(self.calls.get(name, 1) - 1, 0)
        self.stack.append((name, call))
        self.recompute_depth += 1
        self._logged(name, call, opened)
        return call

    def _logged(self, name: str, call: int, opened: list[Any]) -> None:
        """Note a module call for the recomputations that will repeat it (``opened``: the non-reentrant
        checkpoint frames whose forward runs now)."""
        self.log_seqs.append(_peek_seq())
        self.log.append((name, call))
        regions = self.regions
        for frame in opened:
            calls = regions.get(frame)
            if calls is None:
                regions[frame] = [(name, call)]
            else:
                calls.append((name, call))

    def leave(self, name: str) -> tuple[int, bool] | None:
        """A module call returns: its call index and whether it ran inside backward (a recomputation);
        ``None`` when ``name`` is not the call on top (a hook of another trace's, a call entered before)."""
        stack = self.stack
        if not stack or stack[-1][0] != name:
            return None
        _, call = stack.pop()
        in_backward = _current_node() is not None
        if in_backward and self.recompute_depth:
            self.recompute_depth -= 1
        return call, in_backward

    # ---------------------------------------------------- phases found later
    def from_forward(self, ins: Sequence[int]) -> bool:
        """Some of the records ``ins`` are values the forward or the loss computed."""
        raws = self.store.raws
        return any(raws[i].role is Role.OUTPUT and raws[i].phase in (_FORWARD, _LOSS) for i in ins)

    def glue_to_forward(self, ins: Sequence[int], phases: tuple[Phase, ...]) -> None:
        """A module call after a backward (``phases`` update and loss) or after a model call (loss):
        the ops since then that made its arguments (the next micro-batch's preprocessing) were
        forward glue; what entered them, input. An optimizer step's own ops stay update (it may
        train the model's input)."""
        store = self.store
        raws = store.raws
        todo = [i for i in ins if raws[i].phase in phases]
        seen: set[int] = set()
        steps = self.step_spans
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
            store.forget(i)
            todo.extend(j for j in r.inputs if raws[j].phase in phases)
