"""The scope gate on its own: it puts the dispatch mode on the stack while the scope runs, forward
(entered and left by module hooks) and backward (hooks on the nodes the scope made)."""

from __future__ import annotations

from typing import Any

import torch

from nanhunt._util import _dispatch
from nanhunt.tracing._ops import OpRecorder
from nanhunt.tracing._phases import PhaseTracker
from nanhunt.tracing._records_store import RecordStore
from nanhunt.tracing._scope import ScopeGate, in_scope
from nanhunt.tracing._watch import OriginWatch


def _gate() -> tuple[ScopeGate, OpRecorder, PhaseTracker, list[Any]]:
    store = RecordStore()
    phases = PhaseTracker(store)
    ops = OpRecorder(store, phases, OriginWatch(store), scope=("fc",))
    handles: list[Any] = []
    gate = ScopeGate(ops, phases, handles)
    gate.mode = _dispatch.TraceMode(ops._on_op)
    gate.running = True
    return gate, ops, phases, handles


def _on_stack(mode: Any) -> bool:
    return _dispatch.mode_on_stack(mode)


def test_in_scope_covers_submodules_and_the_empty_name_covers_all() -> None:
    assert in_scope("enc.fc", ["enc"]) and in_scope("enc", ["enc"])
    assert not in_scope("encoder", ["enc"])
    assert in_scope("anything", [""])


def test_entering_opens_and_leaving_closes() -> None:
    gate, _, _, _ = _gate()
    gate.enter()
    assert gate.opened == [True] and _on_stack(gate.mode)
    gate.leave(())
    assert not gate.opened and not _on_stack(gate.mode)


def test_a_gate_opened_already_is_not_closed_by_an_inner_entry() -> None:
    gate, _, _, _ = _gate()
    assert gate.open()
    gate.enter()  # the mode is on the stack: this entry did not put it there
    assert gate.opened == [False]
    gate.leave(())
    assert _on_stack(gate.mode)
    assert _dispatch.pop_mode(gate.mode)  # type: ignore[arg-type]


def test_a_stopped_gate_opens_nothing() -> None:
    gate, _, _, _ = _gate()
    gate.running = False
    assert not gate.open()
    gate.mode = None
    gate.enter()
    assert not gate.opened


def test_only_the_scopes_nodes_get_hooks_and_open_the_gate_in_backward() -> None:
    # GIVEN one node made in the scope (its context is known) after one made outside it
    gate, _, phases, handles = _gate()
    x = torch.ones(2, requires_grad=True)
    outside = x * 2
    inside = outside.exp()
    phases.nodes[_dispatch.node_sequence_nr(inside.grad_fn)] = ("fc", 0, None)
    # WHEN the scope's outputs are given hooks
    gate.hook_nodes([inside])
    # THEN only the scope's node is hooked (pre and post)
    assert gate.hooked == {_dispatch.node_sequence_nr(inside.grad_fn)} and len(handles) == 2
    # AND backward runs: the mode is on the stack in the scope's node, and off again after it
    seen: list[tuple[str, bool]] = []
    inside.grad_fn.register_prehook(lambda g: seen.append(("inside", _on_stack(gate.mode))))  # type: ignore[union-attr]
    outside.grad_fn.register_prehook(lambda g: seen.append(("outside", _on_stack(gate.mode))))  # type: ignore[union-attr]
    inside.sum().backward()
    assert seen == [("inside", True), ("outside", False)]
    for h in handles:
        h.remove()
