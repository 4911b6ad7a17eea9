"""Captures: what save_capture writes comes back, as it was, through load_step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from fixtures.models import MLP
from nanhunt.capture.capture import load_step
from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
SIZE = {"d_in": 4, "d_hidden": 8, "d_out": 2}


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def _decay_groups(model: MLP) -> torch.optim.AdamW:
    """The usual AdamW groups: weights decay, biases do not (so group order is not model order)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3)


def test_optimizer_groups_come_back_by_parameter_name(tmp_path: Path) -> None:
    # GIVEN decay / no-decay AdamW groups with state after one step (fc1.weight and fc1.bias differ in shape)
    torch.manual_seed(0)
    model = MLP(**SIZE)
    opt = _decay_groups(model)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    F.mse_loss(model(x), y).backward()
    opt.step()
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=(x, y), loss_fn=F.mse_loss, optimizer=opt, model_kwargs=SIZE)
    # WHEN it is loaded
    step = load_step(str(ck), str(bt))
    # THEN every group holds the same parameters, with their own hyper-parameters and state
    assert step.optimizer is not None
    names = {id(p): n for n, p in step.model.named_parameters()}
    got = [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in step.optimizer.param_groups]
    assert got == [(["fc1.weight", "fc2.weight"], 0.1), (["fc1.bias", "fc2.bias"], 0.0)]
    live = {n: p for n, p in model.named_parameters()}
    for p in step.model.parameters():
        saved = opt.state[live[names[id(p)]]]
        assert torch.equal(step.optimizer.state[p]["exp_avg"], saved["exp_avg"])
    # AND the CLI replays it (it crashed on exp_avg of another shape)
    assert main(["replay", str(ck), str(bt), "--no-bisect"]) == 0


def test_a_name_the_model_lacks_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = MLP(**SIZE)
    opt = _decay_groups(model)
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=(torch.randn(3, 4), torch.randn(3, 2)), loss_fn=F.mse_loss,
                         optimizer=opt, model_kwargs=SIZE)
    c = torch.load(ck, weights_only=True)
    c["optimizer_params"][0][0] = "fc9.weight"
    torch.save(c, ck)
    assert main(["replay", str(ck), str(bt), "--no-bisect"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fc9.weight" in err[0]


def test_load_capture_gives_the_step_replay_would_run(tmp_path: Path) -> None:
    # GIVEN a capture  WHEN loaded with the public loader  THEN a Step that runs as the replay runs it
    torch.manual_seed(0)
    model = MLP(**SIZE)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=(x, y), loss_fn=F.mse_loss, model_kwargs=SIZE)
    step = nanhunt.load_capture(ck, bt)
    assert torch.equal(step.inputs, x) and torch.equal(step.targets, y) and step.loss_fn is F.mse_loss
    with step.isolated():
        loss = step.run()
    with torch.autocast("cpu", dtype=torch.float16):  # the capture's autocast dtype (the default)
        expected = F.mse_loss(model(x), y)
    assert step.dtype == torch.float16 and torch.equal(loss.detach(), expected.detach())
