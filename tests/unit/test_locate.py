"""The first-occurrence rules (origin_kind, locate, leading_origin) on hand-built records."""

from __future__ import annotations

import dataclasses
import math

from nanhunt.tracing.locate import leading_origin, locate, origin_kind
from nanhunt.records import Phase, Record, Role

NAN, INF = math.nan, math.inf


def rec(index: int, *, lo: float = 0.0, hi: float = 1.0, op: str | None = "aten::add", inputs: tuple[int, ...] = (),
        phase: Phase = Phase.FORWARD, role: Role = Role.OUTPUT, scalar: str | None = None) -> Record:
    return Record(index=index, phase=phase, module=None, call_index=0, dtype="float32", shape=(2,), op=op,
                  role=role, min=lo, max=hi, inputs=inputs, nonfinite_scalar=scalar)


X = rec(0, op=None, phase=Phase.INPUT, role=Role.INPUT)


def _locate(records: list[Record], **kw: object):  # type: ignore[no-untyped-def]
    return locate(records, level="op", classes={}, root_outputs=frozenset(), spans={}, **kw)  # type: ignore[arg-type]


def test_origin_kind_of_op_outputs() -> None:
    records = [X, rec(1, hi=INF, inputs=(0,)), rec(2, lo=NAN, hi=NAN, inputs=(1,)), rec(3, lo=NAN, hi=NAN, inputs=(2,)),
               rec(4, hi=INF, inputs=(1,)), rec(5, lo=NAN, hi=NAN, inputs=(0,), scalar="nan"),
               rec(6, hi=INF, inputs=(0,), scalar="inf")]
    # THEN finite -> Inf and Inf -> NaN are born there; NaN -> NaN and Inf -> Inf are not; a non-finite scalar seeds
    assert [origin_kind(r, records) for r in records] == [None, "inf", "nan", None, None, None, None]


def test_origin_kind_of_entering_tensors_and_masks() -> None:
    mask = rec(0, lo=-INF, hi=0.0, op=None, phase=Phase.INPUT, role=Role.INPUT)
    weight = rec(1, lo=-INF, hi=0.0, op=None, role=Role.PARAM)
    nan_batch = rec(2, lo=NAN, hi=NAN, op=None, phase=Phase.INPUT, role=Role.INPUT)
    records = [mask, weight, nan_batch]
    # THEN a -inf-only input is a mask unless it cannot be one; a -inf weight and a NaN batch are origins
    assert origin_kind(mask, records) is None
    assert origin_kind(mask, records, may_mask=False) == "inf"
    assert origin_kind(weight, records) == "inf"
    assert origin_kind(nan_batch, records) == "nan"


def test_origin_that_reaches_the_loss_leads_over_an_earlier_absorbed_one() -> None:
    # GIVEN exp -> +inf (1), absorbed by a clamp (2); then sqrt of a negative -> NaN (3) -> the loss (4)
    records = [X, rec(1, hi=INF, op="aten::exp", inputs=(0,)), rec(2, op="aten::clamp", inputs=(1,)),
               rec(3, lo=NAN, hi=NAN, op="aten::sqrt", inputs=(2,)),
               rec(4, lo=NAN, hi=NAN, op="aten::mse_loss", inputs=(3,), phase=Phase.LOSS)]
    # WHEN located
    res = _locate(records)
    # THEN both are origins in order, the exp silent (absorbed by the clamp), and the sqrt leads
    assert [(o.op, o.kind, o.reached) for o in res.origins] == [("aten::exp", "inf", ()),
                                                                ("aten::sqrt", "nan", ("loss",))]
    assert res.origins[0].absorbed == (2,)
    assert res.first is res.origins[1]
    assert res.path == (3, 4)
    assert leading_origin(res.origins) is res.origins[1]


def test_harmless_origin_never_leads() -> None:
    # GIVEN exp -> +inf (1) taken in only by an op with no floating output (a cast to an index); a finite loss (2)
    records = [X, rec(1, hi=INF, op="aten::exp", inputs=(0,)),
               rec(2, op="aten::mse_loss", inputs=(0,), phase=Phase.LOSS)]
    # WHEN located
    res = _locate(records, index_uses=frozenset({1}))
    # THEN it is an origin, harmless, and nothing leads
    assert [(o.op, o.reached, o.harmless) for o in res.origins] == [("aten::exp", (), True)]
    assert res.first is None and res.path == ()


def test_leading_origin_order_of_preference() -> None:
    records = [X, rec(1, hi=INF, op="aten::exp", inputs=(0,)), rec(2, op="aten::clamp", inputs=(1,)),
               rec(3, op="aten::mse_loss", inputs=(2,), phase=Phase.LOSS)]
    silent = _locate(records).origins[0]
    assert (silent.reached, silent.harmless) == ((), False)
    harmless = dataclasses.replace(silent, harmless=True)
    reaching = dataclasses.replace(silent, op="aten::log", reached=("loss",))
    allowed = dataclasses.replace(reaching, allowed=True)
    running = dataclasses.replace(silent, reached=None)
    # THEN one that reached a sink leads, else the first silent one; harmless and allowed ones never do
    assert leading_origin([harmless, silent, reaching]) is reaching
    assert leading_origin([harmless, silent]) is silent
    assert leading_origin([harmless]) is None
    assert leading_origin([allowed, harmless]) is None
    # AND while the step runs (reached unknown) the first not allowed one
    assert leading_origin([allowed, running, reaching]) is running


def test_nan_from_a_nan_input_is_no_second_origin() -> None:
    # GIVEN a NaN (1) fed to a log (2) whose output is NaN too, then the loss
    records = [X, rec(1, lo=NAN, hi=NAN, op="aten::div", inputs=(0,)),
               rec(2, lo=NAN, hi=NAN, op="aten::log", inputs=(1,)),
               rec(3, lo=NAN, hi=NAN, op="aten::mean", inputs=(2,), phase=Phase.LOSS)]
    res = _locate(records)
    # THEN one origin, the div, with its path to the loss
    assert [o.op for o in res.origins] == ["aten::div"]
    assert res.first is not None and res.first.reached == ("loss",) and res.path == (1, 2, 3)
