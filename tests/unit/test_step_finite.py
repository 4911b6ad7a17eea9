"""The bisection's finiteness check after a trial (``bisect._step_finite``): every tensor the step leaves,
read-only, one host read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanhunt.hunt.bisection import _step_finite


def _trained() -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2).to(torch.float64))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 4)
    loss = model[2](model[1](model[0](x)).double()).sum()
    loss.backward()
    opt.step()
    return model, loss.detach(), opt


@pytest.mark.parametrize("where", ["loss", "weight", "grad", "buffer", "moment"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_value_the_step_leaves_is_seen(where: str, bad: float) -> None:
    # GIVEN a finished step, with one value of one kind of tensor made non-finite
    model, loss, opt = _trained()
    assert _step_finite(model, loss, opt)
    first = model[0]
    target = {"loss": loss, "weight": first.weight.data, "grad": first.weight.grad,
              "buffer": model[1].running_var, "moment": opt.state[first.weight]["exp_avg_sq"]}[where]
    assert target is not None
    values = target.clone()
    target.view(-1)[-1] = bad
    # WHEN checked  THEN it is not finite, and the check wrote nothing
    assert not _step_finite(model, loss, opt)
    assert torch.equal(target.view(-1)[:-1], values.view(-1)[:-1])


def test_large_finite_float64_values_are_finite() -> None:
    # GIVEN a float64 weight holding 1e300 (finite, far above float32's range)
    model, loss, opt = _trained()
    with torch.no_grad():
        model[2].weight[0, 0] = 1e300
    # WHEN checked  THEN still finite (the norms are compared in float64)
    assert _step_finite(model, loss, opt)
