"""Hunt: report renderers on unusual but valid data, ``nanhunt inspect`` on odd checkpoints, ``trace(scope=)``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.cli import main
from nanhunt.inspect_ckpt import inspect_checkpoint
from nanhunt.records import Report
from tests._golden import render
from tests.test_report import sample_report


def _strict(text: str) -> Any:
    def bad(c: str) -> Any:
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


# ------------------------------------------------------------------ report layer


def test_finding_without_module_source_or_op_renders_and_round_trips() -> None:
    # GIVEN a finding outside the model (module None), with no source line and no op (an input entering non-finite)
    r = sample_report()
    assert r.first is not None
    occ = dataclasses.replace(r.first, module=None, module_class=None, source=None, op=None)
    r = dataclasses.replace(r, first=occ, origins=(occ,), runs=(occ, occ), loss=math.inf)
    # THEN every renderer copes and the JSON is strict and reads back to the same file
    for fmt in ("md", "html", "console"):
        assert render(fmt, r)
    text = r.to_json()
    assert _strict(text)["loss"] == "inf"
    assert Report.from_json(text).to_json() == text


def test_clean_report_with_zero_origins_in_every_format() -> None:
    r = Report(status="clean", first=None, loss=0.5, n_records=7)
    for fmt in ("md", "html", "console"):
        out = render(fmt, r)
        assert "None" not in out  # no Python repr of a missing finding leaks into the page
    text = r.to_json()
    assert _strict(text)["first"] is None and _strict(text)["origins"] == []
    assert Report.from_json(text).to_json() == text


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


# ------------------------------------------------------------------ nanhunt inspect


def _ckpt(tmp_path: Path) -> str:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_sq"][0, 0] = math.nan
    sd["state"][1]["exp_avg"][0] = math.inf
    msd = m.state_dict()
    msd["near"] = torch.full((3,), 3e38, dtype=torch.bfloat16)  # finite in bfloat16, inf once cast to float16
    msd["empty"] = torch.empty(0)
    msd["ints"] = torch.tensor([2 ** 40], dtype=torch.int64)
    p = tmp_path / "ck.pt"
    torch.save({"model": msd, "optimizer": sd}, p)
    return str(p)


def test_inspect_names_optimizer_moments_and_bf16_near_overflow(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    p = _ckpt(tmp_path)
    found = inspect_checkpoint(p)
    # THEN one finding per bad tensor, each by its path in the checkpoint; integer buffers and empty tensors skipped
    names = [s.name for s in found.flagged]
    assert sorted(names) == ["model.near", "optimizer.state.0.exp_avg_sq", "optimizer.state.1.exp_avg"]
    by = {s.name: s for s in found.flagged}
    assert (by["optimizer.state.0.exp_avg_sq"].nan, by["optimizer.state.1.exp_avg"].inf) == (1, 1)
    assert by["model.near"].dtype == "bfloat16" and by["model.near"].nan == by["model.near"].inf == 0
    assert names.index("model.near") == 2  # non-finite first
    assert main(["inspect", p]) == 1
    out = capsys.readouterr().out
    assert "2 non-finite, 1 within 16x" in out
    for n in names:
        assert sum(n in line for line in out.splitlines()) == 1


def test_inspect_flags_a_gradscaler_scale_of_inf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint whose weights are fine but whose GradScaler scale overflowed to inf
    m = nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=math.inf)
    p = tmp_path / "ck.pt"
    torch.save({"model": m.state_dict(), "scaler": scaler.state_dict()}, p)
    found = inspect_checkpoint(str(p))
    assert found.scaler["scale"] == math.inf
    # THEN the non-finite scaler state counts as a non-finite finding (exit 1), as the docs promise for "scaler"
    assert found.nonfinite
    assert main(["inspect", str(p)]) == 1


# ------------------------------------------------------------------ trace(scope=...)


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 100)  # NaN born here for any small x


class _Net(nn.Module):
    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        self.a, self.b, self.no_grad = nn.Linear(4, 4), _Log(), no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.no_grad:
            with torch.no_grad():
                g = self.b(h)
        else:
            g = self.b(h)
        return h.sum() + g.sum()  # the NaN reaches the loss


@pytest.mark.parametrize("no_grad", [False, True])
def test_scoped_origin_that_reaches_the_loss_is_not_called_silent(no_grad: bool) -> None:
    torch.manual_seed(0)
    m = _Net(no_grad)
    x = torch.randn(3, 4)
    with nanhunt.trace(m) as whole:
        m(x).backward()
    assert whole.first is not None and whole.first.op == "aten::log" and not whole.first.silent
    with nanhunt.trace(m, scope=["b"]) as t:
        loss = m(x)
        loss.backward()
    assert math.isnan(loss.item())
    assert t.first is not None and (t.first.module, t.first.op) == ("b", "aten::log")
    # THEN the scoped pass either measured the reach (output/loss) or says it did not (None), never "silent"
    assert not t.first.silent
    assert "silent" not in t.first.describe()
