"""One rank of a 2-process gloo FSDP2 step replayed twice under ``Step.isolated`` (test_fsdp_reset.py): a clean
batch, fc1, fc2 and the root each ``fully_shard``-ed. Between the runs, FSDP2's all-gather buffers get back memory
filled with NaN, as the allocator may hand them (their memory is freed after each use and grown back before the
next all-gather, without an op a trace sees). Writes ``rank{R}.json``: what the traced second run found."""

from __future__ import annotations

import math
import os
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanhunt
from fixtures.models import MLP
from nanhunt.step.step import Step
from nanhunt.tracing.tracer import Trace
from tests._support.dist import finish_rank

D_IN = 64


def _nan_buffers(model: torch.nn.Module) -> int:
    """FSDP2's freed all-gather buffers grown back to their size and filled with NaN; how many."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    for t in p.all_gather_outputs:
                        t.untyped_storage().resize_(t.numel() * t.element_size())
                        t.fill_(math.nan)
                        n += 1
    return n


def _plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(batch[0]).float(), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def run(rank: int, world: int, port: int, out: str, live: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = MLP(d_in=D_IN)
        for m in (model.fc1, model.fc2, model):
            fully_shard(m)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        batch = (torch.rand(4, D_IN, generator=g), torch.randn(4, 4, generator=g))
        if live:  # the user's own steps, the second one traced live
            res["losses"] = [_plain_step(model, opt, batch)]
            res["poisoned"] = _nan_buffers(model)
            with nanhunt.trace(model) as tr:
                res["losses"].append(_plain_step(model, opt, batch))
            f = tr.first
            res["first"] = None if f is None else [f.phase.value, f.module, f.op, f.kind]
            res["first_rank"] = tr.first_rank
            return
        step = Step.of(model, batch, loss_fn=F.mse_loss, dtype=torch.bfloat16, optimizer=opt)
        with step.isolated():
            res["losses"] = [float(step.run())]
            res["poisoned"] = _nan_buffers(model)
            t = Trace(model)
            res["losses"].append(float(step.run(within=t)))
            f = t.first
            res["first"] = None if f is None else [f.phase.value, f.module, f.op, f.kind]
            res["first_rank"] = t.first_rank
    except BaseException as e:  # reported to the test, which fails on it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        finish_rank(out, rank, res)
