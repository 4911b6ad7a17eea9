"""Ops are attributed to their module: double backward, weight-norm pre-hooks, shared submodules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import where


class Pow15(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(1.5)  # d/dx finite at 0; d2/dx2 = 0.75 x^-0.5 = inf at 0


class PenaltyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = Pow15()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x)


def test_double_backward_op_keeps_its_module() -> None:
    net = PenaltyNet()
    x = torch.zeros(3, requires_grad=True)
    with nanhunt.trace(net) as t:
        y = net(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        g.sum().backward()
    assert torch.isinf(x.grad).all()
    occ = t.first
    assert occ is not None and occ.phase is Phase.BACKWARD and occ.kind == "inf"
    # The node it runs was made by the backward of p's pow: the op belongs to p, not to "outside the model".
    assert occ.module == "p", occ.describe()


# ---------------------------------------------------------------- user forward pre-hooks (old weight_norm)


def test_weight_norm_pre_hook_ops_belong_to_their_module() -> None:
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):
        wn = torch.nn.utils.weight_norm(nn.Linear(4, 4))  # recomputes .weight in a forward pre-hook
    m = nn.Sequential(nn.Linear(4, 4), wn)
    with torch.no_grad():
        wn.weight_v[0].zero_()  # g * v / ||v|| with v == 0: 0/0
        wn.weight_g[0] = 0.0
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    assert where(t.first) == (Phase.FORWARD, "1", "aten::_weight_norm_interface", 0, "nan")


def test_shared_submodule_under_two_names_uses_first_name() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = self.a
            self.c = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(x) * 1e38)

    torch.manual_seed(0)
    m = Two()
    with torch.no_grad():
        m.a.weight.fill_(1e38)
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 4)).sum().backward()
    assert where(t.first) == (Phase.FORWARD, "a", "aten::addmm", 0, "inf")
