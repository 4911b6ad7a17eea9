"""Intentional -inf (masks) is no origin, wherever it enters: input, buffer, returned logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanhunt


class AdditiveMaskAttention(nn.Module):
    def __init__(self, d: int = 8, s: int = 4, mask_buffer: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        if mask_buffer:
            self.register_buffer("causal", torch.full((s, s), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores = scores + (mask if mask is not None else self.causal)
        return scores.softmax(-1) @ x


def test_additive_minus_inf_mask_as_input_is_no_origin() -> None:
    torch.manual_seed(0)
    m = AdditiveMaskAttention()
    mask = torch.full((4, 4), float("-inf")).triu(1)
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4, 8), mask=mask).sum().backward()
    assert t.first is None and t.origins == []


def test_minus_inf_mask_buffer_is_no_origin() -> None:
    torch.manual_seed(0)
    m = AdditiveMaskAttention(mask_buffer=True)
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4, 8)).sum().backward()
    assert t.first is None


def test_fully_masked_row_from_input_mask_is_found_at_softmax() -> None:
    # GIVEN an input mask that masks a whole row: the softmax creates the NaN
    torch.manual_seed(0)
    m = AdditiveMaskAttention()
    mask = torch.zeros(4, 4)
    mask[2, :] = float("-inf")
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4, 8), mask=mask).sum().backward()
    assert t.first is not None
    assert (t.first.phase.value, t.first.module, t.first.op, t.first.kind) == ("forward", "", "aten::_softmax", "nan")


def test_nan_or_plus_inf_input_is_still_an_origin() -> None:
    m = AdditiveMaskAttention()
    for bad in (float("nan"), float("inf")):
        mask = torch.zeros(4, 4)
        mask[0, 1] = bad
        with nanhunt.trace(m) as t:
            m(torch.randn(2, 4, 8), mask=mask)
        assert t.first is not None and t.first.phase.value == "input" and t.first.op is None


class MaskedLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        banned = torch.tensor([False, False, True, False, True])
        return self.fc(x).masked_fill(banned, float("-inf"))  # returned on purpose


def test_minus_inf_logits_returned_with_finite_loss_is_clean() -> None:
    torch.manual_seed(0)
    m = MaskedLogits()
    with nanhunt.trace(m) as t:
        loss = F.cross_entropy(m(torch.randn(3, 8)), torch.tensor([0, 1, 3]))
        loss.backward()
    assert torch.isfinite(loss)
    assert t.first is None
