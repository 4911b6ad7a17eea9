"""The leading origin: the first origin whose non-finite values reach a sink leads; silent ones (absorbed)
lead only when nothing reaches a sink; harmless ones (feeding only integer / index / boolean results) never."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase
from nanhunt.cli import main
from nanhunt.records import Report

from tests._support.models import where

ROOT = Path(__file__).resolve().parents[2]


class HandSoftmax(nn.Module):
    """exp(x * scale) / sum: with scale 88 the four exps are finite but their sum overflows float32 (the
    weights become 0: absorbed); with scale 100 exp itself overflows and inf / inf is NaN."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x * self.scale)
        return e / e.sum(-1, keepdim=True)


class TwoSoftmaxBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1 = HandSoftmax(88.0), HandSoftmax(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b1(self.b0(x) + x)


class BucketThenOverflow(nn.Module):
    """T5's relative-position bucket in small: log(0) = -inf is cast to an index every step (harmless);
    a later exp overflows and reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(4)
        large = (torch.log(pos.float() / 4) * 2).to(torch.long) + 4  # log(0) = -inf, cast to an index
        bucket = torch.where(pos < 1, pos, large)
        return torch.exp(x * 100.0) + self.emb(bucket)


def _step(model: nn.Module, x: torch.Tensor) -> nanhunt.Trace:
    with nanhunt.trace(model) as t:
        model(x).sum().backward()
    return t


def test_an_absorbed_origin_does_not_lead_one_that_reaches_the_loss() -> None:
    # GIVEN block 0's row sum overflowing (absorbed: its weights become 0) and block 1's exp overflowing
    x = torch.ones(2, 4)
    # WHEN the step is traced
    t = _step(TwoSoftmaxBlocks(), x)
    # THEN block 1's exp leads; block 0's sum is listed as a silent origin before it
    assert where(t.first) == (Phase.FORWARD, "b1", "aten::exp", 0, "inf")
    assert [where(o) for o in t.origins][:2] == [(Phase.FORWARD, "b0", "aten::sum", 0, "inf"),
                                                 (Phase.FORWARD, "b1", "aten::exp", 0, "inf")]
    assert t.origins[0].silent and not t.origins[0].harmless
    assert t.first.reached is not None and "loss" in t.first.reached


def test_only_silent_origins_the_first_that_feeds_floats_leads() -> None:
    # GIVEN only block 0 (its overflow absorbed)
    t = _step(HandSoftmax(88.0), torch.ones(2, 4))
    # THEN it is still the culprit, marked silent
    assert where(t.first) == (Phase.FORWARD, "", "aten::sum", 0, "inf")
    assert t.first is not None and t.first.silent and not t.first.harmless


def test_an_origin_feeding_only_an_index_never_leads() -> None:
    # GIVEN log(0) = -inf cast to an index, then an exp overflow reaching the loss
    t = _step(BucketThenOverflow(), torch.ones(4, 4))
    # THEN the exp leads; the log is listed, harmless
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")
    log = next(o for o in t.origins if o.op == "aten::log")
    assert log.harmless and log.silent and "harmless" in log.describe()


def test_a_step_with_only_a_harmless_origin_has_no_culprit() -> None:
    # GIVEN the bucket alone (the exp cannot overflow)
    t = _step(BucketThenOverflow(), torch.zeros(4, 4))
    # THEN there is no culprit, and the harmless origin is still listed
    assert t.first is None
    assert [o.op for o in t.origins] == ["aten::log"] and t.origins[0].harmless


def test_module_level_reach_follows_the_parent_code_and_the_loss(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN the bundled capture whose blocks.1.ff.wo overflows float16 and reaches the loss and gradients
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "r.json"
    # WHEN it is replayed at module level (which sees no op between a parent's children)
    code = main(["replay", str(ROOT / "fixtures/overflow/checkpoint.pt"), str(ROOT / "fixtures/overflow/batch.pt"),
                 "--level", "module", "--no-bisect", "--report", str(out)])
    # THEN the origin is named and it reached what it reaches at op level, not "nothing (silent)"
    first = Report.from_json(out.read_text()).first
    assert code == 1 and first is not None
    assert (first.phase, first.module, first.kind) == (Phase.FORWARD, "blocks.1.ff.wo", "inf")
    assert first.reached == ("output", "loss", "gradients")
