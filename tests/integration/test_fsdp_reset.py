"""A step replayed under FSDP2 starts every run as the first one did: FSDP2 keeps each parameter's all-gather
buffers from one step to the next (memory freed after use, grown back before the next all-gather), and a later
run's trace must not read what that memory held as values entering the step (it did: the torchrun replay's
float32 control named ``('input', None, None)`` in about 1 run of 6)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch.distributed as dist

from tests._support.dist import rank_results, run_ranks

from .fsdp_reset_worker import run

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


def test_a_later_run_is_not_blamed_on_what_fsdp2s_regrown_buffers_held(tmp_path: Path) -> None:
    # GIVEN two FSDP2 ranks replaying a clean bfloat16 step of the MLP, run once under Step.isolated
    # AND FSDP2's four all-gather buffers (fc1's and fc2's weight and bias) holding NaN, as memory grown back may
    run_ranks(run, lambda r, port: (r, 2, port, str(tmp_path)), timeout=120)
    res = rank_results(tmp_path)
    # WHEN the step runs again, traced
    for r in (0, 1):
        assert res[r]["poisoned"] == 4
        # THEN no rank finds a non-finite value: the run all-gathered into new buffers, as the first run did
        assert (res[r]["first"], res[r]["first_rank"]) == (None, None)
        # AND it is the same step: the same loss, to the bit
        assert res[r]["losses"][0] == res[r]["losses"][1]


def test_a_live_trace_of_a_later_step_is_not_blamed_on_what_fsdp2s_regrown_buffers_held(tmp_path: Path) -> None:
    # GIVEN two FSDP2 ranks that ran one clean bfloat16 step of the MLP with their own loop
    # AND FSDP2's four all-gather buffers holding NaN, as memory grown back before the next all-gather may
    run_ranks(run, lambda r, port: (r, 2, port, str(tmp_path), True), timeout=120)
    res = rank_results(tmp_path)
    # WHEN the user traces their next step live with nanhunt.trace
    for r in (0, 1):
        assert res[r]["poisoned"] == 4
        # THEN no rank finds a non-finite value: what the all-gather wrote is what the step read
        assert (res[r]["first"], res[r]["first_rank"]) == (None, None)
        # AND the step ran on the all-gathered weights (a loss read from NaN buffers would be NaN)
        assert all(math.isfinite(x) for x in res[r]["losses"])
