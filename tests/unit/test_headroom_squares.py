"""The op table's headroom of an input the op squares (a norm's variance, x * x) is judged as the Guard judges a
value: against where its square overflows, the square root of a wide dtype's max. A LayerNorm whose float32
input reached 6e20 made NaN because x² passed 3.4e38; its headroom is 0.0307x of its square, not 5.7e17x."""

from __future__ import annotations

import math

import pytest

from nanhunt._util._limits import SQUARED_FROM, SQUARES_INPUT, squared_inputs, squared_limit
from nanhunt.records import DTYPE_MAX, Occurrence, Phase, Record, Role
from nanhunt.report import _common as c

HEADROOM = c.TENSOR_COLUMNS.index("headroom")
BIG = 6.000000042353004e20  # 6e20 as float32 holds it: every machine reads the same number


def _rec(index: int, op: str | None, lo: float, hi: float, dtype: str = "float32",
         inputs: tuple[int, ...] = ()) -> Record:
    return Record(index=index, phase=Phase.FORWARD, module="ln", call_index=0, op=op, role=Role.OUTPUT, dtype=dtype,
                  shape=(4, 8), min=lo, max=hi, inputs=inputs)


def _origin(op: str, ins: tuple[Record, ...], dtype: str = "float32") -> Occurrence:
    out = _rec(9, op, math.nan, math.nan, dtype, tuple(r.index for r in ins))
    return Occurrence(phase=Phase.FORWARD, module="ln", module_class="LayerNorm", call_index=0, op=op, kind="nan",
                      source=None, output=out, inputs=ins)


def test_a_layer_norms_input_is_judged_against_where_its_square_overflows() -> None:
    # GIVEN a float32 LayerNorm whose input reached 6e20 (x² = 3.6e41 > 3.4e38) and made NaN
    occ = _origin("aten::native_layer_norm", (_rec(1, "aten::addmm", -BIG, BIG), _rec(2, None, 1.0, 1.0),
                                              _rec(3, None, 0.0, 0.0)))
    # WHEN its table is made
    rows = c.tensor_rows(occ)
    # THEN the input's headroom is sqrt(3.4e38) / 6e20 of its square, below 1: its square overflowed; its weight and
    # bias, which the op does not square, keep the dtype's max; the mark is explained
    assert [r[HEADROOM] for r in rows] == ["0.0307x (x²)", "3.4e+38x", "inf", "-"]
    assert c.tensor_levels(occ) == ["over", "", "", ""]
    note = c.tensor_note(occ)
    assert note is not None and note.startswith("(x²): the op squares this input") and "1.84e+19" in note


def test_a_product_of_a_value_with_itself_squares_both_factors() -> None:
    # GIVEN h * h on a float32 h of 8e19 (the record of h is both inputs)
    h = _rec(3, "aten::addmm", -8e19, 8e19)
    occ = _origin("aten::mul", (h, h))
    # THEN both factors are judged squared; a product of two different values is not
    assert [r[HEADROOM] for r in c.tensor_rows(occ)[:2]] == ["0.231x (x²)"] * 2
    other = _origin("aten::mul", (h, _rec(4, "aten::addmm", -8e19, 8e19)))
    assert [r[HEADROOM] for r in c.tensor_rows(other)[:2]] == ["4.25e+18x"] * 2
    assert c.tensor_note(other) is None


def test_float16_and_ops_that_do_not_square_keep_the_dtypes_max() -> None:
    # GIVEN a float16 LayerNorm input (its squares are summed in float32) and a float32 addmm input
    ln16 = _origin("aten::native_layer_norm", (_rec(1, None, -300.0, 300.0, "float16"),), "float16")
    mm = _origin("aten::addmm", (_rec(1, None, -BIG, BIG),))
    # THEN both are judged against their dtype's max, unmarked
    assert c.tensor_rows(ln16)[0][HEADROOM] == "218x"
    assert c.tensor_rows(mm)[0][HEADROOM] == "5.67e+17x"
    assert c.tensor_note(ln16) is None and c.tensor_note(mm) is None


@pytest.mark.parametrize("op,inputs,squared", [
    ("aten::native_layer_norm", (1, 2, 3), {0}),
    ("aten::var_mean", (1,), {0}),
    ("aten::linalg_vector_norm", (1,), {0}),
    ("aten::mul", (1, 1), {0, 1}),
    ("aten::mul", (1, 2), set()),
    ("aten::softmax", (1,), set()),
    ("aten::pow", (1,), set()),  # its exponent decides, and a record does not hold it
    (None, (1,), set()),
])
def test_which_inputs_an_op_squares(op: str | None, inputs: tuple[int, ...], squared: set[int]) -> None:
    assert squared_inputs(op, inputs) == squared


def test_the_guard_judges_by_the_same_rule() -> None:
    # GIVEN the Guard's headroom rule WHEN asked for each dtype THEN it is the shared one: the square root of a wide
    # dtype's max, float16's max itself
    torch = pytest.importorskip("torch")
    from nanhunt.guard._headroom import _room

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert _room(dtype) == squared_limit(DTYPE_MAX[str(dtype).replace("torch.", "")])
    assert f"{squared_limit(DTYPE_MAX['float32']):.3g}" == "1.84e+19" and squared_limit(65504.0) == 65504.0
    assert DTYPE_MAX["float16"] < SQUARED_FROM < DTYPE_MAX["bfloat16"]
    assert all(op.startswith("aten::") for op in SQUARES_INPUT)
