"""The optimizer's last update, measured from its state (nanhunt.hunt._update): exactly the update it made."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanhunt.hunt._update import last_update, optimizer_settings


def _one_step(make: type[torch.optim.Optimizer], steps: int, **kw: float | bool) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    opt = make(model.parameters(), **kw)  # type: ignore[call-arg]
    before = model.weight.detach().clone()
    for i in range(steps):
        before = model.weight.detach().clone()
        opt.zero_grad()
        model(torch.randn(16, 8, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        opt.step()
    moved = torch.linalg.vector_norm((model.weight.detach() - before).double()) / torch.linalg.vector_norm(before.double())
    return model, opt, float(moved)


@pytest.mark.parametrize("make, kw", [
    (torch.optim.Adam, {"lr": 0.3}),
    (torch.optim.Adam, {"lr": 0.3, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.3, "weight_decay": 0.0}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
])
def test_the_last_update_is_the_one_the_optimizer_made(make: type[torch.optim.Optimizer], kw: dict[str, float]) -> None:
    # GIVEN three steps of an optimizer whose state tells its update
    model, opt, moved = _one_step(make, 3, **kw)
    # WHEN the last update is read back from that state alone
    u = last_update(opt, model)
    # THEN it is the update the third step made, relative to the weight it was applied to
    assert u is not None and u["at"] == "weight" and u["params"] == 1
    assert math.isclose(u["ratio"], moved, rel_tol=1e-4)
    assert u["how"] == ("SGD's momentum buffer" if make is torch.optim.SGD else "Adam's moments after its step 3"
                        + (" (decoupled weight decay left out)" if make is torch.optim.AdamW else ""))


def test_an_optimizer_whose_state_does_not_tell_its_update_gives_none() -> None:
    # plain SGD keeps no state; Nesterov's update needs the gradient too; RMSprop is not one of the two families
    for make, kw in ((torch.optim.SGD, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
                     (torch.optim.RMSprop, {"lr": 0.1})):
        model, opt, _ = _one_step(make, 2, **kw)
        assert last_update(opt, model) is None
    model = nn.Linear(2, 2)
    assert last_update(torch.optim.Adam(model.parameters()), model) is None  # no step taken yet


def test_the_settings_hold_each_group_and_say_where_they_differ() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.AdamW([{"params": a.parameters(), "lr": 1e-3}, {"params": b.parameters(), "lr": 1e4}],
                            weight_decay=0.1)
    s = optimizer_settings(opt)
    assert s is not None
    assert s["optimizer"] == "AdamW" and s["groups"] == 2
    assert s["hyper"]["lr"] == [1e-3, 1e4]
    assert s["hyper"]["weight_decay"] == 0.1 and s["hyper"]["betas"] == [0.9, 0.999]
    assert optimizer_settings(None) is None
