"""Fix advice beyond float32 (nanhunt.advice): each pattern from a tiny model with the fault, replayed end to end
by ``hunt``; exactly which advice is given, and the measurement it quotes. A healthy step gets none; a precision
fault that matches no pattern gets only the bisection's float32 fix."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt.hunt.advice import PATTERNS, advise
from nanhunt.hunt.pipeline import hunt
from nanhunt.records import Advice, FullStats, Occurrence, Phase, Record, Report, Role
from nanhunt.step.step import Step

X = torch.ones(2, 4)


def _advice(report: Report) -> list[tuple[str, str]]:
    return [(a.pattern, a.because) for a in report.advice]


# ------------------------------------------------------------------ models with one fault each


class HandSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.fc(x))  # FAULT: exp(120) overflows float32, no max subtracted
        return e / e.sum(-1, keepdim=True)


class LogSoftmaxByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(x), -1))  # FAULT: softmax underflows to 0, log(0)


class RootOfSquares(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.sqrt((h * h).sum(-1))  # FAULT: d sqrt(u)/du at u = 0 is infinite


class SquareRootPow(RootOfSquares):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (self.fc(x).abs() ** 0.5).sum(-1)  # FAULT: d u**0.5/du at u = 0 is infinite
        return out


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = (self.q(x) @ x.transpose(-2, -1)).masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, -1) @ x  # FAULT: row 1 keeps no key


class ScaleUp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1000.0  # FAULT (no pattern): a float16 product above 65504


def _zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _filled(linear: nn.Module, weight: float) -> None:
    assert isinstance(linear, nn.Linear)
    with torch.no_grad():
        linear.weight.fill_(weight)
        linear.bias.zero_()


# ------------------------------------------------------------------ one pattern each


def test_exp_overflow_in_a_hand_written_softmax() -> None:
    # GIVEN exp(x) / sum(exp(x)) with x = 4 * 30 = 120 > ln(float32 max) = 88.72
    m = HandSoftmax()
    _filled(m.fc, 30.0)
    # WHEN the step is replayed
    report = hunt(Step.of(m, (X, torch.zeros(2, 3)), loss_fn=F.mse_loss, dtype=torch.float32))
    # THEN one advice: subtract the max / F.softmax, because of the exp's input max and the NaN division after it
    assert _advice(report) == [(
        "exp-overflow-softmax",
        "aten::exp made +Inf in phase forward (float32, module <root>): its input (aten::addmm, float32 [2, 3]) has "
        "max 120 > 88.72 = ln(float32 max); then aten::div made NaN (Inf / Inf), a softmax's normalisation")]
    assert "F.softmax(scores, dim=-1)" in report.advice[0].fix


def test_exp_overflow_without_a_normalisation_gets_no_softmax_advice() -> None:
    # GIVEN the same exp overflow used as an activation: nothing divides by its sum
    m = nn.Sequential(nn.Linear(4, 3))
    _filled(m[0], 30.0)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.exp(out), y)

    # WHEN replayed THEN the softmax pattern does not fire (its measurement, the division's NaN, is missing)
    report = hunt(Step.of(m, (X, torch.zeros(2, 3)), loss_fn=loss, dtype=torch.float32))
    assert report.first is not None and report.first.op == "aten::exp"
    assert report.advice == ()


def test_log_of_a_probability_that_underflowed() -> None:
    # GIVEN log(softmax(z)) with z = (400, 0, 0): the softmax's 0 and 0 underflow
    m = LogSoftmaxByHand()
    _zeroed(m)
    with torch.no_grad():
        m.fc.weight[0].fill_(100.0)
    # WHEN replayed
    report = hunt(Step.of(m, (X, torch.zeros(2, 3)), loss_fn=F.mse_loss, dtype=torch.float32))
    # THEN log_softmax / clamp_min, because the log's input has min 0, from a softmax that underflowed
    assert _advice(report) == [(
        "log-of-zero",
        "aten::log made -Inf in phase forward (float32, module <root>): its input (aten::_softmax, float32 [2, 3]) "
        "has min 0 (4 zeros of 6), aten::_softmax having underflowed to 0: log(0) = -inf")]
    assert report.advice[0].fix.splitlines()[0].startswith("logp = F.log_softmax(logits, dim=-1)")


@pytest.mark.parametrize("model,because", [
    (RootOfSquares,
     "aten::div made -Inf in phase backward (float32, module <root>), in the derivative of aten::sqrt: input 1 "
     "(aten::mul, float32 [2]) holds 2 zeros of 2"),
    (SquareRootPow,
     "aten::pow made +Inf in phase backward (float32, module <root>), in the derivative of aten::pow: input 0 "
     "(aten::abs, float32 [2, 4]) holds 8 zeros of 8"),
])
def test_sqrt_and_pow_at_zero_in_backward(model: type[nn.Module], because: str) -> None:
    # GIVEN sqrt / pow(0.5) of a layer whose output is exactly 0, a target of 1 (a non-zero gradient)
    m = _zeroed(model())
    # WHEN replayed
    report = hunt(Step.of(m, (X, torch.ones(2)), loss_fn=F.mse_loss, dtype=torch.float32))
    # THEN an epsilon inside / F.normalize, because of the zero the derivative was taken at
    assert report.first is not None and report.first.phase is Phase.BACKWARD
    assert _advice(report) == [("grad-at-zero", because)]
    assert "torch.sqrt(x + eps)" in report.advice[0].fix


def test_softmax_over_a_fully_masked_row() -> None:
    # GIVEN causal attention whose row 1 keeps no key
    torch.manual_seed(0)
    m = MaskedAttention()
    keep = torch.ones(3, 3, dtype=torch.bool).tril()
    keep[1] = False
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    # WHEN replayed
    report = hunt(Step.of(m, ((x, keep), torch.zeros(3, 4)), loss_fn=F.mse_loss, dtype=torch.float32))
    # THEN keep one key per row / nan_to_num, because the softmax's input holds -inf and nothing else non-finite
    assert _advice(report) == [(
        "masked-softmax-row",
        "aten::_softmax made NaN in phase forward (float32, module <root>): its input (aten::masked_fill, float32 "
        "[3, 3]) holds -Inf (5 of 9) and no +Inf or NaN, so a row of only -Inf (every key masked): 0/0")]


def test_float16_matmul_overflow_quotes_the_bisection() -> None:
    # GIVEN a Linear whose float16 product is 4 * 100 * 1000 = 4e5 > 65504, with a GradScaler
    m = nn.Sequential(nn.Linear(4, 4))
    _filled(m[0], 1000.0)
    step = Step.of(m, (torch.full((2, 4), 100.0), torch.zeros(2, 4)), loss_fn=F.mse_loss, dtype=torch.float16,
                   scaler=torch.amp.GradScaler("cpu"))
    # WHEN replayed and bisected
    report = hunt(step, prove=True)
    # THEN bfloat16 / keep_fp32 / scaled init, because of the float16 Inf from finite inputs (and bfloat16 was tried)
    assert _advice(report) == [(
        "fp16-matmul-overflow",
        "aten::addmm made +Inf in phase forward (float16, module 0): its inputs' max |x| 0, 100, 1000, float16's "
        "max 65504; the whole step in bfloat16: finite")]
    fix = report.advice[0].fix
    assert 'torch.autocast("cpu", dtype=torch.bfloat16)' in fix and "nanhunt.keep_fp32(model, ['0'])" in fix
    assert report.verdict is not None and report.verdict.fix is not None  # the float32 fix stays


def test_adam_eps_below_float16_normal_with_float16_state() -> None:
    # GIVEN a half model under Adam (eps 1e-8, 0 in float16): gradients ~1e-3 square to 0 in float16's v
    m = nn.Linear(4, 1).half()
    with torch.no_grad():
        m.weight.fill_(0.01)
        m.bias.zero_()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.full((2, 4), 1e-3).half(), torch.ones(2, 1).half()
    # WHEN replayed (no autocast: the model itself is float16)
    report = hunt(Step.of(m, (x, y), loss_fn=F.mse_loss, dtype=torch.float32, optimizer=opt))
    # THEN float32 optimizer state, because of the float16 update op and eps below float16's smallest normal
    assert report.config["optimizer_eps"] == 1e-8
    assert _advice(report) == [(
        "fp16-optimizer-eps",
        "aten::addcdiv_ made +Inf in phase update (float16): Adam eps 1e-08 is below float16's smallest normal "
        "6.104e-05 (in float16 it is 0); input 2 (aten::add_, float16 [1, 4]) is all zeros")]
    assert report.advice[0].fix.startswith("model.float()")


def _tiny_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y) * 1e-6  # gradients ~1e-7: subnormal in float16


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def test_gradient_underflow_without_a_scaler() -> None:
    # GIVEN a float16 autocast step with no GradScaler whose loss is scaled down to 1e-6
    # WHEN replayed: the step itself is finite
    report = hunt(Step.of(_mlp(), _xy(), loss_fn=_tiny_loss, dtype=torch.float16))
    # THEN GradScaler, because the float16 gradients of the backward sit below float16's smallest normal
    assert report.status == "clean"
    under = report.config["fp16_backward_underflow"]
    assert (under["tensors"], under["of"]) == (7, 7)
    assert _advice(report) == [(
        "fp16-grad-underflow",
        "no GradScaler; 7 of 7 float16 tensors of the backward have their largest |x| below float16's smallest "
        f"normal 6.104e-05 (largest {under['largest']:.4g}, at {under['at']}): subnormal, or flushed to 0")]
    assert under["at"] == "backward 2#0 aten::sum output" and 0 < under["largest"] < 6.103515625e-05


# ------------------------------------------------------------------ no advice


def test_healthy_step_gets_no_advice() -> None:
    # GIVEN an ordinary float16 AMP step: GradScaler, Adam, gradients of order 0.1
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = Step.of(model, _xy(), loss_fn=F.mse_loss, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"),
                   optimizer=opt)
    # WHEN replayed THEN it is clean and no advice is given (not even Adam's eps: nothing went non-finite)
    report = hunt(step)
    assert report.status == "clean"
    assert report.advice == ()
    assert "fp16_backward_underflow" not in report.config


def test_fault_matching_no_pattern_gets_only_the_float32_fix() -> None:
    # GIVEN a float16 product above 65504 in an elementwise multiply (no pattern covers it)
    m = nn.Sequential(nn.Linear(4, 4), ScaleUp())
    _filled(m[0], 25.0)  # 4 * 25 = 100 per output, * 1000 = 1e5
    step = Step.of(m, (X, torch.zeros(2, 4)), loss_fn=F.mse_loss, dtype=torch.float16,
                   scaler=torch.amp.GradScaler("cpu"))
    # WHEN replayed and bisected
    report = hunt(step, prove=True)
    # THEN no advice; the bisection's keep_fp32_permanently is the only fix
    assert report.first is not None and (report.first.op, report.first.module) == ("aten::mul", "1")
    assert report.advice == ()
    assert report.verdict is not None and report.verdict.kind == "precision"
    assert report.verdict.fix is not None and "keep_fp32_permanently" in report.verdict.fix


# ------------------------------------------------------------------ the rules on plain data


def _occ(op: str, phase: Phase, lo: float, hi: float, inputs: tuple[Record, ...], *, kind: str = "inf",
         dtype: str = "float32", reached: tuple[str, ...] | None = ("loss",)) -> Occurrence:
    out = Record(index=9, phase=phase, module="m", call_index=0, op=op, role=Role.OUTPUT, dtype=dtype, shape=(2,),
                 min=lo, max=hi)
    return Occurrence(phase=phase, module="m", module_class="M", call_index=0, op=op, kind=kind, source=None,
                      output=out, inputs=inputs, reached=reached)


def _in(lo: float, hi: float, *, op: str = "aten::mm", zeros: int | None = None) -> Record:
    full = None if zeros is None else FullStats(nan=0, posinf=0, neginf=0, zeros=zeros, numel=4, min_nonzero_abs=None,
                                                over_fp16=0, over_bf16=0, subnormal=0)
    return Record(index=1, phase=Phase.FORWARD, module="m", call_index=0, op=op, role=Role.OUTPUT, dtype="float32",
                  shape=(2, 2), min=lo, max=hi, full=full)


def test_no_rule_fires_without_its_measurement() -> None:
    # GIVEN findings that resemble the patterns but lack the measurement each rule names
    cases = [
        _occ("aten::log", Phase.FORWARD, -math.inf, 0.0, (_in(-1.0, 1.0),)),  # a negative argument, not a 0
        _occ("aten::_softmax", Phase.FORWARD, math.nan, math.nan, (_in(-math.inf, math.inf),), kind="nan"),  # +inf too
        _occ("aten::addmm", Phase.FORWARD, math.inf, math.inf, (_in(1.0, 2.0),)),  # float32, not float16
        _occ("aten::div", Phase.BACKWARD, math.inf, math.inf, (_in(1.0, 2.0, zeros=0),)),  # no zero, no sqrt
        _occ("aten::pow", Phase.BACKWARD, math.inf, math.inf, (_in(0.0, 2.0),), reached=()),  # silent: absorbed
        _occ("aten::addcdiv_", Phase.UPDATE, math.inf, math.inf, (_in(0.0, 0.0),), dtype="float16"),  # eps unknown
    ]
    for occ in cases:
        # WHEN advised THEN nothing
        assert advise(Report(status="nonfinite", first=occ, origins=(occ,))) == (), occ.op
    # AND a float16 gradient underflow with an enabled GradScaler gets no GradScaler advice
    under = {"tensors": 3, "of": 5, "largest": 1e-6, "at": "backward fc aten::mm output"}
    scaled = Report(status="clean", first=None, config={"scaler_scale": 1024.0, "fp16_backward_underflow": under})
    assert advise(scaled) == ()
    unscaled = Report(status="clean", first=None, config={"fp16_backward_underflow": under})
    assert [a.pattern for a in advise(unscaled)] == ["fp16-grad-underflow"]


def test_every_pattern_is_documented_and_advice_round_trips() -> None:
    # GIVEN the patterns WHEN the guide's "How it decides" is read THEN each id is listed with its trigger
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "how-it-decides.md").read_text()
    assert all(f"`{p}`" in guide for p in PATTERNS)
    # AND an Advice survives the report's JSON
    a = Advice(pattern="log-of-zero", advice="a", fix="x = 1\ny = 2", because="b")
    assert Report.from_json(Report(status="clean", first=None, advice=(a,)).to_json()).advice == (a,)
