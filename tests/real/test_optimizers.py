"""Real optimizers: a float16 model (``model.half()``) with Adam / AdamW, foreach and single-tensor, whose update
divides by zero; AdamW with decay / no-decay parameter groups, through the API and a capture."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt import Phase

from . import builders as B
from .builders import where

DEAD = 5  # hidden unit of fc1 that never fires


def _half_mlp() -> nn.Module:
    """fc1 -> ReLU -> fc2 in float16, hidden unit 5 dead (bias -100): its weights' gradients are exactly 0."""
    torch.manual_seed(0)
    m = B.MLP()
    with torch.no_grad():
        m.fc1.bias[DEAD] = -100.0
    return m.half().train()


def _half_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = B.gen()
    return torch.randn(2, 16, generator=g).half(), torch.randn(2, 4, generator=g).half()


OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
CASES = [(name, foreach) for name in OPTIMIZERS for foreach in (False, True)]
IDS = [f"{n}-{'foreach' if f else 'single-tensor'}" for n, f in CASES]


def _opt(m: nn.Module, name: str, foreach: bool, eps: float = 1e-8) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](m.parameters(), lr=1e-3, eps=eps, foreach=foreach)


def _update_op(foreach: bool) -> str:
    # single-tensor: param.addcdiv_(exp_avg, denom); foreach: torch._foreach_addcdiv_(params, exp_avgs, denoms)
    return "aten::_foreach_addcdiv_" if foreach else "aten::addcdiv_"


@pytest.mark.parametrize(("name", "foreach"), CASES, ids=IDS)
def test_half_model_adam_eps_underflow_is_born_in_the_update(name: str, foreach: bool) -> None:
    # GIVEN a model.half() model and Adam(W) with eps=1e-8, which is 0 in float16: for the dead unit
    # exp_avg = exp_avg_sq = 0, so the update is 0 / (0 + 0) = NaN
    assert float(torch.tensor(1e-8, dtype=torch.float16)) == 0.0
    m = _half_mlp()
    x, y = _half_batch()
    opt = _opt(m, name, foreach)
    # WHEN one step (no autocast: the model is float16 already) runs with the update inside the trace
    t = B.traced(m, x, y, loss_fn=F.mse_loss, optimizer=opt, dtype=torch.float32)
    # THEN the gradients were finite and the dead unit's exactly 0; the NaN is born in the update's addcdiv, which
    # belongs to no module, and reaches only the update
    assert m.fc1.weight.grad is not None and bool(torch.isfinite(m.fc1.weight.grad).all())
    assert bool((m.fc1.weight.grad[DEAD] == 0).all())
    assert where(t.first) == (Phase.UPDATE, None, _update_op(foreach), 0, "nan")
    assert t.first is not None and t.first.reached == ("update",)


@pytest.mark.parametrize("autocast", [False, True],
                         ids=["no-autocast", "autocast-fp16"])
@pytest.mark.parametrize(("name", "foreach"), CASES, ids=IDS)
def test_half_model_adam_eps_underflow_replay_says_precision_of_the_update(name: str, foreach: bool,
                                                                           autocast: bool) -> None:
    # GIVEN the same step; in float32 (weights, gradients and optimizer state) eps=1e-8 is representable and the
    # update is finite -- checked here without nanhunt
    m32 = copy.deepcopy(_half_mlp()).float()
    x, y = _half_batch()
    B.amp_step(m32, x.float(), y.float(), loss_fn=F.mse_loss, optimizer=_opt(m32, name, foreach),
               dtype=torch.float32)
    assert all(bool(torch.isfinite(p).all()) for p in m32.parameters())
    m = _half_mlp()
    # WHEN replayed and bisected, as run (no autocast) or under float16 autocast
    r = B.replayed(m, x, y, loss_fn=F.mse_loss, optimizer=_opt(m, name, foreach),
                   dtype=torch.float16 if autocast else torch.float32)
    # THEN the same origin; a precision problem of the update (no module of the model can fix it): keep float32
    # master weights and optimizer state
    assert where(r.first) == (Phase.UPDATE, None, _update_op(foreach), 0, "nan")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("precision", ("<update>",), True)
    assert v.fix is not None and "float32" in v.fix and "master" in v.fix


