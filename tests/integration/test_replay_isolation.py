"""Replay and bisection leave the model, optimizer, hooks and RNGs as they found them, even on error."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanhunt
from nanhunt.hunt.bisection import bisect
from nanhunt.step.step import Step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # Model factories named as fixtures.models:... / tests._support.cli:... import from the repository root.
    monkeypatch.chdir(ROOT)


# ============================================================== nothing lost


class _Net(nn.Module):
    """Mixed training flags, a frozen bias, dropout, BatchNorm; forward N raises (``_Net.stop``)."""

    calls = 0
    stop = -1
    error: type[BaseException] = KeyboardInterrupt

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 8)
        self.fc3 = nn.Linear(8, 4)
        self.bn.eval()
        self.fc3.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if type(self).calls == type(self).stop:
            raise type(self).error("stop")
        return self.fc3(self.fc2(self.drop(self.bn(self.fc1(x)))))


def _trained() -> tuple[_Net, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor, torch.Tensor]:
    """Mid-training: Adam moments, BN stats, scaler grown, grads set, user hooks; fc2 overflows float16."""
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with torch.no_grad():
        m.fc2.weight.zero_()
        m.fc2.weight[0, :] = 3e4
    m.fc1.register_forward_hook(lambda *a: None)
    m.fc2.weight.register_hook(lambda g: g)
    _Net.calls, _Net.stop = 0, -1
    return m, opt, scaler, x, y


def _state(m: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict[str, Any]:
    return {
        "sd": {k: v.clone() for k, v in m.state_dict().items()},
        "param_ids": [id(p) for p in m.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in m.parameters()],
        "opt": repr(copy.deepcopy(opt.state_dict())),
        "scaler": scaler.state_dict(),
        "scale": scaler.get_scale(),
        "growth_tracker": int(scaler._growth_tracker),  # type: ignore[arg-type]
        "rng": torch.get_rng_state(),
        "training": [mm.training for mm in m.modules()],
        "requires_grad": [p.requires_grad for p in m.parameters()],
        "hooks": [(len(mm._forward_hooks), len(mm._forward_pre_hooks), len(mm._backward_hooks)) for mm in m.modules()],
        "param_hooks": [len(p._backward_hooks or {}) for p in m.parameters()],
        "forward_overrides": ["forward" in mm.__dict__ for mm in m.modules()],
        "grad_enabled": torch.is_grad_enabled(),
        "dispatch_mode": _get_current_dispatch_mode(),
        "autocast": torch.is_autocast_enabled("cpu"),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["sd"].keys() == b["sd"].keys()
    for k in a["sd"]:
        assert torch.equal(a["sd"][k], b["sd"][k]), k
    for g, h in zip(a["grads"], b["grads"]):
        assert (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
    assert torch.equal(a["rng"], b["rng"])
    for k in a:
        if k not in ("sd", "grads", "rng"):
            assert a[k] == b[k], k


@pytest.mark.parametrize("api, stop, error", [
    ("replay", 1, KeyboardInterrupt),      # first traced run
    ("replay", 2, KeyboardInterrupt),      # second traced run
    ("replay", 4, KeyboardInterrupt),      # a bisection trial: partial verdict
    ("replay", 4, RuntimeError),           # the model fails in a bisection trial
    ("bisect", 3, KeyboardInterrupt),      # nanhunt.hunt.bisection.bisect called directly
])
def test_exception_from_forward_leaves_everything(api: str, stop: int, error: type[BaseException]) -> None:
    # GIVEN a model mid-training whose forward raises at its `stop`-th call
    m, opt, scaler, x, y = _trained()
    before = _state(m, opt, scaler)
    _Net.stop, _Net.error = stop, error
    try:
        # WHEN replayed / bisected with the update phase
        if api == "replay":
            rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, optimizer=opt, scaler=scaler, bisect=True)
            assert rep.verdict is not None and rep.verdict.interrupted
        else:
            v = bisect(Step.of(m, (x, y), loss_fn=F.mse_loss, optimizer=opt, scaler=scaler), origin=None)
            assert v.interrupted
    except error:
        assert stop <= 2 or error is not KeyboardInterrupt
    finally:
        _Net.stop, _Net.error = -1, KeyboardInterrupt
    assert _Net.calls == stop
    # THEN weights, BN stats, grads, Adam state, scale and growth tracker, RNG, flags and hooks are as before
    _assert_same(before, _state(m, opt, scaler))


def test_interrupted_bisection_that_found_nothing_says_interrupted() -> None:
    # GIVEN a non-finite step whose first bisection trial is interrupted (Ctrl-C)
    from nanhunt.records import Report
    from nanhunt.report import render_for_format

    m, opt, scaler, x, y = _trained()
    _Net.stop = 3  # the two traced replays, then the first trial
    try:
        rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, optimizer=opt, scaler=scaler, bisect=True)
    finally:
        _Net.stop = -1
    # THEN the verdict is 'interrupted' (not 'clean' on a non-finite step), also read back from JSON
    assert rep.status == "nonfinite"
    v = rep.verdict
    assert v is not None and v.kind == "interrupted" and v.interrupted and v.culprits == () and v.replays == 1
    back = Report.from_json(rep.to_json()).verdict
    assert back is not None and back.kind == "interrupted"
    # AND every report says so
    for fmt in ("console", "md", "html"):
        text = render_for_format(fmt)(rep)
        assert "Interrupted after 1 replays" in text and "nothing to bisect" not in text, fmt


class _PyRandomNet(nn.Module):
    """Uses Python's and NumPy's generators in forward (stochastic depth, augmentation done in the model)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = random.random() if self.source == "random" else float(np.random.rand())
        return self.fc(x) * (3e4 * k)


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_replay_and_bisect_restore_python_and_numpy_rng(source: str) -> None:
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(1)
    m = _PyRandomNet(source)
    py, npy = random.getstate(), np.random.get_state()
    rep = nanhunt.replay(m, (torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss, dtype=torch.float16,
                         bisect=True)
    assert rep.status != "clean"  # bisection ran
    assert random.getstate() == py
    now = np.random.get_state()
    assert now[2] == npy[2] and np.array_equal(now[1], npy[1])  # type: ignore[arg-type]


def test_replay_restores_parameters_the_optimizer_holds_outside_the_model() -> None:
    # GIVEN a loss module with its own learnable weights (ArcFace/uncertainty weighting), optimized with the model
    class WeightedLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2 * self.w).mean()

    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 4), WeightedLoss()
    opt = torch.optim.SGD([*model.parameters(), *loss_fn.parameters()], lr=0.1)
    w = loss_fn.w.detach().clone()
    # WHEN the step is replayed with its update
    rep = nanhunt.replay(model, (torch.randn(2, 4), torch.randn(2, 4)), loss_fn=loss_fn, dtype=torch.float32,
                         optimizer=opt)
    assert rep.status == "clean"
    # THEN the optimizer's other parameters are as they were
    assert loss_fn.w.grad is None
    assert torch.equal(loss_fn.w.detach(), w)


