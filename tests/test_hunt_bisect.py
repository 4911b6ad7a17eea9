"""Hunt for wrong bisection verdicts and culprit sets on models whose truth is known.

Every expected verdict is computed independently: the step is run by hand (``copy.deepcopy`` of the
model, ``torch.autocast``, ``nanhunt.keep_fp32`` only as the knob being tested) and checked for finite
loss and gradients. Tests marked ``xfail(strict=True)`` document bugs found in this review.

The classes below are importable as ``tests.test_hunt_bisect:NAME`` for ``nanhunt replay --model``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.records import Report

ROOT = Path(__file__).resolve().parents[1]
D = 8
LOSS = "<loss>"


# ====================================================================== helpers


class Eye(nn.Linear):
    """``k`` times the identity, no bias: a Linear whose output is exactly ``k * x``."""

    def __init__(self, k: float = 1.0, d: int = D) -> None:
        super().__init__(d, d)
        with torch.no_grad():
            self.weight.copy_(torch.eye(d) * k)
            self.bias.zero_()


class Up(nn.Module):
    """Overflows float16 (8 * 4e4 = 3.2e5) and leaves the value large: the next module must take it in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        with torch.no_grad():
            self.fc.weight.fill_(4e4)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Hot(Up):
    """fc fits float16 (weights 4e4) but its matmul does not (8 * 4e4 * x); scaled back down after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / (D * 4e4)


def step_finite(model: nn.Module, x: Any, y: Any, loss_fn: Callable[..., torch.Tensor], *,
                fp32: Iterable[str] = (), dtype: torch.dtype = torch.float16, scale: float | None = None,
                train: bool | None = None) -> bool:
    """Ground truth, by hand, on a copy: forward + loss under autocast (``fp32`` modules and ``<loss>``
    with autocast off), backward of ``loss * scale`` (as GradScaler multiplies: a float32 tensor);
    True when the loss and every gradient are finite."""
    m = copy.deepcopy(model)
    if train is not None:
        m.train(train)
    fp32 = set(fp32)
    with nanhunt.keep_fp32(m, [n for n in fp32 if n != LOSS]):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = m(x)
            if LOSS in fp32:
                with torch.autocast("cpu", enabled=False):
                    loss = loss_fn(out.float(), y)
            else:
                loss = loss_fn(out, y)
    scaled = loss if scale is None else loss * torch.full((1,), scale, dtype=torch.float32)
    scaled.sum().backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    return bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads)


def _verdict(rep: Report) -> nanhunt.records.Verdict:
    assert rep.verdict is not None
    return rep.verdict


# ====================================================================== (1) two modules needed together


class Down(nn.Module):
    """Brings 3.2e5 back to ~1; in float16 its input cast alone is already inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        with torch.no_grad():
            self.fc.weight.fill_(1.0 / (D * D * 4e4))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_pair_needed_together_neither_alone_is_found() -> None:
    m = nn.Sequential(Eye(), Up(), Down(), Eye())
    x, y = torch.ones(2, D), torch.zeros(2, D)
    # ground truth: neither alone, both together
    assert not step_finite(m, x, y, F.mse_loss)
    for alone in (["1.fc"], ["2.fc"], ["1"], ["2"]):
        assert not step_finite(m, x, y, F.mse_loss, fp32=alone)
    assert step_finite(m, x, y, F.mse_loss, fp32=["1.fc", "2.fc"])
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, bisect=True)
    v = _verdict(rep)
    assert rep.first is not None and (rep.first.module, rep.first.op) == ("1.fc", "aten::addmm")
    assert (v.kind, v.culprits, v.confirmed, v.origin_alone_fixes) == ("precision", ("1.fc", "2.fc"), True, False)


def test_pair_of_a_module_and_the_loss_needed_together() -> None:
    # GIVEN a last layer that overflows float16, and a loss whose own matmul overflows on its float32 output
    proj = torch.eye(D)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out @ proj) * 1e-6 - y).pow(2).mean()

    m = nn.Sequential(Eye(), Eye(1e4))
    x, y = torch.ones(2, D) * 10, torch.zeros(2, D)
    assert not step_finite(m, x, y, loss_fn, fp32=["1"])
    assert not step_finite(m, x, y, loss_fn, fp32=[LOSS])
    assert step_finite(m, x, y, loss_fn, fp32=["1", LOSS])
    v = _verdict(nanhunt.replay(m, (x, y), loss_fn=loss_fn, bisect=True))
    assert (v.kind, v.culprits, v.confirmed) == ("precision", ("1", LOSS), True)


