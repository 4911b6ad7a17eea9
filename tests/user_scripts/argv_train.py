"""A training script that reads sys.argv in its default values, which nanhunt never edits: the model's width and
the loss's scale come from the command line when their definitions run. The batch of step 2 is scaled past
float16's range, so autocast's cast into fc1 overflows; the Guard records it and the loop (amp_steps.py, beside it)
goes on.

    python argv_train.py HIDDEN SCALE /abs/dump-dir
"""

import sys

import torch
from torch import nn

import nanhunt
from amp_steps import train


class Net(nn.Module):
    def __init__(self, hidden=int(sys.argv[1])):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def my_loss(out, y, scale=float(sys.argv[2])):
    return ((out.float() - y) ** 2).mean() * scale


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
guard = nanhunt.Guard(model, opt, scaler, dump_dir=sys.argv[3], loss_fn=my_loss, on_fail="dump")
train(model, opt, scaler, guard, my_loss, bad_step=2)
