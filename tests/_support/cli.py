"""Importable helpers for CLI tests (factories named as tests._support.cli:...)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

D = 8


def raising_factory() -> nn.Module:
    raise ValueError("config file not found")


class DictLossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "loss": F.mse_loss(logits, labels)}



class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def averaged() -> nn.Module:
    """torch's own SWA/EMA wrapper: its state_dict keys are ``module.fc1.weight``..., ``n_averaged``."""
    from torch.optim.swa_utils import AveragedModel

    return AveragedModel(Net())


class HotNet(nn.Module):
    """fc1 identity, fc2 hot (the weights come from the checkpoint); returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x)) / (D * 2.0**15)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor


class HotKwargs(HotNet):
    """HF style: keyword arguments in, an output object with ``.loss`` out."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:  # type: ignore[override]
        logits = super().forward(x)
        return Output(logits, F.mse_loss(logits, labels))


class HotScalar(HotNet):
    """Takes the batch tensor alone and returns its scalar loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).pow(2).mean()


class FrozenBN(nn.Module):
    """Fine-tuning with a frozen BatchNorm: running variance 1e-4 (x100) feeds fc (weights 100)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.fc = nn.Linear(D, D)
        with torch.no_grad():
            self.bn.running_var.fill_(1e-4)
            self.fc.weight.fill_(100.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x)) * 1e-4


# Importable by the CLI as --model tests._support.cli:InterruptingMLP
class InterruptingMLP(nn.Module):
    """fixtures.models.MLP's layout; its forward is Ctrl-C'd (as if the user pressed it mid-replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


class FrozenBNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))
