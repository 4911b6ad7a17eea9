"""Op recording on its own: a dispatch mode handing ops to an OpRecorder over a record store and a
phase tracker, without module hooks or a Trace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nanhunt._util._dispatch import TraceMode, peek_sequence_nr
from nanhunt.tracing._ops import OpRecorder
from nanhunt.tracing._phases import PhaseTracker
from nanhunt.tracing._records_store import RecordStore
from nanhunt.tracing._watch import OriginWatch
from nanhunt.records import Phase, Role


def _parts(scope: tuple[str, ...] = (), stop_at_first: bool = False,
           keep_tensors: bool = False) -> tuple[OpRecorder, RecordStore, PhaseTracker, OriginWatch]:
    store = RecordStore()
    phases = PhaseTracker(store)
    watch = OriginWatch(store, stop_at_first=stop_at_first, keep_tensors=keep_tensors)
    return OpRecorder(store, phases, watch, scope=scope), store, phases, watch


@contextmanager
def _recording(ops: OpRecorder) -> Iterator[None]:
    ops.last_seq = peek_sequence_nr()
    with TraceMode(ops._on_op):  # type: ignore[no-untyped-call]
        yield


def test_an_op_makes_a_record_of_its_output_linked_to_its_input() -> None:
    ops, store, _, _ = _parts()
    x = torch.tensor([1.0, 4.0])
    with _recording(ops):
        y = torch.sqrt(x)
    store.read_back()
    inp, out = store.raws
    assert (inp.phase, inp.role, inp.op) == (Phase.INPUT, Role.INPUT, None)
    assert (out.phase, out.role, out.op, out.inputs) == (Phase.FORWARD, Role.OUTPUT, "aten::sqrt", (0,))
    assert (out.min, out.max) == (1.0, 2.0)
    assert out.source is not None and out.source[0] == __file__  # the user's line, not torch's
    assert store.known.get(y) == (1, y._version)


def test_a_view_shares_its_inputs_record_and_a_changed_tensor_is_measured_again() -> None:
    ops, store, _, _ = _parts()
    x = torch.ones(2, 3)
    with _recording(ops):
        v = x.view(6).t()
        z = v * 2
        x.add_(1)
        w = x * 1
    ops_made = [(r.op, r.role, r.inputs) for r in store.raws]
    assert ops_made[:2] == [(None, Role.INPUT, ()), ("aten::mul", Role.OUTPUT, (0,))]  # the views are x's record
    assert ops_made[2] == ("aten::add_", Role.OUTPUT, (0,))  # the write is a new value of x
    assert ops_made[3] == ("aten::mul", Role.OUTPUT, (2,))  # read after the write: the written record
    assert store.known.get(z) == (1, z._version) and w is not None


def test_a_non_finite_python_scalar_is_the_ops_argument_not_its_doing() -> None:
    ops, store, _, _ = _parts()
    x = torch.ones(2)
    with _recording(ops):
        torch.mul(x, float("inf"))
    assert store.raws[-1].nonfinite_scalar == "inf"


def test_an_index_result_marks_its_inputs() -> None:
    ops, store, _, _ = _parts()
    x = torch.tensor([0.5, 2.0])
    with _recording(ops):
        x.argmax()
    assert len(store.raws) == 1 and store.index_uses == {0}


def test_a_busy_recorder_runs_ops_plainly() -> None:
    ops, store, _, _ = _parts()
    ops.busy = True
    with _recording(ops):
        y = torch.exp(torch.ones(2))
    assert not store.raws and torch.equal(y, torch.full((2,), torch.e))


def test_ops_take_the_phase_and_module_of_the_phase_tracker() -> None:
    ops, store, phases, _ = _parts()
    x = torch.ones(2, requires_grad=True)
    phases.enter("fc")
    with _recording(ops):
        y = x * 3
        phases.leave("fc")
        y.sum().backward()
    made = [(r.op, r.phase, r.module) for r in store.raws if r.op]
    assert made[:2] == [("aten::mul", Phase.FORWARD, "fc"), ("aten::sum", Phase.LOSS, None)]
    # the backward of mul belongs to fc, whose op made its node
    assert ("aten::mul", Phase.BACKWARD, "fc") in made[2:]


def test_the_watch_looks_after_every_op_with_stop_at_first() -> None:
    ops, store, _, watch = _parts(stop_at_first=True, keep_tensors=True)
    x = torch.ones(2)
    with _recording(ops):
        x * 2
    # read back and searched (nothing found): no tensor kept past the look
    assert store.checked == len(store.raws) == 2 and watch.window == []


def test_a_scoped_recorder_ignores_ops_outside_any_module() -> None:
    ops, store, phases, _ = _parts(scope=("fc",))
    x = torch.ones(2)
    with _recording(ops):
        x * 2
        phases.enter("fc")
        x * 3
        phases.leave("fc")
    assert [(r.op, r.module) for r in store.raws] == [(None, "fc"), ("aten::mul", "fc")]
    assert store.raws[0].role is Role.INPUT  # made outside the scope: enters it here
