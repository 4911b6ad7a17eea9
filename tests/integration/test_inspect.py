"""nanhunt inspect: optimizer moments, bf16 near-overflow, an inf GradScaler scale."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from nanhunt.cli import main
from nanhunt.capture.inspect_ckpt import inspect_checkpoint


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


def _trained_adam(named: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.Adam(m.named_parameters() if named else m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.state[m[2].weight]["exp_avg_sq"][0, 0] = math.nan
    return m, opt


def test_inspect_names_optimizer_state_by_its_parameter(tmp_path: Path) -> None:
    # GIVEN a NaN in the second moment of the last layer's weight, in a nanhunt capture (which names each group's
    # parameters) and in a plain checkpoint of an optimizer given named_parameters() (torch keeps param_names)
    import torch.nn.functional as F

    import nanhunt

    m, opt = _trained_adam(named=False)
    ck = tmp_path / "capture.pt"
    nanhunt.save_capture(ck, tmp_path / "batch.pt", model=m, batch=(torch.randn(3, 4), torch.randn(3, 2)),
                         loss_fn=F.mse_loss, optimizer=opt)
    m2, opt2 = _trained_adam(named=True)
    plain = tmp_path / "plain.pt"
    torch.save({"model": m2.state_dict(), "optimizer": opt2.state_dict()}, plain)
    # THEN the state is named by its parameter, not by its index in the optimizer (2 there)
    for p in (ck, plain):
        assert [s.name for s in inspect_checkpoint(str(p)).flagged] == ["optimizer.state[2.weight].exp_avg_sq"]
