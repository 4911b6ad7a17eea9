"""The origin watch on its own: locate over a record store, mid-step (stop_at_first, full statistics of
the culprit while its tensors live) and at the end."""

from __future__ import annotations

import math

import pytest
import torch

from nanhunt import NonFiniteError
from nanhunt.tracing._records_store import Raw, RecordStore
from nanhunt.tracing._watch import WINDOW, OriginWatch
from nanhunt.records import Phase, Role


def _op(store: RecordStore, op: str, out: torch.Tensor, inputs: tuple[int, ...]) -> int:
    return store.add(Raw(Phase.FORWARD, "fc", 0, op, Role.OUTPUT, out, inputs, None), out)


def _input(store: RecordStore, t: torch.Tensor) -> int:
    i = store.add(Raw(Phase.INPUT, "fc", 0, None, Role.INPUT, t, (), None), t)
    store.known[t] = (i, t._version)
    return i


def test_finish_names_the_op_that_made_the_first_non_finite_value() -> None:
    # GIVEN x (finite) -> log (makes -inf) -> mul (carries it)
    store = RecordStore()
    x = torch.tensor([0.0, 1.0])
    i = _input(store, x)
    y = torch.log(x)
    j = _op(store, "aten::log", y, (i,))
    _op(store, "aten::mul", y * 2, (j,))
    # WHEN the step ends
    res = OriginWatch(store).finish(sinks_seen=False)
    # THEN the origin is the log
    assert res.first is not None and res.first.op == "aten::log" and res.first.output.index == j


def test_stop_at_first_raises_inside_the_op_with_the_culprits_full_statistics() -> None:
    store = RecordStore()
    watch = OriginWatch(store, stop_at_first=True, keep_tensors=True)
    x = torch.tensor([0.0, 4.0])
    i = _input(store, x)
    y = torch.log(x)
    j = _op(store, "aten::log", y, (i,))
    with pytest.raises(NonFiniteError):
        watch.hold([j], (x,), {}, [y], None)
    assert watch.stopped is not None and watch.stopped.op == "aten::log"
    full = store.raws[j].full
    assert full is not None and (full.neginf, full.numel) == (1, 2)
    assert store.raws[i].full is not None  # the input it read, still the same tensor
    assert store.raws[j].in_shapes == ((2,),)
    assert watch.window is None  # found: nothing kept any more


def test_tensors_are_kept_until_a_window_of_records_then_looked_at() -> None:
    store = RecordStore()
    watch = OriginWatch(store, keep_tensors=True)
    x = torch.ones(1)
    for _ in range(WINDOW - 1):
        watch.hold([_input(store, x)], (), {}, [x], None)
    assert watch.window is not None and len(watch.window) == WINDOW - 1 and store.checked == 0
    watch.hold([_input(store, x)], (), {}, [x], None)
    assert watch.window == [] and store.checked == WINDOW
    assert store.raws[0].max == 1.0  # read back at the look


def test_backward_ops_tensors_are_not_kept() -> None:
    store = RecordStore()
    watch = OriginWatch(store, keep_tensors=True)
    x = torch.ones(1)
    watch.hold([_input(store, x)], (), {}, [x], node=object())
    assert watch.window == [] and math.isnan(store.raws[0].max)
