"""Importable helpers for CLI tests (factories named as tests.helpers_cli:...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def raising_factory() -> nn.Module:
    raise ValueError("config file not found")


class DictLossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "loss": F.mse_loss(logits, labels)}
