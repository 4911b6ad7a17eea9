"""The CLI on real checkpoint shapes: frozen BatchNorm, SWA/DDP/Lightning state dicts, batch layouts, bf16 weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Report

from tests._support.bisection import step_finite, verdict_of
from tests._support.cli import FrozenBN, HotNet, Net, averaged

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[2]
D = 8


# ====================================================================== the CLI on foreign files


def _cli(tmp_path: Path, ck: Any, batch: Any, *args: str) -> tuple[int, str, Report | None]:
    ck_path, b_path, out = tmp_path / "ck.pt", tmp_path / "batch.pt", tmp_path / "r.json"
    if ck is not None:
        torch.save(ck, ck_path)
        torch.save(batch, b_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(ck_path), str(b_path), "--report", str(out),
                        *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    rep = Report.from_json(out.read_text()) if out.exists() else None
    return p.returncode, p.stderr, rep


def test_capture_of_a_model_with_a_frozen_batchnorm_replays_it_frozen(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = FrozenBN().train()
    m.bn.eval()
    x, y = 1 + 0.1 * torch.randn(16, D), torch.zeros(16, D)
    assert not step_finite(m, x, y, F.mse_loss)  # the live step, frozen BN: 8 * 100 * 100 overflows float16
    assert step_finite(m, x, y, F.mse_loss, fp32=["fc"])
    api = verdict_of(nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, bisect=True))
    assert (api.kind, api.culprits) == ("precision", ("fc",))
    nanhunt.save_capture(tmp_path / "ck.pt", tmp_path / "batch.pt", model=m, batch=(x, y), loss_fn=F.mse_loss,
                         model_factory="tests._support.cli:FrozenBN")
    code, err, rep = _cli(tmp_path, None, None, "--model", "tests._support.cli:FrozenBN")
    assert rep is not None, err
    assert code == 1 and rep.status == "nonfinite", (code, rep.status)
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.culprits) == ("precision", ("fc",))


@pytest.mark.parametrize("wrap", ["plain", "ddp"])
def test_state_dict_of_a_model_with_a_child_named_module(wrap: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = averaged().state_dict()
    assert "module.fc1.weight" in sd
    if wrap == "ddp":
        sd = {f"module.{k}": v for k, v in sd.items()}
    code, err, rep = _cli(tmp_path, sd, (torch.randn(4, D), torch.randn(4, D)), "--model",
                          "tests._support.cli:averaged", "--loss", "torch.nn.functional:mse_loss", "--dtype", "float32")
    assert code == 0, err
    assert rep is not None and rep.status == "clean"


def test_lightning_state_dict_with_a_loss_buffer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = Net().state_dict()
    lightning = {"state_dict": {**{f"model.{k}": v for k, v in sd.items()}, "criterion.pos_weight": torch.ones(D)},
                 "epoch": 3}
    code, err, _ = _cli(tmp_path, lightning, (torch.randn(4, D), torch.randn(4, D)), "--model",
                        "tests._support.cli:Net", "--loss", "torch.nn.functional:mse_loss", "--dtype", "float32")
    # replayed, the loss's buffer ignored with a warning that names it (the model's keys all load)
    assert code == 0, err
    assert "ignored" in err and "criterion.pos_weight" in err, err


def _hot_sd(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    m = HotNet()
    with torch.no_grad():
        m.fc1.weight.copy_(torch.eye(D))
        m.fc1.bias.zero_()
        m.fc2.weight.fill_(2.0**15)  # fits float16 and is exact in bfloat16; 8 * 2**15 does not fit float16
        m.fc2.bias.zero_()
    return {k: v.to(dtype) for k, v in m.state_dict().items()}


@pytest.mark.parametrize("case", ["kwargs-dot-loss", "tensor-scalar-loss", "inputs-targets-dict", "bf16-weights"])
def test_cli_batch_shapes_and_bf16_weights_give_the_known_culprit(case: str, tmp_path: Path) -> None:
    x, y = torch.ones(2, D), torch.zeros(2, D)
    # truth, by hand: fc2's matmul overflows float16; fc2 alone in float32 makes the step finite
    truth = HotNet()
    truth.load_state_dict(_hot_sd())
    assert not step_finite(truth, x, y, F.mse_loss)
    assert step_finite(truth, x, y, F.mse_loss, fp32=["fc2"])
    assert torch.equal(_hot_sd(torch.bfloat16)["fc2.weight"].float(), _hot_sd()["fc2.weight"])
    mse = ["--loss", "torch.nn.functional:mse_loss"]
    ck, batch, args = {
        "kwargs-dot-loss": ({"model": _hot_sd()}, {"x": x, "labels": y}, ["--model", "tests._support.cli:HotKwargs"]),
        "tensor-scalar-loss": (_hot_sd(), x, ["--model", "tests._support.cli:HotScalar"]),
        "inputs-targets-dict": (_hot_sd(), {"inputs": x, "targets": y}, ["--model", "tests._support.cli:HotNet", *mse]),
        "bf16-weights": (_hot_sd(torch.bfloat16), (x, y), ["--model", "tests._support.cli:HotNet", *mse]),
    }[case]
    code, err, rep = _cli(tmp_path, ck, batch, *args)
    assert rep is not None, err
    assert code == 1, err
    assert rep.first is not None and (rep.first.module, rep.first.op) == ("fc2", "aten::addmm")
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.culprits) == ("precision", ("fc2",))
    assert rep.verdict.alternatives.get("bfloat16") is True
    json.loads((tmp_path / "r.json").read_text())  # a valid JSON report
