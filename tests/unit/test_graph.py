"""The dataflow graph among non-finite records and the sinks an origin reaches, on hand-built records."""

from __future__ import annotations

import math

from nanhunt.tracing.graph import loss_index, nonfinite_graph, propagation_path, reached_sinks
from nanhunt.records import Phase, Record, Role

NAN, INF = math.nan, math.inf


def rec(index: int, *, lo: float = 0.0, hi: float = 1.0, op: str | None = "aten::add", inputs: tuple[int, ...] = (),
        phase: Phase = Phase.FORWARD, role: Role = Role.OUTPUT) -> Record:
    return Record(index=index, phase=phase, module=None, call_index=0, dtype="float32", shape=(2,), op=op,
                  role=role, min=lo, max=hi, inputs=inputs)


def _mixed() -> list[Record]:
    # GIVEN x (finite) -> exp: +inf (0) and 0/0: NaN (2) -> add of both: NaN, the loss (3); exp -> mul: +inf (4)
    return [
        rec(0, op=None, phase=Phase.INPUT, role=Role.INPUT),
        rec(1, hi=INF, op="aten::exp", inputs=(0,)),
        rec(2, lo=NAN, hi=NAN, op="aten::div", inputs=(0,)),
        rec(3, lo=NAN, hi=NAN, op="aten::add", inputs=(1, 2), phase=Phase.LOSS),
        rec(4, hi=INF, op="aten::mul", inputs=(1,)),
    ]


def test_nan_output_with_a_nan_input_is_explained_by_it_not_by_an_inf_only_input() -> None:
    # WHEN the graph is built
    g = nonfinite_graph(_mixed())
    # THEN only non-finite records are nodes, the NaN input is the add's only producer, the Inf still feeds the mul
    assert sorted(g.nodes) == [1, 2, 3, 4]
    assert sorted(g.edges) == [(1, 4), (2, 3)]


def test_inf_output_takes_every_non_finite_input_as_a_producer() -> None:
    # GIVEN two +inf values added: +inf (no NaN anywhere)
    records = [rec(0, op=None, phase=Phase.INPUT, role=Role.INPUT), rec(1, hi=INF, inputs=(0,)),
               rec(2, hi=INF, inputs=(0,)), rec(3, hi=INF, inputs=(1, 2))]
    # THEN both are edges into it
    assert sorted(nonfinite_graph(records).edges) == [(1, 3), (2, 3)]


def test_reached_sinks_of_the_nan_origin_is_the_loss_and_the_absorbed_inf_reaches_nothing() -> None:
    records = _mixed()
    g = nonfinite_graph(records)
    loss = loss_index(records)
    assert loss == 3
    # THEN the NaN's origin reached the loss (and its path ends there); the Inf reached no sink
    assert reached_sinks(g, records, 2, frozenset(), loss) == (("loss",), 3)
    assert propagation_path(g, 2, 3) == (2, 3)
    assert reached_sinks(g, records, 1, frozenset(), loss) == ((), None)
    # AND a model output among its descendants is the "output" sink
    assert reached_sinks(g, records, 1, frozenset({4}), loss) == (("output",), 4)


def test_reached_sinks_of_a_finite_record_is_nothing() -> None:
    records = _mixed()
    assert reached_sinks(nonfinite_graph(records), records, 0, frozenset(), 3) == ((), None)


def test_gradients_and_update_are_sinks_in_report_order() -> None:
    # GIVEN a NaN born in backward that reaches a parameter's .grad and then the update
    records = [rec(0, op=None, phase=Phase.INPUT, role=Role.INPUT),
               rec(1, lo=NAN, hi=NAN, op="aten::sqrt", inputs=(0,), phase=Phase.BACKWARD),
               rec(2, lo=NAN, hi=NAN, op=None, inputs=(1,), phase=Phase.BACKWARD, role=Role.GRAD),
               rec(3, lo=NAN, hi=NAN, op="aten::add_", inputs=(2,), phase=Phase.UPDATE)]
    g = nonfinite_graph(records)
    # THEN both sinks, gradients named first and the path going to the first one reached
    assert reached_sinks(g, records, 1, frozenset(), None) == (("gradients", "update"), 2)
