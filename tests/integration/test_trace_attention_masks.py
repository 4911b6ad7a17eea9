"""Intentional masks (causal, padding, ignored targets, action masks) are never blamed for a real fault."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import where


# ---------------------------------------------------------------- masks next to real faults


class CausalBlock(nn.Module):
    """Single-head causal attention with a -inf mask buffer, then an MLP."""

    def __init__(self, d: int = 8, s: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 16), nn.Linear(16, d)
        self.register_buffer("causal", torch.full((s, s), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8**0.5 + self.causal
        x = x + scores.softmax(-1) @ self.v(x)
        return x + self.fc2(F.relu(self.fc1(x)))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CausalBlock(), CausalBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("level", ["op", "module"])
def test_causal_mask_is_never_blamed_for_a_real_fp16_overflow(level: str) -> None:
    # GIVEN a 2-block causal model (-inf mask buffers) whose second MLP overflows float16 under autocast
    torch.manual_seed(0)
    m = TinyGPT()
    with torch.no_grad():
        m.blocks[1].fc2.weight.mul_(1e4)
    x = torch.randn(2, 4, 8) * 10
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float32, enabled=False):
        assert torch.isfinite(m(x)).all()  # the float32 reference is finite: a precision fault
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.trace(m, level=level) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        scaler.scale(out.float().pow(2).mean()).backward()
    assert torch.isinf(out).any()
    # THEN the overflowing projection is named, never the masks
    op = "aten::addmm" if level == "op" else None
    assert where(t.first) == (Phase.FORWARD, "blocks.1.fc2", op, 0, "inf")
    assert not any(o.module is not None and o.module.startswith("blocks.0") for o in t.origins)


class RowMaskedLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~allowed, float("-inf"))


def test_log_softmax_of_a_fully_masked_row_is_born_in_the_loss() -> None:
    # GIVEN action masking (RL style) where sample 1 has no allowed action: its logits row is all -inf
    torch.manual_seed(0)
    m = RowMaskedLogits()
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    with nanhunt.trace(m) as t:
        loss = F.cross_entropy(m(torch.randn(3, 8), allowed), torch.tensor([0, 1, 3]))
        loss.backward()
    assert torch.isnan(loss)
    # THEN masked_fill(-inf) is no origin; log_softmax of the -inf row (-inf - -inf) is, in the loss
    assert where(t.first) == (Phase.LOSS, None, "aten::_log_softmax", 0, "nan")


def test_cross_entropy_with_every_target_ignored_is_nan_in_the_loss() -> None:
    # GIVEN a batch made only of padding tokens (ignore_index): mean over zero elements is 0/0
    torch.manual_seed(0)
    m = nn.Linear(4, 5)
    with nanhunt.trace(m) as t:
        loss = F.cross_entropy(m(torch.randn(3, 4)), torch.full((3,), -100))
        loss.backward()
    assert torch.isnan(loss)
    assert where(t.first) == (Phase.LOSS, None, "aten::nll_loss_forward", 0, "nan")


def test_multihead_attention_eval_fast_path_all_padded_sequence() -> None:
    # GIVEN nn.MultiheadAttention in eval under no_grad (the fused native fast path) and a batch
    # element whose keys are all padding
    torch.manual_seed(0)

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    m = Enc().eval()
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1] = True
    with torch.no_grad(), nanhunt.trace(m) as t:
        out = m(torch.randn(2, 4, 8), pad)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    # THEN the one fused op that made the NaN is named, in the attention module
    assert where(t.first) == (Phase.FORWARD, "attn", "aten::_native_multi_head_attention", 0, "nan")


class MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.register_buffer("banned", torch.tensor([False, False, True, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(self.banned, float("-inf"))  # invalid actions, on purpose


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = MaskedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize(
    "level",
    [
        "op",
        "module",
    ],
)
def test_action_masked_logits_with_finite_loss_are_clean(level: str) -> None:
    torch.manual_seed(0)
    m = Policy()
    with nanhunt.trace(m, level=level) as t:
        loss = F.cross_entropy(m(torch.randn(3, 8)), torch.tensor([0, 1, 3]))
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert t.first is None
