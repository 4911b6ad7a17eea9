"""A plain float16 + GradScaler training loop, as people write them: arguments parsed at module level, the model
defined in the script, a torch.nn loss. Batch ``--bad-step`` holds an input of 1e6, above float16's 65504: its
cast to float16 in fc1 (the first op autocast runs in float16) is Inf, and the loss is NaN at that step. Prints
one loss per step. nanhunt never edits this file."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--hidden", type=int, default=8)
parser.add_argument("--bad-step", type=int, default=-1)
parser.add_argument("--dtype", default="float16")
args = parser.parse_args()
HIDDEN = args.hidden


class Net(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def batches(n):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        x = torch.randn(8, 4, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        if i == args.bad_step:
            x[0] = 1e6  # above float16's 65504: fc1's input cast to float16 is Inf
        yield x, y


def main():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    criterion = nn.CrossEntropyLoss()
    dtype = getattr(torch, args.dtype)
    for step, (x, y) in enumerate(batches(args.steps)):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
            loss = criterion(out, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item()!r}")


if __name__ == "__main__":
    main()
