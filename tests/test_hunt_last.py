"""Review of the bisection/capture commit (f7f2f8f): common cases that must behave as before."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt._errors import CommandError
from nanhunt.capture import load_step, map_state_dict
from tests.models import clean_mlp


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


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "module._orig_mod."])
def test_map_state_dict_ddp_and_compile_prefixes_and_one_error_for_a_missing_key(prefix: str) -> None:
    m = clean_mlp()
    sd = m.state_dict()
    out = map_state_dict({prefix + k: v for k, v in sd.items()}, m)
    assert sorted(out) == sorted(sd) and all(out[k] is sd[k] for k in sd)
    with pytest.raises(CommandError, match="missing fc2.bias"):
        map_state_dict({prefix + k: v for k, v in sd.items() if k != "fc2.bias"}, m)


class FrozenBNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@pytest.mark.parametrize("train", [None, True, False])
def test_load_step_per_module_flags(train: bool | None, tmp_path: Path) -> None:
    m = FrozenBNNet().train()
    m.bn.eval()
    x, y = torch.randn(4, 4), torch.zeros(4, 4)
    nanhunt.save_capture(tmp_path / "ck.pt", tmp_path / "b.pt", model=m, batch=(x, y), loss_fn=F.mse_loss,
                         model_factory="tests.test_hunt_last:FrozenBNNet")
    step = load_step(str(tmp_path / "ck.pt"), str(tmp_path / "b.pt"), train=train)
    flags = {n: mod.training for n, mod in step.model.named_modules()}
    if train is False:
        assert not any(flags.values())
    else:
        assert flags == {"": True, "fc": True, "bn": False}


def test_bisect_ordinary_float16_overflow_answer_unchanged() -> None:
    from tests.models import fp16_overflow_mlp

    m = fp16_overflow_mlp()
    rep = nanhunt.replay(m, (torch.full((2, 4), 100.0), torch.zeros(2, 3)), loss_fn=F.mse_loss, bisect=True)
    v = rep.verdict
    assert v is not None and (v.kind, v.culprits, v.confirmed) == ("precision", ("fc1", "fc2"), True)
