"""The tracer's phase state machine on its own: told of module calls, optimizer steps and gradients,
it names the phase, module and call of the op running now (no dispatch mode, no model)."""

from __future__ import annotations

import torch

from nanhunt._util._dispatch import node_sequence_nr, peek_sequence_nr
from nanhunt.tracing._phases import PhaseTracker
from nanhunt.tracing._records_store import Raw, RecordStore
from nanhunt.records import Phase, Role

F, L, B, U, I = Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.UPDATE, Phase.INPUT


def _tracker() -> tuple[PhaseTracker, RecordStore]:
    store = RecordStore()
    return PhaseTracker(store), store


def _add(store: RecordStore, phase: Phase, role: Role = Role.OUTPUT, inputs: tuple[int, ...] = ()) -> int:
    t = torch.ones(2)
    return store.add(Raw(phase, None, 0, "aten::mul", role, t, inputs, None), t)


def test_glue_before_the_model_is_forward_outside_any_module() -> None:
    ph, _ = _tracker()
    assert ph.context(None) == (F, None, 0, None, True)


def test_module_calls_are_counted_per_module_and_name_the_op() -> None:
    # GIVEN a model calling its block twice
    ph, _ = _tracker()
    assert ph.enter("") == (0, ())
    assert ph.enter("block") == (0, ())
    assert ph.context(None)[:3] == (F, "block", 0)
    assert ph.leave("block") == (0, False)
    # WHEN the block is called again
    assert ph.enter("block")[0] == 1
    # THEN the op inside is the second call's; after it, the root's own code
    assert ph.context(None)[:3] == (F, "block", 1)
    assert ph.leave("block") == (1, False)
    assert ph.context(None)[:3] == (F, "", 0)


def test_leaving_a_call_not_on_top_changes_nothing() -> None:
    ph, _ = _tracker()
    ph.enter("a")
    assert ph.leave("b") is None
    assert ph.stack == [("a", 0)]
    assert ph.leave("a") == (0, False) and ph.leave("a") is None


def test_after_the_model_returns_ops_are_loss_then_update_after_accumulation() -> None:
    ph, _ = _tracker()
    ph.enter("")
    ph.leave("")
    assert ph.context(None)[0] is L
    # a backward filled some .grad: what runs next outside the model is the update
    ph.grad_accumulated()
    assert ph.context(None)[0] is U


def test_optimizer_step_is_update_even_inside_a_module_call() -> None:
    # GIVEN optimizer.step() run from inside a module's forward (a model that trains itself)
    ph, store = _tracker()
    ph.enter("model")
    ph.step_enter(None, (), {})
    assert ph.in_update()
    assert ph.context(None)[:3] == (U, None, 0)
    _add(store, U)
    ph.step_leave(None, (), {})
    # THEN the step's records form a span, and the op after it is the module's again
    assert ph.step_spans == [(0, 1)]
    assert not ph.in_update()
    assert ph.context(None)[:3] == (F, "model", 0)


def test_a_closure_inside_the_step_is_no_update() -> None:
    # GIVEN LBFGS calling its closure: a forward inside optimizer.step()
    ph, _ = _tracker()
    ph.step_enter(None, (), {})
    ph.enter("model")
    # THEN the closure's ops are forward, and so is its loss after the model returns
    assert ph.updating[-1].closure
    assert ph.context(None)[:3] == (F, "model", 0)
    ph.leave("model")
    assert not ph.in_update()
    assert ph.context(None)[0] is L


def test_loss_records_before_the_next_call_are_glue() -> None:
    # GIVEN a model call, then ops outside it (phase loss so far)
    ph, store = _tracker()
    ph.enter("")
    ph.leave("")
    assert ph.enter("")[1] == ()  # nothing made since the first call
    ph.leave("")
    x = _add(store, L)
    # WHEN the model is called again
    _, glue = ph.enter("")
    # THEN the loss records since the last call may be glue; the caller reclassifies what made its arguments
    assert glue == (L,)
    ph.glue_to_forward([x], glue)
    assert store.raws[x].phase is F


def test_a_new_step_after_accumulation_resets_the_backward() -> None:
    ph, store = _tracker()
    ph.enter("")
    ph.leave("")
    ph.backward_seen = True
    ph.grad_accumulated()
    u = _add(store, U, Role.STATE)
    _, glue = ph.enter("")
    assert glue == (U, L)
    assert not ph.accumulated and not ph.backward_seen
    # state from before the step that made the next call's arguments is input
    ph.glue_to_forward([u], glue)
    assert (store.raws[u].phase, store.raws[u].role) == (I, Role.INPUT)


def test_glue_stops_at_an_optimizer_steps_records_and_follows_inputs() -> None:
    ph, store = _tracker()
    ph.step_enter(None, (), {})
    stepped = _add(store, U)
    ph.step_leave(None, (), {})
    made = _add(store, U, inputs=(stepped,))
    ph.glue_to_forward([made], (U, L))
    assert store.raws[made].phase is F
    assert store.raws[stepped].phase is U  # the step's own op stays update


def test_glue_makes_the_records_again() -> None:
    ph, store = _tracker()
    x = _add(store, L)
    assert store.record(x).phase is L
    ph.glue_to_forward([x], (L,))
    assert store.record(x).phase is F


def test_from_forward_is_about_computed_values() -> None:
    ph, store = _tracker()
    out = _add(store, F)
    weight = _add(store, Phase.WEIGHTS, Role.PARAM)
    assert ph.from_forward([weight, out])
    assert not ph.from_forward([weight])


def test_a_backward_node_runs_in_the_forward_context_that_made_it() -> None:
    # GIVEN a node made by an op of "fc" (the op recorder keeps its context by sequence number)
    ph, store = _tracker()
    _add(store, L)
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    node = y.grad_fn
    src = ("model.py", 3, "forward")
    ph.nodes[node_sequence_nr(node)] = ("fc", 1, src)
    # WHEN an op runs inside that node
    ctx = ph.context(node)
    # THEN it is fc's backward, with the forward's line; the loss pending is settled
    assert ctx == (B, "fc", 1, src, False)
    assert ph.backward_seen and ph.loss_mark == len(store.raws)


def test_accumulate_grad_belongs_to_the_parameters_module() -> None:
    ph, _ = _tracker()
    w = torch.nn.Parameter(torch.ones(2))
    ph.owners[w] = "fc"
    acc = (w * 3).grad_fn.next_functions[0][0]  # w's AccumulateGrad
    assert ph.context(acc)[:3] == (B, "fc", 0)


def test_a_recomputed_forward_in_backward_repeats_the_call() -> None:
    # GIVEN a reentrant checkpoint: the call ran under no_grad right after its node was made
    ph, _ = _tracker()
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    node = y.grad_fn
    assert peek_sequence_nr() - 1 == node_sequence_nr(node)
    with torch.no_grad():
        assert ph.enter("block")[0] == 0
    ph.leave("block")
    ph.enter("block")
    ph.leave("block")
    # WHEN backward runs that node and recomputes the call
    assert ph.reenter("block", node) == 0
    # THEN it is the first call again, and ops in it are that call's backward
    assert ph.recompute_depth == 1
    assert ph.context(node)[:3] == (B, "block", 0)
