"""Bisection by local float32 on models whose culprit is known."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.report._common import verdict_text


class Cell(nn.Module):
    """Identity-like linear; a hot cell has weights that overflow float16 in its matmul and
    scales the result back down, so its float32 run keeps forward *and* gradients small."""

    def __init__(self, d: int, hot: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.scale = 1 / (d * 4e4) if hot else 1.0  # back to the input's magnitude
        with torch.no_grad():
            self.fc.bias.zero_()
            if hot:
                self.fc.weight.fill_(4e4)  # fits float16; 8 * 4e4 * x does not
            else:
                self.fc.weight.copy_(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class Chain(nn.Module):
    def __init__(self, n: int, hot: tuple[int, ...] = (), d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Cell(d, i in hot) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _report(model: nn.Module, x: torch.Tensor, **kw: object) -> nanhunt.Report:
    y = torch.zeros(x.shape[0], x.shape[-1])
    return nanhunt.replay(model, (x, y), loss_fn=F.mse_loss, bisect=True, **kw)  # type: ignore[arg-type]


def test_single_overflowing_linear() -> None:
    torch.manual_seed(0)
    rep = _report(Chain(6, hot=(3,)), torch.ones(4, 8))
    v = rep.verdict
    assert rep.first is not None and (rep.first.module, rep.first.op) == ("layers.3.fc", "aten::addmm")
    assert v is not None and v.kind == "precision"
    assert v.culprits == ("layers.3.fc",)
    assert v.confirmed and v.origin_alone_fixes is True
    assert v.fix is not None and "layers.3.fc" in v.fix


def test_two_independent_culprits() -> None:
    # GIVEN two layers that overflow on their own, far apart
    rep = _report(Chain(8, hot=(1, 5)), torch.ones(4, 8))
    v = rep.verdict
    # THEN the minimal set holds both, and the origin alone does not fix the step
    assert v is not None and v.kind == "precision"
    assert set(v.culprits) == {"layers.1.fc", "layers.5.fc"}
    assert v.origin_alone_fixes is False
    assert v.confirmed


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        with torch.no_grad():
            self.shared.weight.copy_(torch.eye(8) * 300.0)
            self.mid.weight.copy_(torch.eye(8))
            self.shared.bias.zero_()
            self.mid.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 300 -> fine; 300*300*x -> overflow on call 1, scaled back so float32 stays small
        return self.shared(self.mid(self.shared(x))) * 1e-4


def test_culprit_in_module_called_twice() -> None:
    rep = _report(Twice(), torch.ones(2, 8))
    assert rep.first is not None and (rep.first.module, rep.first.call_index) == ("shared", 1)
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.culprits == ("shared",)


def test_fails_in_float32_too() -> None:
    class Div(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / (x - x)

    rep = _report(nn.Sequential(nn.Linear(8, 8), Div()), torch.ones(2, 8))
    v = rep.verdict
    assert v is not None and v.kind == "not-precision"
    assert v.float32_first is not None and v.float32_first.module == "1" and v.float32_first.op == "aten::div"
    assert v.culprits == ()


def test_scale_induced_gradient_overflow() -> None:
    # GIVEN a finite forward whose gradients overflow float16 only when multiplied by the loss scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.fill_(20.0)
    x = torch.ones(4, 8) * 10
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    rep = _report(model, x, scaler=scaler)
    v = rep.verdict
    assert rep.first is not None and rep.first.phase.value == "backward"
    assert v is not None and v.kind == "scale-induced"
    assert v.alternatives.get("scale 1") is True
    assert scaler.get_scale() == 2.0**16  # untouched


def test_bfloat16_alternative_reported() -> None:
    rep = _report(Chain(4, hot=(2,)), torch.ones(2, 8))
    v = rep.verdict
    assert v is not None and v.alternatives["bfloat16"] is True


def test_not_precision_in_bfloat16_run_is_clean() -> None:
    rep = _report(Chain(4, hot=(2,)), torch.ones(2, 8), dtype=torch.bfloat16)
    assert rep.status == "clean" and rep.verdict is not None and rep.verdict.kind == "clean"


class DropBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.hot = Cell(8, hot=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hot(self.drop(self.bn(self.fc(x))) + 4.0)


def test_dropout_and_batchnorm_trials_are_deterministic() -> None:
    torch.manual_seed(0)
    m = DropBN()
    x = torch.randn(16, 8)
    stats = (m.bn.running_mean.clone(), m.bn.running_var.clone(), m.bn.num_batches_tracked.clone())
    rng = torch.get_rng_state()
    rep = _report(m, x)
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.culprits == ("hot.fc",) and v.confirmed
    assert torch.equal(m.bn.running_mean, stats[0]) and torch.equal(m.bn.running_var, stats[1])
    assert torch.equal(m.bn.num_batches_tracked, stats[2])
    assert torch.equal(torch.get_rng_state(), rng)


def test_replays_grow_logarithmically() -> None:
    # GIVEN 64 modules with one culprit
    rep = _report(Chain(64, hot=(41,)), torch.ones(2, 8))
    v = rep.verdict
    assert v is not None and v.culprits == ("layers.41.fc",)
    # THEN about 2*log2(64)+4 replays, not 64
    assert v.replays <= 2 * math.log2(64) + 4 + 4  # +4: the control and alternative runs


def test_keep_fp32_restores_forward() -> None:
    m = Chain(3)
    with nanhunt.keep_fp32(m, ["layers.1.fc"]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert m.layers[1].fc(torch.ones(1, 8)).dtype == torch.float32
            assert m.layers[0].fc(torch.ones(1, 8)).dtype == torch.bfloat16
    assert "forward" not in m.layers[1].fc.__dict__
    with pytest.raises(KeyError):
        with nanhunt.keep_fp32(m, ["nope"]):
            pass


def test_ctrl_c_during_bisection_gives_partial_verdict_and_restores() -> None:
    # GIVEN a bisection interrupted (Ctrl-C) at its 6th replay
    m = Chain(8, hot=(5,))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.get_rng_state()
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2 + 6:  # the two traced replays, then the 6th bisection trial
            raise KeyboardInterrupt
        return F.mse_loss(out, y)

    x = torch.ones(2, 8)
    rep = nanhunt.replay(m, (x, torch.zeros(2, 8)), loss_fn=loss_fn, bisect=True)
    # THEN the report holds a verdict marked interrupted, and nothing of the model changed
    v = rep.verdict
    assert v is not None and v.interrupted and not v.confirmed
    assert v.replays == 6
    assert all(torch.equal(before[k], t) for k, t in m.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all("forward" not in mod.__dict__ for mod in m.modules())


class VarNorm(nn.Module):
    """A hand-written normalisation: under float16 the variance h^2 overflows; h / sqrt(inf) = 0."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        v = h.pow(2).mean(-1, keepdim=True)  # FAULT: 1e6 > 65504 in float16
        return h / torch.sqrt(v + 1e-5)  # the activations become 0: finite, and wrong


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(4, 8), VarNorm(), nn.Linear(8, 4)
        with torch.no_grad():
            self.fc.weight.fill_(250.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


def test_a_silent_origin_corrupting_values_is_a_precision_verdict() -> None:
    # GIVEN a step whose only origin (the variance overflow) is absorbed: loss and gradients stay finite
    torch.manual_seed(0)
    rep = _report(NormNet(), torch.ones(2, 4), dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    # THEN the origin is named, silent, and bisection answers "is the origin gone?": norm in float32
    assert rep.first is not None and (rep.first.phase.value, rep.first.module, rep.first.op) == (
        "forward", "norm", "aten::pow")
    assert rep.first.silent
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.silent and v.confirmed
    assert v.culprits == ("norm",) and v.origin_alone_fixes is True
    assert v.fix is not None and "norm" in v.fix
    # AND it says which values the absorbed Inf corrupted: the division that made the activations 0
    assert v.corrupted and v.corrupted[0].startswith("forward norm aten::div")
    assert "go away" in "".join(s.text for s in verdict_text(rep))


def test_origin_alone_is_answered_on_not_precision() -> None:
    # GIVEN a division by zero that float32 does not fix, in module "1"
    class Div(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / (x - x)

    rep = _report(nn.Sequential(nn.Linear(8, 8), Div()), torch.ones(2, 8))
    assert rep.verdict is not None and rep.verdict.kind == "not-precision"
    # THEN origin_alone_fixes is answered: running "1" alone in float32 does not help
    assert rep.verdict.origin_alone_fixes is False


@pytest.mark.slow
def test_a_compiled_models_origin_and_culprits_carry_the_users_names() -> None:
    # GIVEN a torch.compile'd chain whose layer 2 overflows float16
    torch.manual_seed(0)
    model = torch.compile(Chain(4, hot=(2,)), backend="eager")
    rep = _report(model, torch.ones(2, 8))
    # THEN origin, culprits and origin_alone_fixes speak of the same module, named as the user wrote it
    assert rep.first is not None and rep.first.module == "layers.2.fc"
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.culprits == ("layers.2.fc",)
    assert v.origin_alone_fixes is True


@pytest.mark.parametrize("foreach", [False, True])
def test_a_half_models_adam_update_is_fixed_by_float32_master_weights(foreach: bool) -> None:
    # GIVEN a model.half() model trained with Adam: fc1 is dead (relu of -100), its gradients are 0, and in
    # float16 eps=1e-8 is 0, so the update divides 0 by 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).half()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(2, 4).half(), torch.zeros(2, 2).half()
    rep = nanhunt.replay(model, (x, y), loss_fn=F.mse_loss, dtype=torch.float16, optimizer=opt, bisect=True)
    # THEN the NaN is born in the update, and the float32 control (update included) is finite: a precision
    # problem whose fix is float32 master weights (<update>), not "fails in float32 too"
    assert rep.first is not None and (rep.first.phase.value, rep.first.module) == ("update", None)
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.culprits == ("<update>",) and v.confirmed
    assert v.origin_alone_fixes is True
    assert v.fix is not None and "master weights" in v.fix
    # AND the model and its (empty) optimizer state are as they were
    assert all(torch.equal(a, b) and a.dtype == torch.float16 for a, b in zip(before, model.parameters()))
    assert not opt.state
