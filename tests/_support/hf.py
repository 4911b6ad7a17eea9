"""The tiny GPT-2 of the ``transformers.Trainer`` tests (built from a config, nothing downloaded) and the token
sequences it trains on. Only tests that found transformers import this module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel


def tiny_gpt2() -> GPT2LMHeadModel:
    """2 layers, 32 wide, a vocabulary of 64 and 16 positions; weights from seed 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def token_data(n: int = 48) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of 16 random token ids (seed 0), each its own labels."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out
