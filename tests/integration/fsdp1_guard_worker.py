"""One rank of a 2-process gloo FSDP1 (``FullyShardedDataParallel``) training loop watched by ``nanhunt.Guard``: the
loop of ``fsdp_guard_worker`` (bfloat16 autocast, no GradScaler, Adam, fc1's weights made positive), only the model is
wrapped by FSDP1 with its default settings (``use_orig_params=False``, FULL_SHARD): one flat parameter for the root
(``wrap="root"``), or one per Linear (``wrap="linear"``: names gain ``_fsdp_wrapped_module`` at two levels). Or
(``wrap="orig-f16"``) one unit per Linear with ``use_orig_params=True``, float16 autocast and FSDP1's
``ShardedGradScaler``. Only ``bad_rank``'s batch at ``bad_step`` overflows fc1's matmul (bfloat16: inputs of 3e38;
float16: inputs of 6e4, 64 of them summed pass 65504). Writes ``rank{R}.json``; rank 0 also saves the full state
dict gathered when the Guard stopped (``full-state.pt``), for the test to compare with the capture."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nanhunt
from fixtures.models import MLP
from tests.integration.fsdp_guard_worker import D_IN, batch, guarded_step
from tests._support.dist import finish_rank, meet_again

BIG_F16 = 6e4


def _fsdp1(wrap: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = MLP(d_in=D_IN)
    with torch.no_grad():
        model.fc1.weight.abs_()  # so that fc1 sums the big inputs past the autocast dtype's largest value
    policy = ModuleWrapPolicy({nn.Linear}) if wrap != "root" else None
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                    use_orig_params=wrap == "orig-f16")


def f16_batch(rank: int, i: int, *, big: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(rank, i, big=False)
    return (torch.full_like(x, BIG_F16) if big else x), y


def scaled_step(guard: nanhunt.Guard, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, x: torch.Tensor,
                y: torch.Tensor) -> None:
    """One float16 training step with FSDP1's ShardedGradScaler, inside ``guard.step``."""
    with guard.step((x, y)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = guard.loss(F.mse_loss(model(x), y))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        guard.check_grads()
        scaler.step(opt)
        scaler.update()


def _refusal(**kw: Any) -> str | None:
    """What ``nanhunt.Guard`` says when built with ``kw`` on an FSDP1 model (None: it accepted them)."""
    model = _fsdp1("root")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    try:
        nanhunt.Guard(model, opt, None, dump_dir="unused", loss_fn=F.mse_loss, model_kwargs={"d_in": D_IN},
                      **kw).close()
    except ValueError as e:
        return str(e)
    return None


def run(rank: int, world: int, port: int, dump: str, out: str, bad_rank: int, bad_step: int, wrap: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res: dict[str, Any] = {"rank": rank, "stopped_at": None}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        res["refused"] = {"rollback": _refusal(on_fail="rollback"), "snapshot_every": _refusal(snapshot_every=1)}
        model = _fsdp1(wrap)
        res["wrapped_names"] = [n for n, _ in model.named_modules()]
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = None
        if wrap == "orig-f16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler("cpu", init_scale=1024.0)
        guard = nanhunt.Guard(model, opt, scaler, dump_dir=dump, loss_fn=F.mse_loss, model_kwargs={"d_in": D_IN})
        for i in range(5):
            big = rank == bad_rank and i == bad_step
            try:
                if scaler is None:
                    guarded_step(guard, model, opt, *batch(rank, i, big=big))
                else:
                    scaled_step(guard, model, opt, scaler, *f16_batch(rank, i, big=big))
            except nanhunt.GuardError as e:
                res["stopped_at"] = i
                res["event"] = e.event.to_dict()
                res["describe"] = e.event.describe()
                # the pre-update state gathered whole (a collective), for the test to compare with the capture's
                cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)  # on the CPU already
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    full = model.state_dict()
                if rank == 0:
                    torch.save(full, os.path.join(out, "full-state.pt"))
                break
        res["iterations"] = guard.iterations
        meet_again(res)
        guard.close()
    except BaseException as e:  # reported to the test, which fails on it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        finish_rank(out, rank, res)
