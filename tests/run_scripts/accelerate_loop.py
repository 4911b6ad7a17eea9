"""An accelerate loop as people write them: ``Accelerator`` on the CPU, ``prepare``, ``accelerator.backward``, a
functional loss (``F.cross_entropy``). The model applies ``exp`` to fc1's output; batch ``--bad-step`` holds an
input of 200, for which that exp overflows float32, so the loss of that step is NaN. nanhunt never edits this
file."""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ExpNet(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 3)
        with torch.no_grad():
            self.fc1.weight.fill_(0.5)
            self.fc1.bias.zero_()

    def forward(self, x):
        return self.fc2(torch.exp(self.fc1(x)))


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
