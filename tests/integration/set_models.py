"""Fixture models and batches for validating autocast on a fixed set (``nanhunt compare CKPT SET``).

Importable by name for ``--model`` / ``--metric`` (``tests.integration.set_models:Boundary``). Every weight that
matters is set by hand, so what float16 and bfloat16 do to it is known exactly.
"""

from __future__ import annotations

import torch
from torch import nn


def _set(linear: nn.Linear, weight: list[list[float]], bias: list[float] | None = None) -> None:
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(weight))
        linear.bias.copy_(torch.tensor(bias) if bias is not None else torch.zeros(linear.out_features))


class Boundary(nn.Module):
    """Two features ``(a, b)``, two classes, and an overflow planted for float16 only.

    ``big`` computes ``(400 a, b)``; the scores are ``(1000 / (1 + relu(400 a)), 1 / (1 + relu(b)))``. For
    ``a = 300``, 400 a = 120000 is beyond float16's 65504: ``big`` gives inf, 1 / inf = 0, so score 0 drops from
    0.00833 to 0 and, with ``b = 199`` (score 1 = 0.005), the class flips from 0 to 1. Nothing downstream is
    non-finite: the overflow is absorbed. bfloat16 has the range (120000 becomes 119808): no flip.
    """

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)
        _set(self.big, [[400.0, 0.0], [0.0, 1.0]])
        _set(self.head, [[1000.0, 0.0], [0.0, 1.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.reciprocal(1 + torch.relu(self.big(x))))  # type: ignore[no-any-return]


# Three batch files of four samples: ordinary inputs, edge cases (float16's range nearly used up, large and tiny
# values) and inputs near the decision boundary. The float32 classes are in the comments; one ordinary target
# is wrong on purpose (sample 2), so the float32 accuracy is 11/12, float16's 10/12 (boundary:0 flips),
# bfloat16's 11/12.
SET = {
    "ordinary.pt": (torch.tensor([[0.0, 0.0], [1.0, 1.0], [-2.0, 5.0], [100.0, 0.0]]),  # 0, 0, 0, 1
                    torch.tensor([0, 0, 1, 1])),
    "edge.pt": (torch.tensor([[160.0, 3.0], [150.0, 0.0], [0.0, 60000.0], [0.001, 0.0]]),  # 1, 1, 0, 0
                torch.tensor([1, 1, 0, 0])),
    "boundary.pt": (torch.tensor([[300.0, 199.0], [120.0, 0.0], [1.0, 1.0], [90.0, 150.0]]),  # 0, 1, 0, 0
                    torch.tensor([0, 1, 0, 0])),
}


class Ramp(nn.Module):
    """A regressor ``y = (1 + 2**-12) x``: float16 (10 fraction bits) rounds the weight to 1, so under autocast
    ``y = x`` exactly for the powers of two below."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)
        _set(self.fc, [[1.0 + 2.0 ** -12]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)  # type: ignore[no-any-return]


# targets x + 1: the float32 error per sample is 1 - x / 4096, float16's exactly 1
RAMP_SET = {
    "low.pt": (torch.tensor([[1.0], [2.0]]), torch.tensor([[2.0], [3.0]])),
    "high.pt": (torch.tensor([[4.0], [8.0]]), torch.tensor([[5.0], [9.0]])),
}


def agreement(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """A user metric: the fraction of samples whose top-1 class is the target (argmax: no tie rule)."""
    return float((outputs.argmax(dim=1) == targets).double().mean())


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.double() - targets.double()).square().sum())


squared_error.higher_is_better = False  # type: ignore[attr-defined]
