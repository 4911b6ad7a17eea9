"""Fused multi-tensor ops (GradScaler's unscale, foreach and fused optimizers) map output i to input i: the
dataflow graph grows with the number of parameters, not with its square."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.tracing.graph import nonfinite_graph


def _step(n: int, *, fused: bool) -> nanhunt.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n)))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # the first layer's float16 matmul overflows: every gradient goes non-finite
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.ones(2, 4) * 10, torch.zeros(2, 4)
    with nanhunt.trace(model) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return t


@pytest.mark.parametrize("fused", [False, True])
def test_unscale_and_fused_update_edges_grow_linearly(fused: bool) -> None:
    # GIVEN the same failing step with 8 and 32 layers (16 and 64 parameter tensors)
    small, large = _step(8, fused=fused), _step(32, fused=fused)
    # THEN each output of GradScaler's unscale takes its own gradient (and the scale, found_inf), not all of them
    unscale = [r for r in large.records if r.op == "aten::_amp_foreach_non_finite_check_and_unscale_"]
    assert unscale and max(len(r.inputs) for r in unscale if r.shape != ()) <= 3
    # AND the graph's edges grow with the parameters, not with their square (4x the parameters: < 6x edges)
    edges = [nonfinite_graph(t.records).number_of_edges() for t in (small, large)]
    assert edges[1] < 6 * edges[0], edges
    # AND the culprit is still the overflowing matmul
    assert large.first is not None and (large.first.module, large.first.op) == ("0", "aten::addmm")
