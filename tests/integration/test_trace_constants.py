"""Non-finite constants and scalars (NaN sentinels, masked_fill, lr) are scalar-seeded or clean, not origins."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import where


# ---------------------------------------------------------------- constants made in forward (lift_fresh)


class NanSentinelMean(nn.Module):
    """A clean, common pattern: mark entries NaN with a tensor constant, then nanmean them away."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.where(h > 0, h, torch.tensor(float("nan")))
        return torch.nanmean(h)


def test_tensor_nan_constant_then_nanmean_is_clean() -> None:
    torch.manual_seed(0)
    m = NanSentinelMean()
    with nanhunt.trace(m) as t:
        out = m(torch.randn(8, 4))
        out.backward()
    assert torch.isfinite(out) and all(torch.isfinite(p.grad).all() for p in m.parameters())
    # The same code with a Python-scalar NaN is clean (see test_python_nan_scalar_then_nanmean_is_clean).
    assert t.first is None, t.first.describe() if t.first else ""


class AssignNan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y[y > 0.5] = float("nan")  # index_put_ of a scalar: the batch holds no NaN
        return y.sum()


def test_scalar_assignment_is_not_phase_input() -> None:
    m = AssignNan()
    x = torch.ones(4, 2)
    with nanhunt.trace(m) as t:
        out = m(x)
    assert torch.isnan(out) and torch.isfinite(x).all()
    occ = t.first
    assert occ is not None
    # The NaN comes from the scalar the model's code wrote: forward, in the model, named by an op.
    assert occ.phase is Phase.FORWARD and occ.module == "" and occ.op is not None, occ.describe()


class TimesInfTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * torch.tensor(float("inf"))).sum()


def test_zero_dim_tensor_constant_is_not_phase_input() -> None:
    m = TimesInfTensor()
    with nanhunt.trace(m) as t:
        m(torch.ones(4, 2))
    occ = t.first
    assert occ is not None
    assert occ.phase is Phase.FORWARD and occ.op is not None, occ.describe()


# ---------------------------------------------------------------- scalar lists (foreach optimizers)


def test_foreach_adam_nan_lr_is_scalar_seeded_like_the_other_paths() -> None:
    seen: dict[str, str | None] = {}
    for label, kw in (("for-loop", {"foreach": False}), ("fused", {"fused": True}), ("foreach", {"foreach": True})):
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        opt = torch.optim.Adam(m.parameters(), lr=0.1, **kw)  # type: ignore[arg-type]
        opt.param_groups[0]["lr"] = math.nan  # Adam's constructor refuses nan; a scheduler does not
        with nanhunt.trace(m) as t:
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
        occ = t.first
        assert occ is not None and occ.phase is Phase.UPDATE
        seen[label] = occ.output.nonfinite_scalar
    # for-loop and fused say: the NaN came from a scalar (no op created it); foreach must say the same
    assert seen == {"for-loop": "nan", "fused": "nan", "foreach": "nan"}, seen


# ---------------------------------------------------------------- autocast weight cache


def test_autocast_cached_weight_is_not_phase_input() -> None:
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.fill_(1e5)  # fine in float32, Inf once cast to float16
    x = torch.ones(1, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        lin(x)  # an earlier micro-batch: autocast caches the float16 weight
        with nanhunt.trace(lin) as t:
            lin(x)
    occ = t.first
    assert occ is not None
    assert occ.phase is not Phase.INPUT, occ.describe()  # the batch is all ones


# ---------------------------------------------------------------- scalar-seeded NaN in a forward-only step


def test_scalar_seeded_nan_in_forward_only_output_is_reported() -> None:
    m = FillNan()
    with torch.no_grad(), nanhunt.trace(m) as t:
        out = m(torch.ones(3))
    assert torch.isnan(out).all()
    # t.first is None only "when everything stayed finite"; a NaN (never an intentional mask) reached the output
    assert where(t.first) == (Phase.FORWARD, "", "aten::masked_fill", 0, "nan")



class PythonNanSentinel(NanSentinelMean):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.where(h > 0, h, float("nan"))
        return torch.nanmean(h)


def test_python_nan_scalar_then_nanmean_is_clean() -> None:
    torch.manual_seed(0)
    m = PythonNanSentinel()
    with nanhunt.trace(m) as t:
        m(torch.randn(8, 4)).backward()
    assert t.first is None


class FillNan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x > 0.5, float("nan"))


def test_masked_fill_nan_scalar_is_scalar_seeded_not_origin() -> None:
    m = FillNan()
    with nanhunt.trace(m) as t:
        m(torch.ones(3)).sum()  # the loss
    occ = t.first
    assert where(occ) == (Phase.FORWARD, "", "aten::masked_fill", 0, "nan")
    assert occ is not None and occ.output.nonfinite_scalar == "nan"


def test_minus_inf_tensor_constant_is_no_origin() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.masked_fill(torch.tensor([True, False, False]), torch.tensor(float("-inf"))).softmax(-1)

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(3))
    assert t.first is None


@pytest.mark.parametrize("kw", [{"fused": True}, {"foreach": False}], ids=["fused", "for-loop"])
def test_adam_nan_lr_is_scalar_seeded(kw: dict[str, bool]) -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    opt = torch.optim.Adam(m.parameters(), lr=0.1, **kw)  # type: ignore[arg-type]
    opt.param_groups[0]["lr"] = math.nan
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
    occ = t.first
    assert occ is not None and (occ.phase, occ.module, occ.kind) == (Phase.UPDATE, None, "nan")
    assert occ.output.nonfinite_scalar == "nan"