# ====================================================================== (2) fails in float32 too


@pytest.mark.parametrize("loss_fn, op", [
    (lambda o, y: torch.log(o - 5.0).mean(), "aten::log"),              # log of a negative
    (lambda o, y: (o * 0).sum() / (o * 0).sum(), "aten::div"),          # 0 / 0
], ids=["log-negative", "zero-over-zero"])
def test_nan_in_the_loss_also_in_float32_is_not_precision(loss_fn: Callable[..., torch.Tensor], op: str) -> None:
    m = nn.Sequential(Eye(), Eye())
    x, y = torch.ones(2, D), torch.zeros(2, D)
    assert not step_finite(m, x, y, loss_fn, dtype=torch.float32)
    rep = nanhunt.replay(m, (x, y), loss_fn=loss_fn, bisect=True)
    v = _verdict(rep)
    assert (v.kind, v.culprits, v.fix) == ("not-precision", (), None)
    f = v.float32_first
    assert f is not None and (f.phase.value, f.module, f.op) == ("loss", None, op)


class HalfHot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Eye()
        self.hot = Hot()
        self.b = Eye()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.hot(self.a(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["autocast-fp16", "no-autocast"])
def test_float16_model_overflow_is_not_called_not_precision(dtype: torch.dtype) -> None:
    # GIVEN a pure float16 model (model.half(), which captures replay "in their dtype") overflowing in hot.fc
    m = HalfHot().half()
    x, y = torch.ones(2, D, dtype=torch.float16), torch.zeros(2, D, dtype=torch.float16)
    # truth: the same model and batch in float32 are finite: float16 is to blame
    assert step_finite(copy.deepcopy(m).float(), x.float(), y.float(), F.mse_loss, dtype=torch.float32)
    assert not step_finite(m, x, y, F.mse_loss, dtype=torch.float32)
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, dtype=dtype, bisect=True)
    assert rep.first is not None and rep.first.module == "hot.fc"
    v = _verdict(rep)
    assert v.kind != "not-precision", v


# ====================================================================== (3) scale-induced


def test_float16_loss_whose_scaled_gradient_overflows_is_scale_induced() -> None:
    # GIVEN a loss left in float16 (sum of a float16 output): its gradient is the scale itself, 2**17 > 65504
    def loss_fn(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return o.sum() * 1e-3

    m = nn.Sequential(Eye(), Eye())
    x, y = torch.ones(2, D), torch.zeros(2, D)
    assert step_finite(m, x, y, loss_fn)  # scale 1
    assert not step_finite(m, x, y, loss_fn, scale=2.0**17)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17)
    rep = nanhunt.replay(m, (x, y), loss_fn=loss_fn, scaler=scaler, bisect=True)
    assert rep.first is not None and rep.first.phase.value == "backward"
    v = _verdict(rep)
    assert (v.kind, v.culprits, v.alternatives.get("scale 1")) == ("scale-induced", (), True)
    assert scaler.get_scale() == 2.0**17


