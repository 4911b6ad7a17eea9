"""nanhunt.hunt._twice: deterministic, reproducibility check, and nothing of the user's state lost."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.capture.capture import load_step


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.bn(self.fc1(x))))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict[str, object]:
    return {
        "sd": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "opt": {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scaler": scaler.state_dict(),
        "rng": torch.get_rng_state(),
        "training": [m.training for m in model.modules()],
        "rg": [p.requires_grad for p in model.parameters()],
    }


def _same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["sd"].keys() == b["sd"].keys()  # type: ignore[attr-defined]
    for k in a["sd"]:  # type: ignore[attr-defined]
        assert torch.equal(a["sd"][k], b["sd"][k]), k  # type: ignore[index]
    for g1, g2 in zip(a["grads"], b["grads"]):  # type: ignore[call-overload]
        assert (g1 is None and g2 is None) or torch.equal(g1, g2)
    assert a["grad_ids"] == b["grad_ids"]
    assert a["opt"].keys() == b["opt"].keys()  # type: ignore[attr-defined]
    for pid in a["opt"]:  # type: ignore[attr-defined]
        for k, v in a["opt"][pid].items():  # type: ignore[index]
            w = b["opt"][pid][k]  # type: ignore[index]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w
    assert a["groups"] == b["groups"]
    assert a["scaler"] == b["scaler"]
    assert torch.equal(a["rng"], b["rng"])  # type: ignore[arg-type]
    assert a["training"] == b["training"]
    assert a["rg"] == b["rg"]


def _trained_setup() -> tuple[DropNet, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = DropNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for _ in range(2):  # optimizer state and BatchNorm running stats exist, grads are left set
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return m, opt, scaler, x, y


def test_replay_restores_everything() -> None:
    # GIVEN a model mid-training: Adam state, BatchNorm stats, dropout, GradScaler, grads present
    m, opt, scaler, x, y = _trained_setup()
    before = _snapshot(m, opt, scaler)
    # WHEN replayed with the update phase
    rep = nanhunt.replay(m, (x, y), loss_fn=F.cross_entropy, dtype=torch.bfloat16, optimizer=opt, scaler=scaler)
    # THEN the step is clean, reproducible (dropout RNG replayed), and nothing changed
    assert rep.status == "clean"
    assert any(r is None for r in rep.runs)
    _same(before, _snapshot(m, opt, scaler))


def test_replay_takes_the_level_as_text_and_names_a_bad_one() -> None:
    from nanhunt.records import Level

    m, opt, scaler, x, y = _trained_setup()
    # GIVEN the level as text or as the member THEN the report's configuration holds its text
    for level in ("module", Level.MODULE):
        rep = nanhunt.replay(m, (x, y), loss_fn=F.cross_entropy, dtype=torch.float32, level=level)
        assert type(rep.config["level"]) is str and rep.config["level"] == "module"
    # GIVEN a level that is neither THEN a ValueError names the ones there are
    with pytest.raises(ValueError, match=r"^level must be one of \('op', 'module'\), not 'modules'$"):
        nanhunt.replay(m, (x, y), loss_fn=F.cross_entropy, level="modules")


def test_replay_restores_on_exception() -> None:
    m, opt, scaler, x, y = _trained_setup()
    before = _snapshot(m, opt, scaler)

    def bad_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, target)
        loss.backward()  # grads and BN stats already touched when it fails
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        nanhunt.replay(m, (x, y), loss_fn=bad_loss, dtype=torch.bfloat16, optimizer=opt, scaler=scaler)
    _same(before, _snapshot(m, opt, scaler))
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_dropout_step_is_reproducible_and_found() -> None:
    # GIVEN dropout and an Inf weight row that the dropout mask decides to pass or not
    m, opt, scaler, x, y = _trained_setup()
    with torch.no_grad():
        m.fc2.weight[0, :] = 3e4  # fits float16; the matmul does not
    rep = nanhunt.replay(m, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16)
    # THEN both runs agree (same RNG), and the float16 overflow is fc2's addmm
    assert rep.status == "nonfinite"
    assert rep.first is not None and (rep.first.module, rep.first.op) == ("fc2", "aten::addmm")


class Flaky(nn.Module):
    """Non-finite on every other call: replays disagree."""

    counter = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if next(self.counter) % 2 == 0:
            y = y / torch.zeros_like(y)
        return y


def test_not_reproducible() -> None:
    rep = nanhunt.replay(Flaky(), (torch.randn(2, 4), torch.randn(2, 1)), loss_fn=F.mse_loss, dtype=torch.float32)
    assert rep.status == "not-reproducible"
    assert rep.runs[0] is not None and rep.runs[1] is None


def test_save_capture_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture written by save_capture
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    from fixtures.models import LMLoss, TinyTransformer

    torch.manual_seed(3)
    m = TinyTransformer(n_blocks=1)
    with torch.no_grad():
        m.blocks[0].ff.wi.weight.mul_(2e5)
    tokens = torch.randint(0, 64, (2, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ck, b = tmp_path / "c.pt", tmp_path / "b.pt"
    nanhunt.save_capture(ck, b, model=m, batch=(tokens, tokens), loss_fn=LMLoss(), optimizer=opt,
                         model_factory="fixtures.models:TinyTransformer", model_kwargs={"n_blocks": 1},
                         dtype=torch.float16)
    # THEN both files load with weights_only=True and replay to the same place
    torch.load(ck, weights_only=True)
    torch.load(b, weights_only=True)
    step = load_step(str(ck), str(b))
    assert step.dtype == torch.float16 and step.optimizer is not None and step.loss_fn is not None
    rep = nanhunt.replay(step.model, (step.inputs, step.targets), loss_fn=step.loss_fn, dtype=step.dtype,
                         optimizer=step.optimizer, rng=step.rng)
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module) == ("forward", "blocks.0.ff.wi")


def test_module_tree_status_summarises_the_subtree() -> None:
    # GIVEN an MLP whose activation (a child) overflows: neither the root nor fc1 makes a non-finite value itself
    from tests._support.models import exp_overflow_mlp

    model = nn.Sequential(exp_overflow_mlp())
    x = torch.ones(2, 4)
    # WHEN it is replayed
    rep = nanhunt.replay(model, (x, torch.zeros(2, 3)), loss_fn=F.mse_loss, dtype=torch.float32)
    # THEN the child says where it went bad, and every ancestor says it went bad inside that child
    assert rep.modules["0.act"] == "inf in forward"
    assert rep.modules["0"] == "inf in forward, inside 0.act"
    assert rep.modules[""] == "inf in forward, inside 0.act"
    assert rep.modules["0.fc1"] == "nan in backward"  # its own gradient, after the forward overflow
