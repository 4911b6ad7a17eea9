"""Overflow in dtype casts (float8, float64 to half, copy_, out=, integer scalars) is born in the cast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import where


# ---------------------------------------------------------------- derived casts: float8


class Float8Cast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float8_e5m2)  # 1e5 > 57344 (e5m2 max): Inf born in this cast
        return y.float() * 2


def test_float8_cast_overflow_is_born_in_the_cast() -> None:
    m = Float8Cast()
    with nanhunt.trace(m) as t:
        out = m(torch.full((4,), 1e5))
    assert torch.isinf(out).all()
    assert where(t.first) == (Phase.FORWARD, "", "aten::_to_copy", 0, "inf")


class DoubleToHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half().float() * 2  # torch casts float64 -> float32 -> float16: 65519.999 -> 65520 -> inf


def test_float64_to_half_overflow_is_born_in_the_cast() -> None:
    m = DoubleToHalf()
    with nanhunt.trace(m) as t:
        out = m(torch.full((4,), 65519.999, dtype=torch.float64))
    assert torch.isinf(out).all()
    assert where(t.first) == (Phase.FORWARD, "", "aten::_to_copy", 0, "inf")


@pytest.mark.parametrize("broadcast", [False, True], ids=["same-shape", "broadcast"])
def test_copy_cast_overflow_into_fresh_buffer(broadcast: bool) -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros((3, 4) if broadcast else (4,), dtype=torch.float16)
            buf.copy_(x)  # float32 1e5 into float16
            return buf.float().sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.tensor([1.0, 2.0, 1e5, 3.0]))
    assert where(t.first) == (Phase.FORWARD, "", "aten::copy_", 0, "inf")


def test_out_argument_into_fresh_buffer() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros(4)
            torch.exp(x, out=buf)
            return buf

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.full((4,), 100.0))
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")


def test_integer_scalar_overflow_in_half_is_an_origin() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.half() * 70000  # the int scalar itself does not fit float16

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(2))
    assert where(t.first) == (Phase.FORWARD, "", "aten::mul", 0, "inf")
