"""An overflow behind an intentional -inf mask is born where it overflows: the mask's -inf explains no +Inf
that the op could only make by overflowing (exp, a masked add / baddbmm, a cast), and the NaN a later division
or softmax makes of it is a consequence, not the culprit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import NonFiniteError, Phase
from nanhunt.hunt.pipeline import hunt
from nanhunt.tracing.locate import factor_negative, origin_kind
from nanhunt.records import Record, Role
from nanhunt.hunt.repro import make_repro
from nanhunt.step.step import Step

from tests._support.models import batch, seeded, where

INF, NAN_ = math.inf, math.nan
NEG_INF = -INF


def _causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)  # True above the diagonal: a future key, masked


# ---------------------------------------------------------------- a GPT block with a hand-written softmax


class ExpSoftmaxAttention(nn.Module):
    """Causal self-attention whose softmax is written out: masked_fill(-inf), exp, divide by the row sum."""

    def __init__(self, d: int = 8, t: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("causal", _causal(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
        att = att.masked_fill(self.causal, NEG_INF)
        e = torch.exp(att)  # FAULT when an unmasked logit exceeds ln(dtype max): no row max subtracted
        p = e / e.sum(-1, keepdim=True)
        return self.proj(p @ v)


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = ExpSoftmaxAttention(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


class HandGPT(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d)])
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def hand_gpt(gain: float) -> HandGPT:
    """The query and key projections scaled by ``gain``: the unmasked logits grow as gain**2 (largest in float32:
    0.47 at gain 1, 11.9 at gain 5, 101 at gain 15)."""
    seeded(0)
    m = HandGPT()
    with torch.no_grad():
        m.blocks[0].attn.qkv.weight[:16].mul_(gain)
    return m


X = batch(2, 4, 8)


def _traced(m: nn.Module, x: torch.Tensor, dtype: torch.dtype, **kw: bool) -> tuple[nanhunt.Trace, torch.Tensor]:
    with nanhunt.trace(m, **kw) as t:
        with torch.autocast("cpu", dtype=dtype):
            out = m(x)
        out.float().pow(2).mean().backward()
    return t, out


@pytest.mark.parametrize(("dtype", "gain"), [(torch.float16, 5.0), (torch.bfloat16, 15.0)])
def test_masked_exp_overflow_in_a_hand_written_softmax_is_born_in_exp(dtype: torch.dtype, gain: float) -> None:
    # GIVEN a GPT block whose causal softmax is written by hand and whose unmasked logits exceed ln(dtype max)
    # (float16: 11.9 > 11.09; bfloat16: 101 > 88.7)
    m = hand_gpt(gain)
    # WHEN the step runs under autocast
    t, out = _traced(m, X, dtype)
    assert torch.isnan(out).any()
    # THEN the exp that overflowed is named (+Inf out of an input holding only the mask's -inf), not the division
    # that made Inf / Inf into NaN
    assert where(t.first) == (Phase.FORWARD, "blocks.0.attn", "aten::exp", 0, "inf")
    assert t.first is not None and t.first.output.max == math.inf
    forward = [o.op for o in t.origins if o.phase is Phase.FORWARD]
    assert forward == ["aten::exp", "aten::div"]  # then Inf / Inf: NaN born again, from no NaN


def test_stop_at_first_stops_in_the_masked_exp() -> None:
    # GIVEN the float16 block; WHEN traced with stop_at_first THEN it stops inside the exp, as the full trace names it
    with pytest.raises(NonFiniteError) as info:
        _traced(hand_gpt(5.0), X, torch.float16, stop_at_first=True)
    assert where(info.value.occurrence) == (Phase.FORWARD, "blocks.0.attn", "aten::exp", 0, "inf")


@pytest.mark.slow
@pytest.mark.subprocess
def test_masked_exp_overflow_gets_the_softmax_advice_and_a_repro_of_the_exp(tmp_path: Path) -> None:
    # GIVEN the float16 block replayed as a step
    step = Step.of(hand_gpt(5.0), (X, torch.zeros(2, 4, 2)), loss_fn=F.mse_loss, dtype=torch.float16)
    # WHEN hunted and its repro made
    report = hunt(step)
    assert where(report.first) == (Phase.FORWARD, "blocks.0.attn", "aten::exp", 0, "inf")
    # THEN the advice for a hand-written softmax fires, quoting the unmasked max and the division after it
    assert [a.pattern for a in report.advice] == ["exp-overflow-softmax"]
    because = report.advice[0].because
    assert because.startswith("aten::exp made +Inf in phase forward (float16, module blocks.0.attn): its input "
                              "(aten::masked_fill, float16 [2, 4, 4]) has max 11.")
    assert because.endswith("> 11.09 = ln(float16 max), -Inf where masked; then aten::div made NaN (Inf / Inf), "
                            "a softmax's normalisation")
    # AND the repro is the exp alone, on the smallest slice of its masked input that still overflows (a cap of 16
    # bytes forces the slicing), verified in a fresh process
    assert report.first is not None
    rp = make_repro(step, report.first, str(tmp_path), cap_bytes=16)
    assert rp is not None and rp.verified, rp and rp.result
    assert (rp.op, rp.result, rp.sliced, rp.original_shapes) == ("aten::exp", "inf", True, ((2, 4, 4),))
    assert rp.inputs == (("float16", (1, 1, 1)),)  # one logit above 11.09


def test_masked_softmax_without_overflow_stays_clean() -> None:
    # GIVEN the same block with small logits (largest 7.7 < 11.09): the mask's -inf is all the step holds
    t, out = _traced(hand_gpt(4.0), X, torch.float16)
    # THEN nothing is born
    assert torch.isfinite(out).all()
    assert t.first is None and t.origins == []


# ---------------------------------------------------------------- a masked add / baddbmm that overflows


class MaskedScores(nn.Module):
    """Scores with the causal mask folded in: ``baddbmm(bias, q, k^T)`` or ``q @ k^T + bias``, bias holding -inf
    above the diagonal and ``offset`` (a position bias) elsewhere; then softmax."""

    def __init__(self, how: str, offset: float = 0.0, t: int = 4, d: int = 8) -> None:
        super().__init__()
        self.how = how
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("bias", torch.full((t, t), offset).masked_fill(_causal(t), NEG_INF))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        bias = self.bias.to(q.dtype).expand(x.shape[0], -1, -1)
        if self.how == "baddbmm":
            scores = torch.baddbmm(bias, q, k.transpose(1, 2))
        else:
            scores = q @ k.transpose(1, 2) + bias
        return scores.softmax(-1) @ self.v(x)


class Scored(nn.Module):
    def __init__(self, how: str, offset: float = 0.0) -> None:
        super().__init__()
        self.attn = MaskedScores(how, offset)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def scored(how: str, q: float, k: float, offset: float = 0.0) -> Scored:
    """Queries and keys of ``8 q`` and ``8 k`` for the first token (an input of ones), 1000 times smaller for the
    others: only the first score, unmasked, is large (8 * 8q * 8k + offset)."""
    seeded(0)
    m = Scored(how, offset)
    with torch.no_grad():
        for lin, w in ((m.attn.q, q), (m.attn.k, k)):
            lin.weight.fill_(w)
            lin.bias.zero_()
    return m


@pytest.mark.parametrize(("how", "dtype", "q", "k", "offset", "op"), [
    ("baddbmm", torch.float16, 12.0, 12.0, 0.0, "aten::baddbmm"),  # 8 * 96 * 96 = 73728 > 65504
    ("add", torch.float16, 8.0, 8.0, 40000.0, "aten::add"),  # the matmul's 32768 is finite; + 40000 is not
    ("baddbmm", torch.bfloat16, 1e18, 1e18, 0.0, "aten::baddbmm"),  # 8 * 8e18 * 8e18 > 3.39e38
])
def test_a_masked_add_whose_unmasked_part_overflows_is_the_origin(how: str, dtype: torch.dtype, q: float, k: float,
                                                                   offset: float, op: str) -> None:
    # GIVEN scores whose -inf mask is added in the same op that overflows at the unmasked positions
    m = scored(how, q, k, offset)
    # WHEN the step runs under autocast
    x = torch.ones(2, 4, 8)
    x[:, 1:] = 1e-3
    t, out = _traced(m, x, dtype)
    assert torch.isnan(out[:, 0]).all() and torch.isfinite(out[:, 1:]).all()  # the first query's row overflowed
    # THEN that op is named (+Inf where no input held +Inf: the mask's -inf cannot become +Inf there), not the
    # softmax that made NaN of it
    assert where(t.first) == (Phase.FORWARD, "attn", op, 0, "inf")


class MaskedSDPA(nn.Module):
    """``F.scaled_dot_product_attention`` with an additive float mask summed in the working dtype: the causal
    -inf, an ALiBi-style bias and a learned relative bias (``bias`` each)."""

    def __init__(self, bias: float, t: int = 4, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("causal", torch.zeros(t, t).masked_fill(_causal(t), NEG_INF))
        self.register_buffer("alibi", torch.full((t, t), bias))
        self.register_buffer("relative", torch.full((t, t), bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = self.causal.to(q.dtype) + self.alibi.to(q.dtype)
        mask = mask + self.relative.to(q.dtype)  # FAULT: 40000 + 40000 > 65504 where not masked
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_with_an_overflowing_additive_mask_names_the_add() -> None:
    # GIVEN an attention mask (-inf above the diagonal) summed with two position biases of 40000 in float16
    seeded(0)
    m = nn.Sequential(MaskedSDPA(4e4), nn.Linear(8, 2))
    # WHEN the step runs under float16 autocast (batch, heads, tokens, features: the fused CPU kernel)
    t, out = _traced(m, X.unsqueeze(1), torch.float16)
    assert torch.isnan(out).all()
    # THEN the add that overflowed is the origin, not the attention kernel that made NaN of its +Inf
    assert where(t.first) == (Phase.FORWARD, "0", "aten::add", 0, "inf")
    assert t.first is not None and t.first.inputs[0].min == -math.inf
    assert [o.op for o in t.origins if o.phase is Phase.FORWARD] == [
        "aten::add", "aten::_scaled_dot_product_flash_attention_for_cpu"]


class HugeSDPA(nn.Module):
    """``F.scaled_dot_product_attention`` on queries and keys so large their scaled products overflow the
    kernel's float32 scores (the CPU kernels accumulate float16 and bfloat16 in float32)."""

    def __init__(self, t: int = 4) -> None:
        super().__init__()
        self.register_buffer("causal", torch.zeros(t, t).masked_fill(_causal(t), NEG_INF))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (x * 1e20).to(torch.bfloat16)
        return F.scaled_dot_product_attention(q, q, x.to(q.dtype), attn_mask=self.causal.to(q.dtype))


