"""Loops for the nanhunt.Guard tests; the distributed worker lives here so spawned processes can import it.

The models come from ``fixtures.models`` so that captures rebuild them by name.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

import nanhunt
from fixtures.models import MLP
from tests._support.dist import finish_rank, meet_again

D_IN = 64
BIG_INPUT = 6e4  # finite in float16, but 64 of them summed by fc1 overflow its float16 output
BIG_TARGET = 1e5  # finite float32 loss, float16 gradients overflow at any scale >= 8


def batch(i: int, *, big_input: bool = False, big_target: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, D_IN, generator=g)
    y = torch.randn(8, 4, generator=g)
    if big_input:
        x = torch.full_like(x, BIG_INPUT)
    if big_target:
        y = torch.full_like(y, BIG_TARGET)
    return x, y


def mlp_setup(*, scaler: bool = True, seed: int = 0, lr: float = 1e-3,
              optimizer: str = "adam") -> tuple[MLP, torch.optim.Optimizer, torch.amp.GradScaler | None]:
    torch.manual_seed(seed)
    model = MLP(d_in=D_IN)
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, opt, (torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None)


def guard_for(model: MLP, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, dump_dir: Any,
              **kw: Any) -> nanhunt.Guard:
    return nanhunt.Guard(model, opt, scaler, dump_dir=dump_dir, loss_fn=F.mse_loss, model_kwargs={"d_in": D_IN},
                         **kw)


def train_step(guard: nanhunt.Guard, model: torch.nn.Module, opt: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None, b: tuple[torch.Tensor, torch.Tensor], *,
               dtype: torch.dtype = torch.float16, check_grads: bool = True, hand_loss: bool = True,
               indices: Any = None) -> None:
    """One ordinary AMP step inside ``guard.step`` (given the batch's dataset ``indices``, if any)."""
    x, y = b
    with guard.step(b, indices=indices):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = F.mse_loss(model(x), y)
        if hand_loss:
            loss = guard.loss(loss)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            if check_grads:
                guard.check_grads()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if check_grads:
                guard.check_grads()
            opt.step()


def dist_worker(rank: int, world: int, port: int, dump_dir: str, out_dir: str, bad_rank: int, bad_step: int) -> None:
    """One rank of the gloo test: only ``bad_rank`` gets an overflowing batch at ``bad_step``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        model, opt, scaler = mlp_setup()
        guard = guard_for(model, opt, scaler, dump_dir)
        result["stopped_at"] = None
        for i in range(6):
            try:
                train_step(guard, model, opt, scaler, batch(i, big_input=rank == bad_rank and i == bad_step))
            except nanhunt.GuardError as e:
                result["stopped_at"] = i
                result["event"] = e.event.to_dict()
                break
        result["iterations"] = guard.iterations
        meet_again(result)
        guard.close()
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        finish_rank(out_dir, rank, result)