# ---------------------------------------------------------------- replay leaves the model as it was


class SelfHooking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc2.register_forward_hook(lambda mod, i, o: None)  # e.g. lazy instrumentation
        self.fc.weight.register_hook(lambda g: g)
        self.fc2.weight.requires_grad_(False)  # freezes a layer during forward
        return self.fc2(self.fc(x))


def test_replay_leaves_no_hook_registered_by_forward() -> None:
    torch.manual_seed(0)
    m = SelfHooking()
    before = (len(m.fc2._forward_hooks), len(m.fc.weight._backward_hooks or {}), m.fc2.weight.requires_grad)
    nanhunt.replay(m, (torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss)
    after = (len(m.fc2._forward_hooks), len(m.fc.weight._backward_hooks or {}), m.fc2.weight.requires_grad)
    assert after[2] is True  # requires_grad is restored (right today)
    assert after == before


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # e.g. a warm-up schedule keyed on the number of calls
        return self.fc(x) * min(1.0, self.calls / 100)


def test_replay_restores_module_attributes_changed_by_forward() -> None:
    m = Counting()
    nanhunt.replay(m, (torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss)
    assert m.calls == 0


# ============================================================== hooks added while isolated


def test_trace_and_hooks_added_after_isolated_survive_run(tmp_path: Path) -> None:
    # GIVEN a loaded capture of a step whose fc1 overflows float16, isolated, then (as in a notebook) a hook of the
    # user's and a trace entered around run()
    from fixtures.models import MLP

    size = {"d_in": 4, "d_hidden": 8, "d_out": 3}
    model = MLP(**size)
    with torch.no_grad():
        model.fc1.weight.fill_(1000.0)  # 4 inputs of 100: 4e5 > 65504
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=(torch.full((2, 4), 100.0), torch.zeros(2, 3)),
                         loss_fn=F.mse_loss, model_kwargs=size)
    step = nanhunt.load_capture(ck, bt)
    seen: list[str] = []
    with step.isolated():
        step.model.fc2.register_forward_hook(lambda *a: seen.append("fc2"))
        hooks = len(step.model.fc2._forward_hooks)
        with nanhunt.trace(step.model) as t:
            step.run()
        # WHEN it runs again, the trace gone
        step.run()
        after = len(step.model.fc2._forward_hooks)
    # THEN the trace saw the model's modules: the Inf is born in fc1's addmm; the user's hook ran in both runs
    # and is still there after them; leaving the isolation removes it (everything back as it was)
    assert t.first is not None and (t.first.phase.value, t.first.module, t.first.op) == ("forward", "fc1", "aten::addmm")
    assert seen == ["fc2", "fc2"] and after == hooks
    assert len(step.model.fc2._forward_hooks) == 0


def test_hooks_a_forward_registers_do_not_pile_up_between_runs() -> None:
    # GIVEN a model whose forward registers a hook on every call
    torch.manual_seed(0)
    step = Step.of(SelfHooking(), (torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss)
    with step.isolated():
        counts = []
        for _ in range(3):
            # WHEN the step runs three times
            step.run()
            counts.append(len(step.model.fc2._forward_hooks))
    # THEN each run leaves none of the hooks its forward registered: they do not pile up
    assert counts == [0, 0, 0]
