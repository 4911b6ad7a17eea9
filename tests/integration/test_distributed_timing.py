"""A value a collective wrote is never an origin on the rank that received it, whatever the timing of the wait.

gloo's reduce-scatter reduces a clone of its input that it allocates inside the op, and every ``wait()`` of its
work copies this rank's chunk out of that clone: nanhunt's own wait inside the op, and the caller's, which may
come any number of ops later. The clone was once read by the caller's wait as a tensor entering the step (an
origin on rank 0 in about 1 run in 20) when it came after another op, or when the allocator gave the clone the
address of a freed tensor an earlier op had written. These tests force both orderings on two gloo processes.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanhunt

from .dist_more_worker import two_ranks
from tests._support.dist import finish_rank

TIMEOUT_S = 60

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


class _StaleWrites(dict[int, int]):
    """The trace's map of storage -> last record that wrote it, where every storage nothing wrote in this step
    answers with record 0 (a weight): as if the allocator gave each new buffer the address of a freed tensor
    that an earlier op wrote."""

    def get(self, key: int, default: Any = None) -> Any:
        return super().get(key, 0)


def _rank(rank: int, world: int, port: int, case: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        t = _late_wait(rank) if case == "late_wait" else _fsdp2_stale(rank)
        f, rec = t.first, t.received
        res.update(first=None if f is None else [f.phase.value, f.module, f.op, f.kind],
                   received=None if rec is None else [rec.role.value, rec.op, rec.phase.value],
                   first_ranks=list(t.first_ranks),
                   origins=[[o.phase.value, o.module, o.op, o.output.role.value] for o in t.origins])
    except BaseException as e:  # reported to the test, which fails on it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        finish_rank(out, rank, res)


def _late_wait(rank: int) -> nanhunt.Trace:
    """An asynchronous reduce-scatter waited for after another op: rank 1's log(-1) sends NaN to rank 0."""
    with nanhunt.trace() as t:
        send = torch.log(torch.full((8,), -1.0 if rank == 1 else 2.0))
        got = torch.empty(4)
        work = dist.reduce_scatter_tensor(got, send, async_op=True)
        other = torch.ones(3) * 2.0  # the caller's own work before its wait
        assert work is not None
        work.wait()
        (got + other.sum()).sum()
    return t


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


def _fsdp2_stale(rank: int) -> nanhunt.Trace:
    """dist_trace_worker's FSDP2 step (rank 1's float16 fc1 overflows), every new buffer at a reused address."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = _MLP()
    with torch.no_grad():
        m.fc1.weight.abs_()
    fully_shard(m.fc1)
    fully_shard(m.fc2)
    fully_shard(m)  # in place: m is the FSDP2 model
    model: nn.Module = m
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(4, 16, generator=g) + (6e4 if rank == 1 else 0.0)
    y = torch.randint(0, 4, (4,), generator=g)
    with nanhunt.trace(model) as t:
        stale = _StaleWrites(t._store.writes)
        t._store.writes = t._ops._writes = stale  # the same map, read by both
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        nn.functional.cross_entropy(logits.float(), y).backward()
        opt.step()
        opt.zero_grad()
    return t


def test_reduce_scatter_waited_after_another_op_is_received_not_born(tmp_path: Path) -> None:
    # GIVEN rank 1 makes NaN and reduce-scatters it asynchronously; each rank runs another op before its wait
    # WHEN each rank traces it
    res = two_ranks(_rank, tmp_path, "late_wait", timeout=TIMEOUT_S)
    # THEN rank 1's log is the origin; rank 0 made none: the NaN arrived through the reduce-scatter
    assert res[1]["first"] == ["forward", None, "aten::log", "nan"]
    assert res[0]["first"] is None and res[0]["origins"] == []
    assert res[0]["received"] == ["received", "c10d::_reduce_scatter_base_", "forward"]
    # AND both ranks name rank 1 first
    assert res[0]["first_ranks"] == res[1]["first_ranks"] == [1]


def test_fsdp2_reduce_scatter_buffer_at_a_reused_address_is_received_not_born(tmp_path: Path) -> None:
    # GIVEN the FSDP2 step where only rank 1's batch overflows, and every buffer allocated in the step looks
    # like one an earlier op wrote (a freed tensor's address) WHEN each rank traces it
    res = two_ranks(_rank, tmp_path, "fsdp2_stale", timeout=TIMEOUT_S)
    # THEN rank 1 names fc1's matmul; rank 0 has no origin of its own, the NaN came through the reduce-scatter
    assert res[1]["first"] == ["forward", "fc1", "aten::addmm", "inf"]
    assert res[0]["first"] is None and res[0]["origins"] == []
    assert res[0]["received"] == ["received", "c10d::_reduce_scatter_base_", "backward"]
    assert res[0]["first_ranks"] == res[1]["first_ranks"] == [1]
