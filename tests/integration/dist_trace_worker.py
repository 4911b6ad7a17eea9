"""One rank of a 2-process gloo step traced by ``nanhunt.trace`` (DDP or FSDP2, a tiny MLP on the CPU).
With ``overflow``, only rank 1's batch makes fc1's float16 autocast matmul overflow. Writes ``rank{R}.json``."""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import nanhunt


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def run(rank: int, world: int, port: int, wrapper: str, overflow: bool, out: str, level: str = "op") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    res: dict[str, Any] = {}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = MLP()
        with torch.no_grad():
            m.fc1.weight.abs_()  # fc1 of a batch near 6e4 sums past float16's 65504
        model: nn.Module
        if wrapper == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(m)
        else:
            from torch.distributed.fsdp import fully_shard
            fully_shard(m.fc1)
            fully_shard(m.fc2)
            model = fully_shard(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        x = torch.rand(4, 16, generator=g) + (6e4 if overflow and rank == 1 else 0.0)
        y = torch.randint(0, 4, (4,), generator=g)
        with nanhunt.trace(model, level=level) as t:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        f = t.first
        rec = t.received
        res.update(
            first=None if f is None else [f.phase.value, f.module, f.op, f.kind],
            received=None if rec is None else [rec.role.value, rec.op, rec.phase.value],
            received_note=t.received_note,
            first_rank=t.first_rank, first_ranks=list(t.first_ranks),
            ranks={str(k): v for k, v in t.ranks.items()}, summary=t.rank_summary,
            collectives=sorted({r.op for r in t.records if r.role is nanhunt.Role.RECEIVED and r.op}),
        )
    except BaseException as e:  # reported to the test, which fails on it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(res, fh)
        dist.destroy_process_group()
