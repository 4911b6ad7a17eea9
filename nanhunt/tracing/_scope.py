"""The scope gate of ``trace(scope=...)``: the dispatch mode is on the stack only while the scope
runs, so that every other op runs at full speed.

Forward: the outermost module call of the scope opens the gate and its return closes it (module
hooks). Backward: the nodes the scope's ops made get pre/post hooks that open it while they run
(autograd restores the thread's mode stack after every node, which closes it again).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._util import _dispatch
from ._ops import OpRecorder
from ._phases import PhaseTracker
from ._tensors import tensors

__all__ = ["ScopeGate", "in_scope"]

_peek_seq = _dispatch.peek_sequence_nr
_node_seq = _dispatch.node_sequence_nr
_grad_enabled = torch.is_grad_enabled


def in_scope(name: str, scope: Iterable[str]) -> bool:
    """Module ``name`` is one of ``scope`` or inside one ("" is the whole model)."""
    return any(name == s or s == "" or name.startswith(s + ".") for s in scope)


class ScopeGate:
    """Puts ``mode`` on the dispatch stack while the scope runs. ``mode`` is the trace's dispatch
    mode while the trace runs, ``None`` otherwise; hook handles go to ``handles``."""

    __slots__ = ("mode", "running", "opened", "hooked", "_ops", "_phases", "_handles")

    def __init__(self, ops: OpRecorder, phases: PhaseTracker, handles: list[Any]) -> None:
        self.mode: _dispatch.TraceMode | None = None
        self.running = False
        self.opened: list[bool] = []  # per scope entry, whether it put the mode on the stack
        self.hooked: set[int] = set()  # sequence numbers of the nodes given gate hooks
        self._ops = ops
        self._phases = phases
        self._handles = handles

    def enter(self) -> None:
        """The scope's outermost module call starts."""
        if self.mode is None:
            return
        self.opened.append(self.open())
        # Entering the scope: nodes made outside it must not be taken for this op's.
        self._ops.last_seq = _peek_seq()

    def leave(self, values: Any) -> None:
        """The scope's outermost module call returned ``values`` (its output, arguments, stashed tensors)."""
        if self.opened:
            self.close(self.opened.pop(), values)

    def open(self) -> bool:
        """Put the dispatch mode on the stack unless it is there; True when this call put it."""
        mode = self.mode
        if mode is None or not self.running or _dispatch.mode_on_stack(mode):
            return False
        _dispatch.push_mode(mode)
        return True

    def close(self, opened: bool, values: Any) -> None:
        """Leaving the scope: take the mode off the stack again and give the backward nodes the
        scope's ops made (reachable from its outputs, or from inputs it changed in place) gate hooks."""
        ops = self._ops
        seq = _peek_seq()
        ops.claim_nodes(ops.last_seq, seq)  # made after the scope's last op returned
        ops.last_seq = seq
        if opened and self.mode is not None:
            _dispatch.pop_mode(self.mode)
        if self.running:
            self.hook_nodes(tensors(values))

    def hook_nodes(self, values: Iterable[torch.Tensor]) -> None:
        """Pre/post hooks on the scope's not yet hooked backward nodes: the mode is on the stack
        while such a node runs (autograd restores the thread's mode stack after every node)."""
        seqmap, hooked = self._phases.nodes, self.hooked
        todo = [g for g in (t.grad_fn for t in values) if g is not None]
        while todo:
            node = todo.pop()
            seq = _node_seq(node)
            if seq in hooked or seq not in seqmap:
                continue  # done already, or made outside the scope
            hooked.add(seq)
            self._handles.append(node.register_prehook(self._node_enter))
            self._handles.append(node.register_hook(self._node_leave))
            todo.extend(f for f, _ in node.next_functions if f is not None)

    def _node_enter(self, grad_outputs: Any) -> None:
        # No pop in a post hook: the engine sums the node's gradients into the next nodes' inputs
        # after it (ops of this node too), and restores the thread's mode stack after each node.
        self.open()
        # Nodes made since this node's last op were made by ops outside the scope, unseen.
        self._ops.last_seq = _peek_seq()

    def _node_leave(self, grad_inputs: Any, grad_outputs: Any) -> None:
        if self.running and _grad_enabled():  # create_graph: this node's backward made nodes
            self.hook_nodes(g for g in grad_inputs if isinstance(g, torch.Tensor))
