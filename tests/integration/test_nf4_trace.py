"""QLoRA (torchao's ``NF4Tensor`` base weight, bfloat16 LoRA adapters) under trace, replay and the Guard.

``NF4Tensor`` runs only the ops its linear needs and raises ``NotImplementedError`` on every other one: the trace
measures it on its dequantized values (``get_original_weight``), and reads its inner tensors as the weight.
NF4 needs a weight whose size divides by its block sizes: 256 x 256.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Phase, Role

torchao_quantization = pytest.importorskip("torchao.quantization")
to_nf4 = torchao_quantization.to_nf4
nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

DIM, RANK = 256, 16
DIVERGED = 2.0 ** 124  # lora_b's weight: 16 products of 1.0 * 2**124 sum to 2**128, past bfloat16's max


class QLoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable low-rank bfloat16 update, as QLoRA fine-tuning has it."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(DIM, DIM, dtype=torch.bfloat16) * 0.05
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Linear(DIM, RANK, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(RANK, DIM, bias=False, dtype=torch.bfloat16)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_tensor.linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = QLoRALinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _model(*, diverged: bool) -> Model:
    torch.manual_seed(0)
    model = Model()
    if diverged:
        with torch.no_grad():
            model.layer.lora_a.weight.fill_(2.0 ** -8)  # x @ A.T: 256 * 2**-8 = 1.0 exactly
            model.layer.lora_b.weight.fill_(DIVERGED)
    return model


def _x() -> torch.Tensor:
    return torch.ones(4, DIM, dtype=torch.bfloat16)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


@pytest.mark.parametrize("level", ["op", "module"])
def test_diverged_adapter_is_named_and_the_nf4_weight_measured_dequantized(level: str) -> None:
    # GIVEN a QLoRA layer whose lora_b weight diverged to 2**124
    model = _model(diverged=True)
    x = _x()
    # WHEN one training step runs under the trace
    with nanhunt.trace(model, level=level) as t:
        _loss(model(x)).backward()
    # THEN the Inf is born in the adapter's matmul, lora_b, from 1.0 times 2**124 (16 of them)
    first = t.first
    assert first is not None
    assert (first.phase, first.module, first.kind) == (Phase.FORWARD, "layer.lora_b", "inf")
    assert first.op == ("aten::mm" if level == "op" else None)
    assert [r.max for r in first.inputs] == [1.0, DIVERGED]
    # AND the NF4 base weight's record holds its dequantized values, exactly
    w = next(r for r in t.records if r.role is Role.PARAM and r.module == "layer")
    dequantized = model.layer.weight.get_original_weight()
    assert (w.dtype, w.shape, w.unmeasured) == ("bfloat16", (DIM, DIM), None)
    assert (w.min, w.max) == (dequantized.min().item(), dequantized.max().item())


def test_nf4_inner_tensors_are_read_as_the_weight_not_as_step_inputs() -> None:
    # GIVEN a clean QLoRA step (lora_b at zero, as QLoRA starts)
    model = _model(diverged=False)
    x = _x()
    with nanhunt.trace(model) as t:
        _loss(model(x)).backward()
    # THEN it is clean, and the only values entering the step are the batch and the weights: the NF4 weight's
    # scalers and lookup table, read by its dequantization, are the weight's record
    assert t.first is None and t.finite
    entering = [(r.phase, r.role, r.shape) for r in t.records if r.role in (Role.INPUT, Role.STATE)]
    assert entering == [(Phase.INPUT, Role.INPUT, (4, DIM))]


def test_replay_names_the_adapter_and_restores_the_nf4_weight() -> None:
    # GIVEN the diverged QLoRA layer and its NF4 weight's values before
    model = _model(diverged=True)
    weight = model.layer.weight
    before = weight.get_original_weight().clone()
    # WHEN replayed under bfloat16 autocast
    report = nanhunt.replay(model, (_x(), None), loss_fn=_loss, dtype=torch.bfloat16)
    # THEN it names lora_b's matmul, and the NF4 weight is the same object with the same values
    occ = report.first
    assert occ is not None and (occ.module, occ.op, occ.kind) == ("layer.lora_b", "aten::mm", "inf")
    assert model.layer.weight is weight
    assert torch.equal(weight.get_original_weight(), before)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_guard_and_headroom_watch_a_qlora_loop_to_its_failure(tmp_path: Any) -> None:
    # GIVEN a Guard (parameters checked after every update) over a QLoRA loop whose adapter diverges at step 3
    model = _model(diverged=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = nanhunt.Guard(model, opt, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail="dump", check_params=True,
                          headroom_every=1)
    for step in range(4):
        if step == 3:
            with torch.no_grad():
                model.layer.lora_a.weight.fill_(2.0 ** -8)
                model.layer.lora_b.weight.fill_(DIVERGED)
        with guard.step((_x(), None)):
            opt.zero_grad()
            loss = guard.loss(_loss(model(_x())))
            loss.backward()
            guard.check_grads()
            opt.step()
    # THEN the three clean steps kept a history for every module, and the failure is told at step 3
    assert [(e.step, e.kind) for e in guard.events if e.kind != "warning"] == [(3, "loss")]
    watch = guard._watch
    watch.read()
    assert len(watch.history[("output", watch.names.index("layer.lora_a"))]) == 3
