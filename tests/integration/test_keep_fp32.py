"""nanhunt.keep_fp32 under autocast: the same as a manual float32 region; half BatchNorm stats update."""

from __future__ import annotations

import copy

import torch
from torch import nn

import nanhunt


class TiedTwiceBN(nn.Module):
    """Tied embedding/head, a block with a training BatchNorm called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4, bias=False)
        self.blk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(self.blk(self.emb(x))))


def test_keep_fp32_float32_model_under_autocast_is_exactly_a_manual_fp32_region() -> None:
    torch.manual_seed(0)
    m = TiedTwiceBN().train()
    ref = copy.deepcopy(m)
    x = torch.randn(8, 4)
    with nanhunt.keep_fp32(m, ["blk", "head"]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().sum().backward()
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = ref.emb(x)
    with torch.autocast("cpu", enabled=False):
        o = ref.head(ref.blk(ref.blk(e.float())))
    o.sum().backward()
    assert torch.equal(out, o)
    bn, rbn = m.blk[1], ref.blk[1]
    assert torch.equal(bn.running_mean, rbn.running_mean) and torch.equal(bn.running_var, rbn.running_var)
    assert bn.num_batches_tracked.item() == rbn.num_batches_tracked.item() == 2
    assert torch.equal(m.emb.weight.grad, ref.emb.weight.grad)
    assert m.emb.weight is m.head.weight and isinstance(m.blk[0].weight, nn.Parameter)


def test_keep_fp32_half_model_batchnorm_updates_its_half_running_stats() -> None:
    torch.manual_seed(0)
    m = TiedTwiceBN().train().half()
    x = torch.randn(8, 4).half()
    with nanhunt.keep_fp32(m, ["blk"]):
        out = m(x)
    out.float().sum().backward()
    bn = m.blk[1]
    assert out.dtype == torch.float16 and bn.running_mean.dtype == torch.float16
    assert bn.num_batches_tracked.item() == 2 and bn.running_mean.abs().sum() > 0
    assert m.blk[0].weight.grad is not None and m.blk[0].weight.grad.dtype == torch.float16
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float16 for p in m.parameters())
