"""A training script as users write it, which nanhunt never edits: its arguments are parsed at the module level,
its model takes its width from them as a default, its loss reads them when called, and a Guard watches the loop
(amp_steps.py, beside it). The batch of step --bad-step is scaled past float16's range, so autocast's cast into fc1
overflows.

    python argparse_train.py --hidden 16 --dump-dir /abs/nan [--on-fail raise|dump]
"""

import argparse

import torch
from torch import nn

import nanhunt
from amp_steps import train

parser = argparse.ArgumentParser()
parser.add_argument("--hidden", type=int, default=8)
parser.add_argument("--scale", type=float, default=1.0)
parser.add_argument("--bad-step", type=int, default=2)
parser.add_argument("--dump-dir", default="nan")
parser.add_argument("--on-fail", default="raise")
args = parser.parse_args()
HIDDEN = args.hidden


class Net(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def my_loss(out, y):
    return ((out.float() - y) ** 2).mean() * args.scale


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
guard = nanhunt.Guard(model, opt, scaler, dump_dir=args.dump_dir, loss_fn=my_loss, on_fail=args.on_fail)
train(model, opt, scaler, guard, my_loss, bad_step=args.bad_step)
