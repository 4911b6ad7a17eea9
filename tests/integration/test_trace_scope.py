"""scope=: an op-level pass restricted to a suspect module (the zoom after a module-level pass)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.abs() * 1000 + 100)  # overflows float32 whatever x is


class SqrtZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * 0)


def _net(bad: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), bad), nn.Linear(8, 2))


def test_scoped_pass_names_the_op_in_the_suspect() -> None:
    m = _net(Exp())
    with nanhunt.trace(m, level="module") as coarse:
        m(torch.randn(3, 4)).sum().backward()
    assert coarse.first is not None and coarse.first.module == "1.1" and coarse.first.op is None
    with nanhunt.trace(m, scope=["1"]) as fine:
        m(torch.randn(3, 4)).sum().backward()
    assert fine.first is not None
    assert (fine.first.phase.value, fine.first.module, fine.first.op) == ("forward", "1.1", "aten::exp")
    # nothing outside the scope was recorded
    assert {r.module for r in fine.records} <= {"1", "1.0", "1.1"}


def test_scoped_pass_sees_backward_of_the_scope_only() -> None:
    m = _net(SqrtZero())
    with nanhunt.trace(m, scope=["1.1"]) as t:
        m(torch.randn(3, 4)).sum().backward()
    assert t.first is not None
    assert (t.first.phase.value, t.first.module, t.first.op) == ("backward", "1.1", "aten::div")


def test_outside_the_scope_nothing_is_found() -> None:
    m = _net(Exp())
    with nanhunt.trace(m, scope=["2"]) as t:
        m(torch.randn(3, 4)).sum().backward()
    # the Inf enters "2" from outside: named as entering the scope, not as born in an op
    assert t.first is not None and t.first.module == "2" and t.first.op is None
    assert t.first.output.role.value == "input"


def test_scope_validation() -> None:
    m = _net(Exp())
    with pytest.raises(KeyError):
        with nanhunt.trace(m, scope=["nope"]):
            pass
    with pytest.raises(ValueError):
        nanhunt.trace(m, level="module", scope=["1"])
