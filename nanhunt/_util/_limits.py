"""Where a value overflows: its dtype's largest finite value, or, for a value that is squared on its way (a norm's
variance), that value's square root. One rule, which the Guard's headroom and the report's op table both judge by.
No torch: a dtype's limit is a float (``records.DTYPE_MAX``) and an op is named as a record names it."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["SQUARED_FROM", "squared_limit", "SQUARES_INPUT", "squared_inputs"]

# A dtype whose limit is past this is judged at the limit's square root where a value is squared on its way: it
# overflows there, 1.84e19 for bfloat16 and float32, long before 3.4e38. float16's 65504 comes first: autocast
# runs its norms in float32, torch's kernels sum a float16 tensor's squares in float32, and 256, its square root,
# is no limit for an activation.
SQUARED_FROM = 1e10


def squared_limit(limit: float) -> float:
    """The largest magnitude a value of a dtype whose largest finite value is ``limit`` may have when it is
    squared on its way: ``limit``'s square root past :data:`SQUARED_FROM`, ``limit`` itself below it."""
    return math.sqrt(limit) if limit > SQUARED_FROM else limit


# The aten ops whose arithmetic squares a tensor input whatever their other arguments, with its position among
# the op's tensor inputs: a norm's variance or a vector norm's sum of squares. Not here: an op whose arguments
# decide (pow's exponent, GELU's approximate="tanh", batch norm's training flag), which a record does not hold,
# and the backward ops (layer norm's backward works on the normalised values).
SQUARES_INPUT: dict[str, int] = {
    op: 0 for op in (
        "aten::layer_norm", "aten::native_layer_norm", "aten::rms_norm", "aten::_fused_rms_norm",
        "aten::group_norm", "aten::native_group_norm", "aten::instance_norm",
        "aten::_batch_norm_with_update", "aten::_native_batch_norm_legit_functional",
        "aten::var", "aten::var_mean", "aten::std", "aten::std_mean",
        "aten::norm", "aten::linalg_vector_norm", "aten::linalg_norm", "aten::frobenius_norm",
        "aten::_weight_norm_interface",
    )
}
_PRODUCTS = frozenset({"aten::mul", "aten::mul_"})  # a product of a tensor with itself (x * x) squares it


def squared_inputs(op: str | None, inputs: Sequence[int]) -> frozenset[int]:
    """The positions of the tensor inputs that ``op`` squares, its inputs given by the indices of their records
    (``Record.inputs``): its :data:`SQUARES_INPUT` entry, or both factors of a product of a record with itself."""
    if op is None:
        return frozenset()
    at = SQUARES_INPUT.get(op)
    if at is not None:
        return frozenset({at}) if at < len(inputs) else frozenset()
    if op in _PRODUCTS and len(inputs) == 2 and inputs[0] == inputs[1]:
        return frozenset({0, 1})
    return frozenset()
