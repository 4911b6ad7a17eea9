"""The report of a replay whose GradScaler scale is inf: strict JSON, and the note naming the scale."""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Report

from tests._support.golden import render


def _strict(text: str) -> Any:
    def bad(c: str) -> Any:
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def test_report_json_of_a_replay_whose_scaler_scale_is_inf() -> None:
    # GIVEN a step replayed with a GradScaler whose scale overflowed to inf (a real state after a bad run)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=math.inf)
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
    r = nanhunt.replay(m, (x, y), loss_fn=F.cross_entropy, dtype=torch.bfloat16, optimizer=opt, scaler=scaler)
    assert r.status == "nonfinite" and r.config["scaler_scale"] == math.inf
    # THEN the JSON report (what --report x.json / --bundle write) is strict JSON and reads back
    text = r.to_json()
    _strict(text)
    assert Report.from_json(text).config["scaler_scale"] in (math.inf, "inf")
    # AND the report says the scale itself is the cause (no op is: GradScaler makes it as a literal)
    assert any("GradScaler's scale is inf" in n for n in r.notes)
    assert "GradScaler's scale is inf" in render("md", r)