def test_sdpa_whose_scaled_scores_overflow_behind_a_mask_is_the_origin() -> None:
    # GIVEN bfloat16 queries and keys of 1e20: q.k / sqrt(8) = 2.8e40 overflows the kernel's scores
    m = nn.Sequential(HugeSDPA(), nn.Linear(8, 2))
    # WHEN the step runs under bfloat16 autocast
    t, out = _traced(m, torch.ones(2, 1, 4, 8), torch.bfloat16)  # (batch, heads, tokens, features)
    assert torch.isnan(out).all()
    # THEN the attention kernel is named: its inputs held the mask's -inf, no NaN
    assert where(t.first) == (Phase.FORWARD, "0", "aten::_scaled_dot_product_flash_attention_for_cpu", 0, "nan")


# ---------------------------------------------------------------- masked_fill then softmax of an overflowing matmul


class MaskedFillSoftmax(nn.Module):
    def __init__(self, t: int = 4, d: int = 8) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("causal", _causal(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return scores.masked_fill(self.causal, NEG_INF).softmax(-1) @ x


@pytest.mark.parametrize(("dtype", "w"), [(torch.float16, 12.0), (torch.bfloat16, 1e18)])
def test_masked_softmax_of_an_overflowing_matmul_names_the_matmul(dtype: torch.dtype, w: float) -> None:
    # GIVEN scores q @ k^T that overflow, then masked_fill(-inf) and softmax
    seeded(0)
    m = nn.Sequential(MaskedFillSoftmax(), nn.Linear(8, 2))
    with torch.no_grad():
        for lin in (m[0].q, m[0].k):
            lin.weight.fill_(w)
            lin.bias.zero_()
    # WHEN the step runs under autocast
    t, out = _traced(m, torch.ones(2, 4, 8), dtype)
    assert torch.isnan(out).all()
    # THEN the matmul is named, neither the mask nor the softmax
    assert where(t.first) == (Phase.FORWARD, "0", "aten::bmm", 0, "inf")


# ---------------------------------------------------------------- what turns a mask's -inf into +inf is no origin


class FlipsTheMask(nn.Module):
    """Ops that legitimately make +inf of a -inf mask, each clamped back to finite afterwards."""

    def __init__(self, how: str, t: int = 4) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("mask", torch.zeros(t, t).masked_fill(_causal(t), NEG_INF))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mask
        flipped = {
            "neg": lambda: -m,
            "mul-negative": lambda: m * -2.0,
            "mul-tensor": lambda: m * (x[0] - 2.0),  # x - 2 is negative: -inf * negative
            "div-negative": lambda: m / -3.0,
            "sub": lambda: x[0] - m,
            "rsub": lambda: 1.0 - m,
            "add-alpha": lambda: torch.add(x[0], m, alpha=-1.0),
            "baddbmm-beta": lambda: torch.baddbmm(m.expand(2, -1, -1), x, x.transpose(1, 2), beta=-1.0),
            "abs": lambda: m.abs(),
            "pow": lambda: m.pow(2),
            "matmul": lambda: m @ (x[0] - 2.0),
        }[self.how]()
        return x + flipped.clamp(max=1e4).sum(-1, keepdim=True).clamp(-1e4, 1e4)


@pytest.mark.parametrize("how", ["neg", "mul-negative", "mul-tensor", "div-negative", "sub", "rsub", "add-alpha",
                                 "baddbmm-beta", "abs", "pow", "matmul"])
def test_an_op_turning_the_mask_into_plus_inf_is_no_origin(how: str) -> None:
    # GIVEN an op that makes +inf of the mask's -inf (neg, a negative factor, subtraction from it, ...)
    m = FlipsTheMask(how)
    x = torch.ones(2, 4, 4)
    with nanhunt.trace(m) as t:
        out = m(x)
    assert torch.isfinite(out).all()
    # THEN the mask's -inf explains its +inf: nothing is born
    assert t.origins == []


class LogMaskAttention(ExpSoftmaxAttention):
    """The causal mask made as log(tril(ones)): log(0) = -inf above the diagonal, itself a -inf born there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=q.dtype).tril().log()
        e = torch.exp(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1])) + mask)  # FAULT: overflows
        return self.proj(e / e.sum(-1, keepdim=True) @ v)


def test_an_earlier_origin_of_the_mask_does_not_reach_through_the_overflow() -> None:
    # GIVEN the float16 block whose causal mask is log(0) (an origin of -inf) and whose exp overflows
    m = hand_gpt(5.0)
    m.blocks[0].attn.__class__ = LogMaskAttention
    # WHEN the step runs under float16 autocast
    t, out = _traced(m, X, torch.float16)
    assert torch.isnan(out).any()
    # THEN the exp leads: the log's -inf went into the exp and came out 0 (absorbed), the NaN comes from the
    # exp's own +Inf
    assert where(t.first) == (Phase.FORWARD, "blocks.0.attn", "aten::exp", 0, "inf")
    log = t.origins[0]
    assert (log.op, log.kind, log.reached) == ("aten::log", "inf", ())


# ---------------------------------------------------------------- the rule on hand-built records


def _rec(index: int, lo: float, hi: float, op: str | None = None, inputs: tuple[int, ...] = (),
         scalar: str | None = None) -> Record:
    return Record(index=index, phase=Phase.FORWARD, module=None, call_index=0, dtype="float16", shape=(2,),
                  op=op, role=Role.OUTPUT, min=lo, max=hi, inputs=inputs, nonfinite_scalar=scalar)


FINITE, MASK, POS, NEG, PLUS_INF, NAN = (-3.0, 5.0), (-INF, 0.0), (0.0, 2.0), (-2.0, -1.0), (0.0, INF), (NAN_, NAN_)
OVERFLOW = (0.0, INF)  # the output: +Inf, no -Inf


@pytest.mark.parametrize(("op", "ins", "out", "negated", "kind"), [
    ("aten::exp", [MASK], OVERFLOW, False, "inf"),  # exp of masked logits that overflowed
    ("aten::exp_", [MASK], OVERFLOW, False, "inf"),
    ("aten::exp", [PLUS_INF], OVERFLOW, False, None),  # exp(+inf) = +inf
    ("aten::exp", [NAN], OVERFLOW, False, None),  # a NaN may hide a +inf
    ("aten::_to_copy", [MASK], (-INF, INF), False, "inf"),  # a cast of masked scores to float16
    ("aten::sum", [MASK], (-INF, INF), False, "inf"),
    ("aten::neg", [MASK], OVERFLOW, False, None),  # -(-inf) = +inf
    ("aten::abs", [MASK], OVERFLOW, False, None),
    ("aten::pow", [MASK], OVERFLOW, False, None),
    ("aten::mm", [MASK, NEG], OVERFLOW, False, None),  # -inf times a negative weight
    ("aten::rsub", [MASK], OVERFLOW, False, None),
    ("aten::add", [FINITE, MASK], (-INF, INF), False, "inf"),
    ("aten::add", [FINITE, MASK], (-INF, INF), True, None),  # x + alpha * mask, alpha < 0
    ("aten::add", [FINITE, MASK], (-INF, 4.0), False, None),  # only -inf out: the mask's
    ("aten::sub", [MASK, FINITE], (-INF, INF), False, "inf"),
    ("aten::sub", [FINITE, MASK], OVERFLOW, False, None),
    ("aten::sub", [MASK], OVERFLOW, False, None),  # one floating input: which argument it was is unknown
    ("aten::mul", [MASK, POS], (-INF, INF), True, "inf"),  # a factor holding no negative value
    ("aten::mul", [MASK, NEG], OVERFLOW, True, None),
    ("aten::mul", [MASK, MASK], OVERFLOW, True, None),  # mask * mask
    ("aten::mul", [MASK], (-INF, INF), False, "inf"),  # by a Python number >= 0
    ("aten::mul", [MASK], OVERFLOW, True, None),  # by a negative one, or by a tensor that is not floating
    ("aten::div", [MASK, POS], OVERFLOW, True, None),  # POS holds 0: -inf / -0.0 = +inf
    ("aten::div", [MASK, (1.0, 2.0)], (-INF, INF), True, "inf"),
    ("aten::div", [FINITE, MASK], OVERFLOW, True, "inf"),  # x / -inf = 0
    ("aten::div", [MASK], OVERFLOW, True, None),
    ("aten::baddbmm", [MASK, FINITE, FINITE], (-INF, INF), False, "inf"),
    ("aten::baddbmm", [MASK, FINITE, FINITE], (-INF, INF), True, None),  # beta < 0
    ("aten::baddbmm", [FINITE, MASK, FINITE], (-INF, INF), False, None),  # a -inf among the matmul's operands
    ("aten::_scaled_dot_product_flash_attention_for_cpu", [FINITE, FINITE, FINITE, MASK], OVERFLOW, False, "inf"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", [MASK, FINITE, FINITE], OVERFLOW, False, None),
])
def test_which_inputs_explain_a_plus_inf(op: str, ins: list[tuple[float, float]], out: tuple[float, float],
                                         negated: bool, kind: str | None) -> None:
    records = [_rec(i, lo, hi) for i, (lo, hi) in enumerate(ins)]
    made = _rec(len(ins), *out, op=op, inputs=tuple(range(len(ins))))
    assert origin_kind(made, [*records, made], negated=negated) == kind


def test_a_non_finite_scalar_explains_any_infinity() -> None:
    made = _rec(1, *OVERFLOW, op="aten::exp", inputs=(0,), scalar="inf")
    assert origin_kind(made, [_rec(0, *MASK), made]) is None


@pytest.mark.parametrize(("op", "args", "kwargs", "negative"), [
    ("aten::add", (), {}, False), ("aten::add", (), {"alpha": 2}, False), ("aten::add", (), {"alpha": -1}, True),
    ("aten::add_", (), {"alpha": -0.5}, True), ("aten::baddbmm", (), {"beta": 0.0}, False),
    ("aten::addmm", (), {"beta": -1}, True), ("aten::mul", (None, 0.125), {}, False),
    ("aten::mul", (None, -2), {}, True), ("aten::div", (None, math.nan), {}, True),
    ("aten::mul", (None, torch.ones(1)), {}, True),  # a tensor: its record tells, when it is floating
])
def test_a_factor_is_negative_unless_it_is_a_number_at_least_0(op: str, args: tuple[object, ...],
                                                                kwargs: dict[str, object], negative: bool) -> None:
    assert factor_negative(op, args, kwargs) is negative
