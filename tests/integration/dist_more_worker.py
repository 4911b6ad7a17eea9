"""2-process gloo runs on the CPU for test_distributed_names.py and test_fsdp_more.py: ``two_ranks`` starts them
(bounded in time, a stuck rank killed); each entry point below is one rank and writes ``rank{R}.json`` (an ``error``
entry when the rank failed) into ``out``:

- ``trace_run``: a step of ``fixtures.models.MLP`` under DDP or FSDP1 traced by ``nanhunt.trace``; only rank 1's
  batch overflows fc1's float16 matmul. Under DDP the Guard then watches a fresh model on the same batches and
  captures rank 1's step (per-rank files).
- ``gpt2_run``: a tiny GPT-2 (config built here) under FSDP2 or DDP watched by the Guard; at step 1 every label of rank 1's
  batch is -100, so its mean cross entropy divides 0 by 0.
- ``snapshot_run``: the MLP under FSDP2 with ``snapshot_every=1`` and ``check_params``; fc2 starts at zero and the
  targets are zero, so no step moves the weights until rank 1's targets at step 2 make a gradient that SGD's huge
  learning rate turns into infinite weights.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nanhunt
from fixtures.models import MLP
from tests._support.dist import finish_rank, rank_results, run_ranks
from tests.integration.fsdp_guard_worker import guarded_step


def two_ranks(target: Callable[..., None], out: Path, *args: Any, timeout: float) -> dict[int, Any]:
    """Run ``target(rank, 2, port, *args, out)`` in two spawned processes; each rank's ``rank{R}.json``."""
    run_ranks(target, lambda r, port: (r, 2, port, *args, str(out)), timeout=timeout)
    return rank_results(out)


def _rank(rank: int, world: int, port: int, out: str, body: Callable[[dict[str, Any]], None]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        body(res)
    except BaseException as e:  # reported to the test, which fails on it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        finish_rank(out, rank, res)


# --------------------------------------------------------------------- DDP / FSDP1 traces
def _mlp() -> MLP:
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc1.weight.abs_()  # fc1 of a batch near 6e4 sums past float16's 65504
    return m


def _wrap(m: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(m)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # every Linear its own FSDP1 unit: names gain _fsdp_wrapped_module at two levels
    return FullyShardedDataParallel(m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))


def _mlp_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(4, 16, generator=g) + (6e4 if rank == 1 else 0.0)
    return x, torch.randint(0, 4, (4,), generator=g)


def trace_run(rank: int, world: int, port: int, wrapper: str, out: str) -> None:
    def body(res: dict[str, Any]) -> None:
        model = _wrap(_mlp(), wrapper)
        res["wrapped_names"] = [n for n, _ in model.named_modules()]
        x, y = _mlp_batch(rank)
        with nanhunt.trace(model) as t:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            F.cross_entropy(logits.float(), y).backward()
        f = t.first
        res.update(
            first=None if f is None else [f.phase.value, f.module, f.module_class, f.op, f.kind],
            received=None if t.received is None else [t.received.op, t.received.phase.value],
            first_rank=t.first_rank, summary=t.rank_summary, classes=t.module_classes(),
            modules=sorted({r.module for r in t.records if r.module is not None}),
            collectives=sorted({r.op for r in t.records if r.role is nanhunt.Role.RECEIVED and r.op}),
        )
        if wrapper != "ddp":
            return
        # The Guard on a fresh DDP model and the same batch: rank 1 writes its capture files.
        model = _wrap(_mlp(), wrapper)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = nanhunt.Guard(model, opt, None, dump_dir=os.path.join(out, "caps"), loss_fn=F.cross_entropy,
                              dtype=torch.float16)
        try:
            with guard.step((x, y)):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(x)
                loss = guard.loss(F.cross_entropy(logits.float(), y))
                loss.backward()
                opt.step()
        except nanhunt.GuardError as e:
            res["describe"] = e.event.describe()
        guard.close()

    _rank(rank, world, port, out, body)


# --------------------------------------------------------------------- FSDP2: a transformers model
VOCAB, SEQ, BAD_STEP = 64, 8, 1


def gpt2_batch(rank: int, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + i)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.full_like(ids, -100) if rank == 1 and i == BAD_STEP else ids.clone()
    return {"input_ids": ids, "labels": labels}


def gpt2_run(rank: int, world: int, port: int, dump: str, wrapper: str, out: str) -> None:
    def body(res: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                            attn_implementation="eager")
        model: torch.nn.Module = GPT2LMHeadModel(config)
        if wrapper == "ddp":
            model = DistributedDataParallel(model)
        else:
            for block in model.transformer.h:  # type: ignore[union-attr]
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = nanhunt.Guard(model, opt, None, dump_dir=dump)
        res["stopped_at"] = None
        for i in range(4):
            batch = gpt2_batch(rank, i)
            try:
                with guard.step(batch):
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = guard.loss(model(**batch).loss)
                    loss.backward()
                    guard.check_grads()
                    opt.step()
            except nanhunt.GuardError as e:
                res.update(stopped_at=i, event=e.event.to_dict(), describe=e.event.describe())
                break
        guard.close()

    _rank(rank, world, port, out, body)


# --------------------------------------------------------------------- FSDP2: snapshot_every
D_IN, SNAP_BAD_STEP = 64, 2


def snapshot_batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.rand(4, D_IN, generator=g)
    y = torch.full((4, 4), 1e10) if rank == 1 and i == SNAP_BAD_STEP else torch.zeros(4, 4)
    return x, y


def snapshot_run(rank: int, world: int, port: int, dump: str, out: str) -> None:
    def body(res: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = MLP(d_in=D_IN)
        with torch.no_grad():
            model.fc2.weight.zero_()  # the output is fc2's bias, zero: a zero target gives every weight a zero
            model.fc2.bias.zero_()  # gradient, so only rank 1's step 2 moves them (to +-inf at this rate)
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e30)
        guard = nanhunt.Guard(model, opt, None, dump_dir=dump, loss_fn=F.mse_loss, model_kwargs={"d_in": D_IN},
                              snapshot_every=1, check_params=True)
        res["stopped_at"] = None
        for i in range(5):
            x, y = snapshot_batch(rank, i)
            if i == SNAP_BAD_STEP:  # the state the bad step began with, gathered whole (a collective)
                full = {k: v.full_tensor() for k, v in model.state_dict().items()}
                if rank == 0:
                    torch.save(full, os.path.join(out, "began.pt"))
            try:
                guarded_step(guard, model, opt, x, y)
            except nanhunt.GuardError as e:
                res.update(stopped_at=i, event=e.event.to_dict(), describe=e.event.describe())
                live = {k: v.full_tensor() for k, v in model.state_dict().items()}
                res["live_finite"] = bool(all(torch.isfinite(v).all() for v in live.values()))
                break
        guard.close()

    _rank(rank, world, port, out, body)