class Clamped(nn.Module):
    """fc overflows float16 and the clamp absorbs it: a silent origin (the step's loss and gradients stay finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = Eye(1e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x).clamp(max=1.0)


def test_scaled_gradient_overflow_after_a_silent_forward_origin_is_scale_induced() -> None:
    m = nn.Sequential(Clamped(), Eye(20.0))
    x, y = torch.ones(2, D) * 10, torch.zeros(2, D)
    # truth: finite in float32 (scaled), finite at scale 1 in float16, non-finite only with the scale
    assert step_finite(m, x, y, F.mse_loss, dtype=torch.float32, scale=2.0**16)
    assert step_finite(m, x, y, F.mse_loss)
    assert not step_finite(m, x, y, F.mse_loss, scale=2.0**16)
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16),
                         bisect=True)
    # the forward origin (clamped) is silent; the leading one is the scaled gradient overflow that reaches
    # the gradients (issue 13: the headline follows the first origin that reaches a sink)
    assert rep.first is not None and not rep.first.silent and rep.first.phase.value == "backward"
    assert rep.origins[0].silent and rep.origins[0].phase.value == "forward"
    v = _verdict(rep)
    assert v.alternatives.get("scale 1") is True
    assert v.kind == "scale-induced", v


# ====================================================================== silent-only step


def test_silent_only_finding_is_not_called_not_reproducible() -> None:
    m = nn.Sequential(Clamped(), Eye())
    x, y = torch.ones(2, D) * 10, torch.zeros(2, D)
    assert step_finite(m, x, y, F.mse_loss)  # nothing reaches the loss or the gradients
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, bisect=True)
    a, b = rep.runs
    assert a is not None and b is not None and a.describe() == b.describe() and a.silent
    assert rep.status == "nonfinite"
    assert _verdict(rep).kind != "not-reproducible", rep.verdict


# ====================================================================== (6) where the culprit lives


def test_overflow_in_the_loss_blames_the_loss_not_the_layer_before() -> None:
    def loss_fn(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((o * 1000.0) ** 2).mean() * 1e-6  # 1e4 ** 2 overflows float16: the pow in the loss

    m = nn.Sequential(Eye(), Eye())
    x, y = torch.ones(2, D) * 10, torch.zeros(2, D)
    assert not step_finite(m, x, y, loss_fn)
    assert step_finite(m, x, y, loss_fn, fp32=[LOSS])
    rep = nanhunt.replay(m, (x, y), loss_fn=loss_fn, bisect=True)
    assert rep.first is not None and (rep.first.phase.value, rep.first.module, rep.first.op) == ("loss", None, "aten::pow")
    v = _verdict(rep)
    assert v.kind == "precision" and v.origin_alone_fixes is True
    assert v.culprits == (LOSS,), v.culprits


class Heads(nn.Module):
    """A namespace: holds modules, has no forward, is never called (the parent calls its children)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Eye()
        self.b = Hot()


class ViaNamespace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = Eye()
        self.heads = Heads()
        self.out = Eye()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.heads.b(self.heads.a(self.inp(x))))


def test_culprit_inside_an_uncalled_namespace_module() -> None:
    m = ViaNamespace()
    x, y = torch.ones(2, D), torch.zeros(2, D)
    assert not step_finite(m, x, y, F.mse_loss)
    assert step_finite(m, x, y, F.mse_loss, fp32=["heads.b.fc"])
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, bisect=True)
    v = _verdict(rep)
    assert rep.first is not None and rep.first.module == "heads.b.fc"
    assert v.kind == "precision" and v.origin_alone_fixes is True
    assert v.culprits == ("heads.b.fc",), v.culprits


# ====================================================================== (7) train= and BatchNorm


class BNHot(nn.Module):
    """Batch statistics (train) blow a small-variance batch up to ~unit scale and hot.fc overflows;
    running statistics (eval: mean 0, var 1) leave it small and finite."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.hot = Hot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hot(self.bn(x))


def test_bisection_honours_train_flag() -> None:
    torch.manual_seed(0)
    m = BNHot().eval()
    x, y = torch.randn(16, D) * 0.01, torch.zeros(16, D)
    assert step_finite(m, x, y, F.mse_loss, train=False)
    assert not step_finite(m, x, y, F.mse_loss, train=True)
    assert step_finite(m, x, y, F.mse_loss, train=True, fp32=["hot.fc"])
    rep = nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, train=True, bisect=True)
    assert rep.status == "nonfinite" and rep.first is not None and rep.first.module == "hot.fc"
    assert not m.training
    v = _verdict(rep)
    assert (v.kind, v.culprits) == ("precision", ("hot.fc",)), v


# ====================================================================== (8) the CLI on foreign files


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


class FrozenBN(nn.Module):
    """Fine-tuning with a frozen BatchNorm: running variance 1e-4 (x100) feeds fc (weights 100)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.fc = nn.Linear(D, D)
        with torch.no_grad():
            self.bn.running_var.fill_(1e-4)
            self.fc.weight.fill_(100.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x)) * 1e-4


