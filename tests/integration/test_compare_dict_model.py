"""compare() on a dict-returning model with dropout: deterministic, compares the logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanhunt
from tests._support.models import DictModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# ------------------------------------------------------------------ helpers


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ================================================================== compare


def test_compare_dict_model_with_dropout_is_deterministic_and_uses_the_logits() -> None:
    # GIVEN an HF-style model in train mode (dropout active), its labels inside the keyword batch
    torch.manual_seed(0)
    model = DictModel().train()
    b = {"input_ids": torch.randn(16, 8), "labels": torch.randint(0, 3, (16,))}
    before = _state(model)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    # WHEN compared twice from the same RNG state
    r1 = nanhunt.compare(model, b, task="classify")
    assert torch.equal(torch.get_rng_state(), rng)
    r2 = nanhunt.compare(model, b, task="classify")
    # THEN the two comparisons are identical, the model and RNG untouched, and the decisions are the logits'
    assert r1.comparison == r2.comparison and r1.comparison is not None
    c = r1.comparison
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert c.n_samples == 16 and c.output is not None and c.output.shape == (16, 3)
    # AND the reference is the float32 step under that very RNG (the same dropout mask)
    torch.set_rng_state(rng)
    with torch.no_grad():
        ref = model(**b)["loss"]
    torch.set_rng_state(rng)
    assert c.ref_loss == float(ref)
    assert r1.status == "clean" and c.accepted