@pytest.mark.parametrize(("name", "foreach"), CASES, ids=IDS)
def test_half_model_adam_with_representable_eps_is_clean(name: str, foreach: bool) -> None:
    # GIVEN the same model with eps=1e-4 (a float16 normal number): 0 / 1e-4 = 0
    x, y = _half_batch()
    m = _half_mlp()
    # WHEN traced and replayed THEN nothing non-finite, nothing named
    t = B.traced(m, x, y, loss_fn=F.mse_loss, optimizer=_opt(m, name, foreach, eps=1e-4), dtype=torch.float32)
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())
    assert t.first is None
    m = _half_mlp()
    r = B.replayed(m, x, y, loss_fn=F.mse_loss, optimizer=_opt(m, name, foreach, eps=1e-4), dtype=torch.float32)
    assert (r.status, r.first) == ("clean", None)


def test_half_model_adam_capture_replayed_by_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture of the float16 model, its Adam (eps=1e-8) and the batch, float16 autocast
    m = _half_mlp()
    x, y = _half_batch()
    # WHEN `nanhunt replay` runs on it
    rc, r = B.cli_replay(tmp_path, monkeypatch, model=m, batch=(x, y), loss_fn=F.mse_loss,
                         optimizer=_opt(m, "Adam", False), dtype=torch.float16)
    # THEN the update's addcdiv_, a precision problem of the update
    assert rc == 1
    assert where(r.first) == (Phase.UPDATE, None, "aten::addcdiv_", 0, "nan")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits) == ("precision", ("<update>",))


# ---------------------------------------------------------------- AdamW decay / no-decay parameter groups


def _grouped_adamw(m: nn.Module) -> torch.optim.Optimizer:
    """The usual split: weight decay on the matrices, none on biases and LayerNorm parameters. The groups'
    order differs from model.parameters() and equal shapes (fc2.bias, norm.weight, norm.bias) sit in both."""
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and not n.startswith("norm.")]
    no_decay = [p for n, p in m.named_parameters() if not (n.endswith("weight") and not n.startswith("norm."))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3)


def _grouped_after_one_step() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """NormMLP after one clean step (so AdamW holds exp_avg / exp_avg_sq per parameter), then fc2 grown so
    that its float16 addmm overflows."""
    torch.manual_seed(0)
    m = B.NormMLP().train()
    opt = _grouped_adamw(m)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _nm_batch()
    B.amp_step(m, x, y, loss_fn=F.cross_entropy, scaler=scaler, optimizer=opt)
    opt.zero_grad(set_to_none=True)
    assert len(opt.state) == 8 and all(torch.isfinite(p).all() for p in m.parameters())
    B.scale_weight(m, "fc2", 1.5e5)
    return m, opt, scaler


def _nm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = B.gen()
    return torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)


def test_param_groups_step_trace_and_replay() -> None:
    # GIVEN AdamW with decay / no-decay groups holding state, and fc2 overflowing float16
    m, opt, scaler = _grouped_after_one_step()
    x, y = _nm_batch()
    B.assert_overflows_only_in_fp16(m, "fc2", x)
    # WHEN the whole step (GradScaler, update) is traced THEN fc2's addmm
    t = B.traced(m, x, y, loss_fn=F.cross_entropy, scaler=scaler, optimizer=opt)
    assert where(t.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    # WHEN replayed and bisected THEN fc2 alone in float32 makes the step, update included, finite
    m, opt, scaler = _grouped_after_one_step()
    r = B.replayed(m, x, y, loss_fn=F.cross_entropy, scaler=scaler, optimizer=opt)
    assert where(r.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", ("fc2",), True)


def test_param_groups_capture_replayed_by_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture of that step: model, AdamW with two groups and their state, GradScaler
    m, opt, scaler = _grouped_after_one_step()
    x, y = _nm_batch()
    # WHEN `nanhunt replay` rebuilds the optimizer from the file
    rc, r = B.cli_replay(tmp_path, monkeypatch, model=m, batch=(x, y), loss_fn=F.cross_entropy, optimizer=opt,
                         scaler=scaler)
    # THEN no crash, and the API's answer
    assert rc == 1
    assert where(r.first) == (Phase.FORWARD, "fc2", "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", ("fc2",), True)
