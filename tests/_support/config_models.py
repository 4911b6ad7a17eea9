"""A user's model.py of the config-dataclass pattern (``Net(Cfg(...))`` returning ``(output, loss)``), for the tests
of how a capture records and rebuilds a model's construction: this module plays the file ``--model`` confirms."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

HERE = __name__  # the module --model names


@dataclasses.dataclass
class Cfg:
    width: int = 4
    n_layer: int = 2
    dropout: float = 0.0


class Net(nn.Module):
    """The config-dataclass pattern: ``Net(Cfg(...))``, the config kept as ``self.config``."""

    def __init__(self, config: Cfg) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([nn.Linear(config.width, config.width) for _ in range(config.n_layer)])
        self.drop = nn.Dropout(config.dropout)
        print("number of parameters:", sum(p.numel() for p in self.parameters()))  # as nanoGPT's does

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            x = self.drop(layer(x))
        return x, nn.functional.mse_loss(x, y)
