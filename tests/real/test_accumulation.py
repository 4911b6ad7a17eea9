"""Gradient accumulation: two micro-batches in one trace, one GradScaler update."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase

from . import builders as B
from .builders import where


def _model() -> nn.Module:
    """NormMLP with fc2 grown: its float16 addmm fits on ordinary inputs, and overflows on inputs 5x larger."""
    torch.manual_seed(0)
    m = B.NormMLP().train()
    B.scale_weight(m, "fc2", 2e4)
    return m


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = B.gen()
    x, y = torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    return [(x, y), (x * 5, y)]  # micro-batch 1 fits, micro-batch 2 (larger features) overflows fc2


def _accumulate(m: nn.Module, micro: list[tuple[torch.Tensor, torch.Tensor]], scaler: torch.amp.GradScaler,
                opt: torch.optim.Optimizer) -> None:
    for x, y in micro:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(x), y) / len(micro)
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def test_overflow_in_the_second_micro_batch_is_fc2_call_1() -> None:
    # GIVEN fc2 overflowing float16 on micro-batch 2 only; micro-batch 1's whole step (backward too) is finite
    micro = _micro_batches()
    _, x1, y1 = B.fp32_io(_model(), "fc2", micro[0][0])
    _, x2, y2 = B.fp32_io(_model(), "fc2", micro[1][0])
    assert y1 < B.F16_MAX / 2 and x2 < B.F16_MAX < y2
    alone = _model()
    B.amp_step(alone, *micro[0], loss_fn=F.cross_entropy, scaler=torch.amp.GradScaler("cpu"))
    assert all(bool(torch.isfinite(p.grad).all()) for p in alone.parameters())
    m = _model()
    # WHEN both micro-batches and the update run inside one trace
    with nanhunt.trace(m) as t:
        _accumulate(m, micro, torch.amp.GradScaler("cpu"), torch.optim.AdamW(m.parameters(), lr=1e-3))
    # THEN fc2's second call (micro-batch 2's forward) is where the Inf is born
    assert where(t.first) == (Phase.FORWARD, "fc2", "aten::addmm", 1, "inf")
    assert t.first is not None and {"loss", "gradients"} <= set(t.first.reached or ())
    assert all(o.call_index == 1 for o in t.origins if o.module == "fc2" and o.phase is Phase.FORWARD)


def test_overflow_in_the_first_micro_batch_leads_over_the_second() -> None:
    # GIVEN both micro-batches with the large features: fc2 overflows in each
    x, y = _micro_batches()[1]
    m = _model()
    # WHEN traced together
    with nanhunt.trace(m) as t:
        _accumulate(m, [(x, y), (x.flip(0), y.flip(0))], torch.amp.GradScaler("cpu"),
                    torch.optim.AdamW(m.parameters(), lr=1e-3))
    # THEN the first call leads; the second call's overflow is listed after it
    assert where(t.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    fc2 = [o.call_index for o in t.origins if (o.module, o.op) == ("fc2", "aten::addmm") and o.phase is Phase.FORWARD]
    assert fc2 == [0, 1]


def test_replay_of_the_bad_micro_batch() -> None:
    # GIVEN the micro-batch a Guard would capture (the second), the model as it was before the step
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    before = copy.deepcopy(m.state_dict())
    # WHEN replayed and bisected
    r = B.replayed(m, *_micro_batches()[1], loss_fn=F.cross_entropy, scaler=torch.amp.GradScaler("cpu"),
                   optimizer=opt)
    # THEN fc2's addmm (its only call in this replay), fc2 alone proven; the model is left as it was
    assert where(r.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", ("fc2",), True)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
