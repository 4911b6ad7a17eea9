"""Fixture models for ``nanhunt compare`` (importable by name, e.g. ``tests._support.compare:Flip``).

Every weight that matters is set by hand, so what float16 does to it is known exactly:
float16 has 10 fraction bits, so near 1.0 its spacing is 2**-10 ~ 0.000977 and near 1000 it is 0.5.
"""

from __future__ import annotations

import torch
from torch import nn


def _set(linear: nn.Linear, weight: list[list[float]], bias: list[float] | None = None) -> None:
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(weight))
        linear.bias.copy_(torch.tensor(bias) if bias is not None else torch.zeros(linear.out_features))


class Net(nn.Module):
    """A small classifier with ordinary random weights: within tolerance, no decision changes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # type: ignore[no-any-return]


# Scores of the four samples of FLIP_X (one-hot rows pick one column of the weight). Sample 1: 1.0003 rounds to
# 1.0 in float16, a tie that the tie rule gives to class 0, so float32's class 1 flips. Sample 2: 1.0008 rounds to
# 1.000977, still above 1.0, so its class holds, but its float32 margin (0.0008) is below the tolerance
# (1e-5 + 1e-3 * 1.0008): near the boundary, unchanged.
FLIP_SCORES = [
    [2.0, 0.5, -1.0],
    [1.0, 1.0003, 0.2],
    [1.0, 1.0008, 0.2],
    [-0.5, 0.1, 3.0],
]
FLIP_X = torch.eye(4)
FLIP_Y = torch.tensor([0, 1, 1, 2])


class Flip(nn.Module):
    """A linear classifier whose top two scores for sample 1 are closer than float16 can tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)
        _set(self.head, [list(col) for col in zip(*FLIP_SCORES)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)  # type: ignore[no-any-return]


class Carried(nn.Module):
    """The error is introduced in ``lossy`` and only carried (and magnified) by the later modules.

    ``pre`` duplicates each of the two features, exactly. ``lossy`` computes 1000.1 * a - 1000 * a + 0.5
    = 0.1 a + 0.5; float16 stores 1000.1 as 1000.0, so autocast gives 0.5: an error of 0.1 |a| on values near
    0.5. ``post1`` and ``post2`` double their input and ``head`` adds two features: all exact in float16
    (powers of two, few terms), so they introduce nothing, though the absolute error grows to 4x and more.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(2, 4)
        self.lossy = nn.Linear(4, 4)
        self.post1 = nn.Linear(4, 4)
        self.post2 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        _set(self.pre, [[1, 0], [1, 0], [0, 1], [0, 1]])
        _set(self.lossy, [[1000.1, -1000, 0, 0], [-1000, 1000.1, 0, 0], [0, 0, 1000.1, -1000], [0, 0, -1000, 1000.1]],
             [0.5, 0.5, 0.5, 0.5])
        two = [[2.0 if i == j else 0.0 for j in range(4)] for i in range(4)]
        _set(self.post1, two)
        _set(self.post2, two)
        _set(self.head, [[1, 1, 0, 0], [0, 0, 1, 1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.post2(self.post1(self.lossy(self.pre(x)))))  # type: ignore[no-any-return]


# Multiples of 1/8 in [-1, 1]: exact in float16, so the batch itself carries no error.
CARRIED_X = torch.tensor([[1.0, -0.5], [0.25, 0.75], [-1.0, 0.125], [0.5, 1.0]])
CARRIED_Y = torch.tensor([0, 1, 0, 1])


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x * 100.0)  # exp(100) ~ 2.7e43: beyond float32 (3.4e38) too


class Exploding(nn.Module):
    """Non-finite in float32 already: ``blow`` overflows whatever the precision."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.blow = Exp()
        self.head = nn.Linear(2, 2)
        _set(self.fc, [[1, 0], [0, 1]])
        _set(self.head, [[1, 0], [0, 1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blow(self.fc(x)))  # type: ignore[no-any-return]


class Scalar(nn.Module):
    """Returns its loss, not scores: nothing to classify."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


class Overflow(nn.Module):
    """Finite in float32, Inf under float16 autocast: 300 * 300 = 90000 > 65504 in ``big``."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(2, 2)
        self.big = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)
        _set(self.small, [[1, 0], [0, 1]])
        _set(self.big, [[300, 0], [0, 1]])
        _set(self.head, [[1e-4, 0], [0, 1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.big(self.small(x)))  # type: ignore[no-any-return]


class Underflow(nn.Module):
    """1e-4 * 1e-4 = 1e-8 is below float16's smallest subnormal (6e-8): zero under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        _set(self.fc, [[1e-4, 0], [0, 1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)  # type: ignore[no-any-return]


class RMSNorm(nn.Module):
    """A hand-written RMSNorm: its square runs in the input's dtype (no autocast op), so a float16 value above 256
    makes Inf, and rsqrt(Inf) = 0 turns the row into zeros, finite."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight  # SQUARE


class Absorbed(nn.Module):
    """``fc`` makes 300 (exact in float16) from inputs of 1: its RMSNorm's square overflows float16 and is absorbed,
    the autocast run stays finite (but the norm's output is 0 where float32's is 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.norm = RMSNorm(2)
        self.head = nn.Linear(2, 2)
        _set(self.fc, [[300, 0], [0, 300]])
        _set(self.head, [[1, 0], [0, 1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))  # type: ignore[no-any-return]
