"""The model of accelerate_loop.py and ddp_loop.py, in a module beside them as a project keeps its models:
``exp`` of fc1's output, so an input of 200 overflows float32 (exp(88.7) is the largest finite value)."""

import torch
from torch import nn


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
