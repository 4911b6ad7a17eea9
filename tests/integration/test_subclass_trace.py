"""A user's own ``__torch_dispatch__`` tensor subclass under trace, replay and the Guard.

``Wrapped`` (tests/_support/subclasses.py) wraps its values in one inner tensor and every result again, and runs
only a short list of ops: the trace measures it on its inner tensor. ``Opaque`` (an int8 weight and a scale) has
no way to its values: its record says it was not measured, and the report shows ``not measured``. Neither runs
``aminmax``, ``isnan``, ``clone`` or ``copy_`` (``Opaque``), which nanhunt called on them before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Phase, Role
from nanhunt.report import markdown
from tests._support.subclasses import Opaque, Wrapped


class WrappedModel(nn.Module):
    """exp(x @ w.T) with a ``Wrapped`` weight: every activation and gradient is ``Wrapped`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(Wrapped(torch.eye(4) * 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x @ self.w.t())


class OpaqueModel(nn.Module):
    """x @ w.T + b with a frozen ``Opaque`` weight: 64 * eye, scale 2**60."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(Opaque(torch.eye(4, dtype=torch.int8) * 64, torch.tensor(2.0 ** 60)),
                              requires_grad=False)
        self.b = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t() + self.b


def _x(first: float) -> torch.Tensor:
    x = torch.ones(2, 4)
    x[0, 0] = first
    return x


@pytest.mark.parametrize("level", ["op", "module"])
def test_wrapped_activations_are_traced_on_their_inner_values(level: str) -> None:
    # GIVEN a model whose weight, activations and gradients are Wrapped; x @ w.T holds 128 where x is 2
    model = WrappedModel()
    with nanhunt.trace(model, level=level) as t:
        out = model(_x(2.0))
        assert type(out) is Wrapped
        out.sum().backward()
    first = t.first
    assert first is not None
    assert (first.phase, first.module, first.kind) == (Phase.FORWARD, "", "inf")
    if level == "op":
        # THEN exp(128) is the Inf, from the mm's output measured on its inner tensor: 64 to 128 exactly
        assert first.op == "aten::exp"
        assert [(r.op, r.max, r.min, r.unmeasured) for r in first.inputs] == [("aten::mm", 128.0, 64.0, None)]
    else:
        # THEN the root's output, from its input and its weight (64 on the diagonal, measured inside)
        assert first.op is None
        assert [(r.role, r.max) for r in first.inputs] == [(Role.INPUT, 2.0), (Role.PARAM, 64.0)]


def test_wrapped_weight_survives_a_replay_with_an_update() -> None:
    # GIVEN a Wrapped weight updated by SGD (one tensor at a time: Wrapped has no fused kernel)
    model = WrappedModel()
    before = model.w.elem.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    # WHEN replayed with its update
    report = nanhunt.replay(model, (_x(2.0), None), loss_fn=lambda out: out.sum(), dtype=torch.float32,
                            optimizer=opt)
    # THEN the Inf is named, and the weight is the same object holding the same values as before
    assert report.first is not None and (report.first.op, report.first.kind) == ("aten::exp", "inf")
    assert type(model.w) is Wrapped and torch.equal(model.w.elem, before)


def test_a_subclass_without_a_way_to_its_values_is_recorded_as_not_measured() -> None:
    # GIVEN a frozen Opaque weight (int8 and a scale, no dequantize) and an input that makes x @ w.T overflow
    model = OpaqueModel()
    x = _x(2.0 ** 63)
    with nanhunt.trace(model) as t:
        model(x).sum().backward()
    # THEN the mm is the Inf's origin, and its weight input says it was not measured (read as finite)
    first = t.first
    assert first is not None and (first.module, first.op, first.kind) == ("", "aten::mm", "inf")
    weight = first.inputs[1]
    assert (weight.role, weight.unmeasured, weight.measured, weight.finite) == (Role.PARAM, "Opaque", False, True)
    assert all(r.measured for r in t.records if r.index != weight.index)
    # AND a replay's report shows it so, and the JSON keeps it
    report = nanhunt.replay(model, (x, None), loss_fn=lambda out: out.sum(), dtype=torch.float32)
    md = markdown.render(report)
    assert ("| input 1 | float32 | \\[4, 4\\] | not measured | not measured | not measured | 3.40282e+38 | "
            "not measured | - | - | - | - |") in md
    again = type(report).from_dict(report.to_dict())
    assert again.first is not None and again.first.inputs[1].unmeasured == "Opaque"
    # AND the weight, copied through its inner tensors for the replay, is back as it was
    assert torch.equal(model.w.qdata, torch.eye(4, dtype=torch.int8) * 64) and model.w.scale.item() == 2.0 ** 60


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_guard_reports_a_failure_of_a_model_with_an_opaque_frozen_weight(tmp_path: Any) -> None:
    # GIVEN a Guard over a model with a frozen Opaque weight, and a loop whose third batch overflows x @ w.T
    model = OpaqueModel()
    opt = torch.optim.SGD([model.b], lr=0.1)
    guard = nanhunt.Guard(model, opt, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail="dump", headroom_every=1)
    for step in range(3):
        x = torch.full((2, 4), 2.0 ** -60 if step < 2 else 2.0 ** 63)  # x @ w.T: 64 where w is not 0, then Inf
        with guard.step((x, None)):
            opt.zero_grad()
            loss = guard.loss(model(x).square().mean())
            loss.backward()
            guard.check_grads()
            opt.step()
    # THEN the failure is told (the weights, the Opaque one too, checked and found finite), and the clean steps
    # before it have their headroom history
    failures = [e for e in guard.events if e.kind != "warning"]
    assert [(e.step, e.kind) for e in failures] == [(2, "loss")]
    guard._watch.read()
    assert len(guard._watch.history[("output", guard._watch.names.index("(model)"))]) == 2
