"""The tasks, the default tolerances, the tie rule: what every part of a comparison reads."""

from __future__ import annotations

from typing import TypedDict

import torch

from .._util._errors import InputError
from .._util._text import dtype_name


TASKS = ("classify", "regress", "none")
TIE_RULE = "equal top scores go to the lowest class index, in both runs; a row holding NaN has no class (-1)"
# rtol from the issue (float16 1e-3, bfloat16 1e-2); atol as torch.testing's defaults for both.
_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
_ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5}
_WORST = 5  # samples listed by --task regress


class _Rule(TypedDict):
    """The acceptance rule's fields of a ``Comparison``, fixed before the run."""

    dtype: str
    device_type: str
    rtol: float
    atol: float
    task: str
    max_flips: int
    fail_on_tolerance: bool
    tie_rule: str
    variant: str
    per_row: bool


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used when none are given: float16 1e-3/1e-5, bfloat16 1e-2/1e-5."""
    return _RTOL[dtype], _ATOL[dtype]


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    found = getattr(torch, dtype_name(dtype), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or found not in _RTOL:
        raise InputError(f"compare needs an autocast dtype of float16 or bfloat16, not {dtype}")
    return found
