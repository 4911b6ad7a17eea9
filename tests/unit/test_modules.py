"""Module hooks on their own: module-level records of a small model, without a Trace or a dispatch mode."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from nanhunt.tracing._modules import ModuleHooks
from nanhunt.tracing._ops import OpRecorder
from nanhunt.tracing._phases import PhaseTracker
from nanhunt.tracing._records_store import RecordStore
from nanhunt.tracing._watch import OriginWatch
from nanhunt.records import Phase, Role


def _hooks(model: nn.Module, level: str = "module") -> tuple[ModuleHooks, RecordStore, PhaseTracker, list[Any]]:
    store = RecordStore()
    phases = PhaseTracker(store)
    watch = OriginWatch(store, level=level)
    ops = OpRecorder(store, phases, watch)
    handles: list[Any] = []
    hooks = ModuleHooks(store, phases, ops, None, watch, handles, level=level)
    hooks.running = True
    hooks.install(model)
    return hooks, store, phases, handles


def test_module_level_records_weights_inputs_outputs_and_gradients() -> None:
    # GIVEN a two-layer model traced at module level
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    hooks, store, phases, handles = _hooks(model)
    assert store.classes == {"": "Sequential", "0": "Linear", "1": "ReLU"}
    assert [(r.phase, r.module, r.role) for r in store.raws] == [
        (Phase.WEIGHTS, "0", Role.PARAM), (Phase.WEIGHTS, "0", Role.PARAM)]
    # WHEN it runs forward and backward
    model(torch.ones(2, 3)).sum().backward()
    made = [(r.phase, r.module, r.role) for r in store.raws[2:]]
    # THEN the input enters the root, each call's output is a record of that module (the root returns
    # its last child's as is), and the gradient of the model's output is the loss's backward
    assert made[:4] == [(Phase.INPUT, "", Role.INPUT), (Phase.FORWARD, "0", Role.OUTPUT),
                        (Phase.FORWARD, "1", Role.OUTPUT), (Phase.LOSS, None, Role.GRAD_OUTPUT)]
    assert made.count((Phase.BACKWARD, "0", Role.GRAD)) == 2  # weight and bias .grad
    assert phases.accumulated and not phases.stack
    assert [c[2:] for c in store.calls] == [("0", 0), ("1", 0), ("", 0)]
    assert store.root_outputs == {4}
    for h in handles:
        h.remove()


def test_a_tensor_made_between_child_calls_is_the_parents_own() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Identity(), nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) * 2)

    model = Parent()
    hooks, store, _, _ = _hooks(model)
    model(torch.ones(2))
    doubled = next(r for r in store.raws if r.role is Role.OUTPUT and r.module == "")
    assert doubled.phase is Phase.FORWARD and doubled.inputs  # made from what the call had


def test_op_level_hooks_only_keep_the_stack_and_mark_the_models_outputs() -> None:
    model = nn.Linear(2, 2)
    hooks, store, phases, _ = _hooks(model, level="op")
    out = model(torch.ones(1, 2))
    assert not phases.stack and phases.calls == {"": 1}
    assert not store.calls
    assert store.known.get(out) is not None and store.known.get(out)[0] in store.root_outputs  # type: ignore[index]


def test_hooks_do_nothing_once_the_trace_stopped_running() -> None:
    model = nn.Linear(2, 1)
    hooks, store, _, _ = _hooks(model)
    hooks.running = False
    n = len(store.raws)
    model(torch.ones(1, 2)).sum().backward()
    assert all(r.role not in (Role.GRAD, Role.GRAD_OUTPUT) for r in store.raws[n:])


def test_modules_are_named_by_identity_and_held_weakly() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    hooks, _, _, handles = _hooks(model)
    assert hooks.name_of(model[0]) == "0" and hooks.root_name == ""
    assert hooks.name_of(nn.Linear(2, 2)) is None
    for h in handles:
        h.remove()
    ref = weakref.ref(model)
    del model
    assert ref() is None  # the hooks keep no module alive
