"""An accelerate loop as people write them: ``Accelerator`` on the CPU, ``prepare``, ``accelerator.backward``, a
functional loss (``F.cross_entropy``). The model (expnet.py, beside it) applies ``exp`` to fc1's output; batch
``--bad-step`` holds an input of 200, for which that exp overflows float32, so the loss of that step is NaN.
nanhunt never edits this file."""

import argparse

import torch
import torch.nn.functional as F
from expnet import ExpNet
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bad-step", type=int, default=-1)
    a = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(48, 4, generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    if a.bad_step >= 0:
        x[a.bad_step * 8] = 200.0
    model = ExpNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (xb, yb) in enumerate(loader):
        if step >= a.steps:
            break
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        print(f"step {step} loss {loss.item()!r}")


if __name__ == "__main__":
    main()