def test_capture_of_a_model_with_a_frozen_batchnorm_replays_it_frozen(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = FrozenBN().train()
    m.bn.eval()
    x, y = 1 + 0.1 * torch.randn(16, D), torch.zeros(16, D)
    assert not step_finite(m, x, y, F.mse_loss)  # the live step, frozen BN: 8 * 100 * 100 overflows float16
    assert step_finite(m, x, y, F.mse_loss, fp32=["fc"])
    api = _verdict(nanhunt.replay(m, (x, y), loss_fn=F.mse_loss, bisect=True))
    assert (api.kind, api.culprits) == ("precision", ("fc",))
    nanhunt.save_capture(tmp_path / "ck.pt", tmp_path / "batch.pt", model=m, batch=(x, y), loss_fn=F.mse_loss,
                         model_factory="tests.test_hunt_bisect:FrozenBN")
    code, err, rep = _cli(tmp_path, None, None, "--model", "tests.test_hunt_bisect:FrozenBN")
    assert rep is not None, err
    assert code == 1 and rep.status == "nonfinite", (code, rep.status)
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.culprits) == ("precision", ("fc",))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def averaged() -> nn.Module:
    """torch's own SWA/EMA wrapper: its state_dict keys are ``module.fc1.weight``..., ``n_averaged``."""
    from torch.optim.swa_utils import AveragedModel

    return AveragedModel(Net())


@pytest.mark.parametrize("wrap", ["plain", "ddp"])
def test_state_dict_of_a_model_with_a_child_named_module(wrap: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = averaged().state_dict()
    assert "module.fc1.weight" in sd
    if wrap == "ddp":
        sd = {f"module.{k}": v for k, v in sd.items()}
    code, err, rep = _cli(tmp_path, sd, (torch.randn(4, D), torch.randn(4, D)), "--model", "tests.test_hunt_bisect:averaged",
                          "--loss", "torch.nn.functional:mse_loss", "--dtype", "float32")
    assert code == 0, err
    assert rep is not None and rep.status == "clean"


def test_lightning_state_dict_with_a_loss_buffer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = Net().state_dict()
    lightning = {"state_dict": {**{f"model.{k}": v for k, v in sd.items()}, "criterion.pos_weight": torch.ones(D)},
                 "epoch": 3}
    code, err, _ = _cli(tmp_path, lightning, (torch.randn(4, D), torch.randn(4, D)), "--model",
                        "tests.test_hunt_bisect:Net", "--loss", "torch.nn.functional:mse_loss", "--dtype", "float32")
    # either replayed (the loss's buffer ignored with a warning), or one error naming only what is really extra
    assert code == 0 or (code == 2 and "missing" not in err and "criterion.pos_weight" in err), err


class HotNet(nn.Module):
    """fc1 identity, fc2 hot (the weights come from the checkpoint); returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x)) / (D * 2.0**15)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor


class HotKwargs(HotNet):
    """HF style: keyword arguments in, an output object with ``.loss`` out."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:  # type: ignore[override]
        logits = super().forward(x)
        return Output(logits, F.mse_loss(logits, labels))


class HotScalar(HotNet):
    """Takes the batch tensor alone and returns its scalar loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).pow(2).mean()


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
        "kwargs-dot-loss": ({"model": _hot_sd()}, {"x": x, "labels": y}, ["--model", "tests.test_hunt_bisect:HotKwargs"]),
        "tensor-scalar-loss": (_hot_sd(), x, ["--model", "tests.test_hunt_bisect:HotScalar"]),
        "inputs-targets-dict": (_hot_sd(), {"inputs": x, "targets": y}, ["--model", "tests.test_hunt_bisect:HotNet", *mse]),
        "bf16-weights": (_hot_sd(torch.bfloat16), (x, y), ["--model", "tests.test_hunt_bisect:HotNet", *mse]),
    }[case]
    code, err, rep = _cli(tmp_path, ck, batch, *args)
    assert rep is not None, err
    assert code == 1, err
    assert rep.first is not None and (rep.first.module, rep.first.op) == ("fc2", "aten::addmm")
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.culprits) == ("precision", ("fc2",))
    assert rep.verdict.alternatives.get("bfloat16") is True
    json.loads((tmp_path / "r.json").read_text())  # a valid JSON report
