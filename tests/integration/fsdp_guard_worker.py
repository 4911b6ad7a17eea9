"""One rank of a 2-process gloo FSDP2 (or, with ``wrapper="ddp"``, DDP; ``"hsdp"``: 4 processes, FSDP2 on a 2 x 2 mesh)
training loop watched by ``nanhunt.Guard``
(bfloat16 autocast, no GradScaler, a tiny MLP on the CPU). Only rank ``bad_rank``'s batch at ``bad_step`` overflows: inputs of 3e38
(finite in bfloat16) summed by fc1, whose weights are made positive, pass bfloat16's 3.4e38. Writes
``rank{R}.json``; rank 1 also saves its ``state_dict()`` as a plain .pt file (DTensor shards)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanhunt
from fixtures.models import MLP
from tests._support.dist import finish_rank, meet_again

D_IN = 64
BIG = 3e38


def batch(rank: int, i: int, *, big: bool, value: float = BIG) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.rand(4, D_IN, generator=g)
    y = torch.randn(4, 4, generator=g)
    return (torch.full_like(x, value) if big else x), y


def guarded_step(guard: nanhunt.Guard, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor) -> None:
    """One bfloat16 training step without a GradScaler, inside ``guard.step``."""
    with guard.step((x, y)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = guard.loss(F.mse_loss(model(x), y))
        loss.backward()
        guard.check_grads()
        opt.step()


def run(rank: int, world: int, port: int, dump: str, out: str, bad_rank: int, bad_step: int,
        wrapper: str = "fsdp2", fault: str = "forward") -> None:
    """``fault="backward"``: fc1's weights tiny (1e-21) and the bad batch 3e30 (at step 0: Adam's first update makes
    the weights ~1e-3), so the forward and the loss stay finite (fc1 makes ~4e9, the loss ~8e18) and fc1's weight
    gradient (the batch times ~1e8) overflows bfloat16 in backward: every rank's gradients go non-finite through
    the collective, the Guard sees it on every rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res: dict[str, Any] = {"rank": rank, "stopped_at": None}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        model: torch.nn.Module = MLP(d_in=D_IN)
        with torch.no_grad():
            model.fc1.weight.abs_()
            if fault == "backward":
                model.fc1.weight.mul_(1e-21)
        if wrapper == "ddp":
            model = DistributedDataParallel(model)
        elif wrapper == "hsdp":  # replicated over mesh dimension 0, sharded over dimension 1
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            for m in (model.fc1, model.fc2, model):
                fully_shard(m, mesh=mesh)
        else:
            fully_shard(model.fc1)
            fully_shard(model.fc2)
            fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        guard = nanhunt.Guard(model, opt, None, dump_dir=dump, loss_fn=F.mse_loss, model_kwargs={"d_in": D_IN})
        for i in range(5):
            x, y = batch(rank, i, big=rank == bad_rank and i == bad_step, value=BIG if fault == "forward" else 3e30)
            try:
                guarded_step(guard, model, opt, x, y)
            except nanhunt.GuardError as e:
                res["stopped_at"] = i
                res["event"] = e.event.to_dict()
                res["describe"] = e.event.describe()
                # the pre-update state gathered whole (a collective), for the test to compare with the capture's
                inner = getattr(model, "module", model)  # DDP's names say module.fc1
                full = {k: getattr(v, "full_tensor", v.clone)() for k, v in inner.state_dict().items()}
                res["mesh"] = [list(p.device_mesh.shape) for p in inner.parameters() if hasattr(p, "device_mesh")][:1]
                if rank == 0:
                    torch.save(full, os.path.join(out, "full-state.pt"))
                break
        res["iterations"] = guard.iterations
        if rank == 1 and wrapper == "fsdp2":  # what a user saving one rank's state_dict gets: DTensor shards
            torch.save(model.state_dict(), os.path.join(out, "rank1-state.pt"))
        meet_again(res)
        guard.close()
    except BaseException as e:  # reported to the test, which fails on it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        finish_rank(out, rank, res)
