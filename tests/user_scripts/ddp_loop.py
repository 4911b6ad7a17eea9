"""A plain DistributedDataParallel loop as people write them, started by torchrun (gloo on the CPU): the model
(expnet.py, beside it) wrapped before the optimizer is made, each rank its own batches. Rank 1's batch
``--bad-step`` holds an input of 200, for which the model's ``exp`` overflows float32: the loss on rank 1 is NaN
at that step, rank 0's is finite. nanhunt never edits this file."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from expnet import ExpNet
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bad-step", type=int, default=-1)
    a = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(ExpNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(10 + rank)
    try:
        for step in range(a.steps):
            x = torch.rand(8, 4, generator=g)
            y = torch.randint(0, 3, (8,), generator=g)
            if rank == 1 and step == a.bad_step:
                x[0] = 200.0
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            print(f"rank {rank} step {step} loss {loss.item()!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
