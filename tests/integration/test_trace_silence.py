"""Silent findings: a non-finite value absorbed before the loss is silent; one that reaches the loss is not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import where


# ------------------------------------------------------------------ trace(scope=...)


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 100)  # NaN born here for any small x


class _Net(nn.Module):
    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        self.a, self.b, self.no_grad = nn.Linear(4, 4), _Log(), no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.no_grad:
            with torch.no_grad():
                g = self.b(h)
        else:
            g = self.b(h)
        return h.sum() + g.sum()  # the NaN reaches the loss


@pytest.mark.parametrize("no_grad", [False, True])
def test_scoped_origin_that_reaches_the_loss_is_not_called_silent(no_grad: bool) -> None:
    torch.manual_seed(0)
    m = _Net(no_grad)
    x = torch.randn(3, 4)
    with nanhunt.trace(m) as whole:
        m(x).backward()
    assert whole.first is not None and whole.first.op == "aten::log" and not whole.first.silent
    with nanhunt.trace(m, scope=["b"]) as t:
        loss = m(x)
        loss.backward()
    assert math.isnan(loss.item())
    assert t.first is not None and (t.first.module, t.first.op) == ("b", "aten::log")
    # THEN the scoped pass, which records neither the loss nor the output, says it did not measure the reach
    # (None), never "silent"
    assert t.first.reached is None and not t.first.silent
    assert "silent" not in t.first.describe()


# ---------------------------------------------------------------- silent findings in backward and loss


class HookCleaned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.bias.fill_(-100.0)  # relu(h) == 0 everywhere: sqrt backward divides by 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=1.0, neginf=-1.0))  # user gradient sanitiser
        return F.relu(h).sqrt()


def test_backward_inf_absorbed_by_hook_is_silent() -> None:
    torch.manual_seed(0)
    m = HookCleaned()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    occ = t.first
    assert occ is not None and occ.phase is Phase.BACKWARD and occ.kind == "inf"
    assert occ.silent, f"reached={occ.reached} although every parameter gradient is finite"


def test_loss_inf_absorbed_inside_the_loss_is_silent() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    y = torch.tensor([[1.0, 0.0, 0.0]])
    with nanhunt.trace(m) as t:
        p = m(torch.randn(1, 4))
        weight = torch.log(p.detach() * y).clamp(min=-100.0)  # -inf clamped away, no gradient through it
        loss = -(weight * p).sum()
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(q.grad).all() for q in m.parameters())
    occ = t.first
    assert where(occ) == (Phase.LOSS, None, "aten::log", 0, "inf")
    assert occ is not None and occ.silent, f"reached={occ.reached} although the loss is finite"
