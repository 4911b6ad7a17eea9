"""nanhunt.trace under torch.distributed: two gloo processes on the CPU, DDP and FSDP2 (fully_shard) on a tiny
MLP. Only rank 1's batch overflows: rank 1's trace names the op, rank 0's has no origin (the NaN arrived through
a collective) and every rank names rank 1 as first. Each run is bounded in time; a stuck rank is killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from .dist_trace_worker import run
from tests._support.dist import rank_results, run_ranks

TIMEOUT_S = 60

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


def _two_ranks(tmp_path: Path, wrapper: str, overflow: bool, level: str = "op") -> dict[int, dict[str, Any]]:
    run_ranks(run, lambda r, port: (r, 2, port, wrapper, overflow, str(tmp_path), level), timeout=TIMEOUT_S)
    return rank_results(tmp_path)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_overflow_on_rank1_is_born_there_and_received_on_rank0(tmp_path: Path, wrapper: str) -> None:
    # GIVEN two ranks, only rank 1's batch overflows fc1 in float16 WHEN each traces the step
    res = _two_ranks(tmp_path, wrapper, overflow=True)
    r0, r1 = res[0], res[1]
    module = "fc1"  # as the user wrote it, under DDP too (not "module.fc1")
    # THEN rank 1 names the op that made it
    assert r1["first"] == ["forward", module, "aten::addmm", "inf"]
    # AND rank 0 made none: it arrived through the gradient collective, and its record says so
    assert r0["first"] is None
    expected = ("c10d::allreduce_", "all-reduce") if wrapper == "ddp" else ("c10d::_reduce_scatter_base_",
                                                                           "reduce-scatter")
    assert r0["received"] == ["received", expected[0], "backward"]
    assert r0["received_note"].startswith(f"NaN arrived from another rank through the gradient {expected[1]}")
    # AND both ranks name rank 1 as first, with a line for reports
    for r in res.values():
        assert (r["first_rank"], r["first_ranks"]) == (1, [1])
        assert r["ranks"]["0"] is None and r["ranks"]["1"].startswith("Inf born in phase forward")
        # (the class you wrote: FSDP2's fully_shard makes fc1 an FSDPLinear)
        assert r["summary"].startswith(f"rank 1: Inf born in phase forward, module {module} (Linear, call 0)")
        assert r["summary"].endswith(f"rank 0 received it through the gradient {expected[1]}")
    seen = {"ddp": ["c10d::allreduce_"], "fsdp2": ["c10d::_allgather_base_", "c10d::_reduce_scatter_base_"]}
    assert r0["collectives"] == seen[wrapper]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_at_module_level_the_receiving_rank_blames_no_module(tmp_path: Path, wrapper: str) -> None:
    # GIVEN the same step traced at module level (no op records: FSDP2's sharded gradients come out of its
    # reduce-scatter before the parameter's gradient hook sees them)
    res = _two_ranks(tmp_path, wrapper, overflow=True, level="module")
    r0, r1 = res[0], res[1]
    # THEN rank 1 names fc1 in forward, rank 0 names no origin of its own, and both name rank 1 first
    assert r1["first"] == ["forward", "fc1", None, "inf"]
    assert r0["first"] is None
    for r in res.values():
        assert (r["first_rank"], r["first_ranks"]) == (1, [1])


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_clean_step_names_no_rank(tmp_path: Path, wrapper: str) -> None:
    # GIVEN two ranks with ordinary batches WHEN each traces the step THEN nothing is born, received or first
    for r in _two_ranks(tmp_path, wrapper, overflow=False).values():
        assert (r["first"], r["received"], r["first_rank"], r["first_ranks"], r["summary"]) == (None, None, None, [],
                                                                                                 None)
        assert r["ranks"] == {"0": None, "1": None}
