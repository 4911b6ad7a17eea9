"""Bisection verdicts and culprit sets on models whose truth is known (each expected verdict computed by hand)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase
from tests._support.bisection import LOSS, step_finite, verdict_of

D = 8


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


# ====================================================================== two modules needed together


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
    v = verdict_of(rep)
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
    v = verdict_of(nanhunt.replay(m, (x, y), loss_fn=loss_fn, bisect=True))
    assert (v.kind, v.culprits, v.confirmed) == ("precision", ("1", LOSS), True)


# ====================================================================== fails in float32 too


@pytest.mark.parametrize("loss_fn, op", [
    (lambda o, y: torch.log(o - 5.0).mean(), "aten::log"),              # log of a negative
    (lambda o, y: (o * 0).sum() / (o * 0).sum(), "aten::div"),          # 0 / 0
], ids=["log-negative", "zero-over-zero"])
def test_nan_in_the_loss_also_in_float32_is_not_precision(loss_fn: Callable[..., torch.Tensor], op: str) -> None:
    m = nn.Sequential(Eye(), Eye())
    x, y = torch.ones(2, D), torch.zeros(2, D)
    assert not step_finite(m, x, y, loss_fn, dtype=torch.float32)
    rep = nanhunt.replay(m, (x, y), loss_fn=loss_fn, bisect=True)
    v = verdict_of(rep)
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
    v = verdict_of(rep)
    assert v.kind != "not-precision", v


# ====================================================================== scale-induced


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
    v = verdict_of(rep)
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
    # the gradients (the headline follows the first origin that reaches a sink)
    assert rep.first is not None and not rep.first.silent and rep.first.phase.value == "backward"
    assert rep.origins[0].silent and rep.origins[0].phase.value == "forward"
    v = verdict_of(rep)
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
    assert verdict_of(rep).kind != "not-reproducible", rep.verdict


# ====================================================================== where the culprit lives


def test_overflow_in_the_loss_blames_the_loss_not_the_layer_before() -> None:
    def loss_fn(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((o * 1000.0) ** 2).mean() * 1e-6  # 1e4 ** 2 overflows float16: the pow in the loss

    m = nn.Sequential(Eye(), Eye())
    x, y = torch.ones(2, D) * 10, torch.zeros(2, D)
    assert not step_finite(m, x, y, loss_fn)
    assert step_finite(m, x, y, loss_fn, fp32=[LOSS])
    rep = nanhunt.replay(m, (x, y), loss_fn=loss_fn, bisect=True)
    assert rep.first is not None and (rep.first.phase.value, rep.first.module, rep.first.op) == ("loss", None, "aten::pow")
    v = verdict_of(rep)
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
    v = verdict_of(rep)
    assert rep.first is not None and rep.first.module == "heads.b.fc"
    assert v.kind == "precision" and v.origin_alone_fixes is True
    assert v.culprits == ("heads.b.fc",), v.culprits


# ====================================================================== train= and BatchNorm


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
    v = verdict_of(rep)
    assert (v.kind, v.culprits) == ("precision", ("hot.fc",)), v


def test_bisect_ordinary_float16_overflow_answer_unchanged() -> None:
    from tests._support.models import fp16_overflow_mlp

    m = fp16_overflow_mlp()
    rep = nanhunt.replay(m, (torch.full((2, 4), 100.0), torch.zeros(2, 3)), loss_fn=F.mse_loss, bisect=True)
    v = rep.verdict
    assert v is not None and (v.kind, v.culprits, v.confirmed) == ("precision", ("fc1", "fc2"), True)


# ---------------------------------------------------------------- bisection: more float32 can make it worse


class Scores(nn.Module):
    """Attention-score style: a projection, then masked_fill with finfo(dtype).min (the Hugging Face pattern).
    In float32 the fill value is -3.4e38, which the next autocast op cannot hold in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(D))
            self.proj.bias.zero_()
        self.register_buffer("mask", torch.arange(D) < D // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.proj(x)
        return s.masked_fill(self.mask, torch.finfo(s.dtype).min)


class NonMonotone(nn.Module):
    """hot_a and hot_b overflow float16 (the real culprits). scores in float32 hands -3.4e38 to absorb, which
    overflows in float16 unless absorb is float32 too: the step is finite with {hot_a, hot_b}, not with
    {hot_a, hot_b, scores}, and again with {hot_a, hot_b, scores, absorb}."""

    def __init__(self) -> None:
        super().__init__()
        self.hot_a = nn.Linear(D, D)
        self.absorb = nn.Linear(D, D)
        self.hot_b = nn.Linear(D, D)
        self.scores = Scores()
        with torch.no_grad():
            for lin in (self.hot_a, self.hot_b):
                lin.weight.fill_(4e4)
                lin.bias.zero_()
            self.absorb.weight.copy_(torch.eye(D) * 1e-37)
            self.absorb.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hot_a(x) * (1 / (D * 4e4))
        side = self.absorb(self.scores(h))
        main = self.hot_b(h) * (1 / (D * 4e4))
        return main + side


def _small_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y) * 1e-3


def _finite_with(model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor) -> bool:
    from nanhunt.step.step import StepState, run_step

    state = StepState(model)
    try:
        with nanhunt.keep_fp32(model, names):
            loss = run_step(model, x, y, loss_fn=_small_mse, dtype=torch.float16, device_type="cpu",
                            scaler=None, optimizer=None)
        return bool(torch.isfinite(loss)) and all(
            torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    finally:
        state.reset()
        state.restore()


def test_bisect_culprit_set_is_minimal_when_more_float32_hurts() -> None:
    m = NonMonotone()
    x, y = torch.ones(2, D), torch.zeros(2, D)
    # ground truth, by direct trials
    assert not _finite_with(m, [], x, y)
    assert _finite_with(m, ["hot_a", "hot_b"], x, y)
    assert not _finite_with(m, ["hot_a", "hot_b", "scores"], x, y)
    rep = nanhunt.replay(m, (x, y), loss_fn=_small_mse, bisect=True)
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.confirmed
    # minimal: no culprit can be dropped
    for c in v.culprits:
        rest = [n for n in v.culprits if n != c]
        assert not _finite_with(m, rest, x, y), f"{v.culprits} is not minimal: {rest} is enough"


# ---------------------------------------------------------------- bisection trials ignore optimizer state


def test_update_overflow_in_optimizer_state_is_not_called_not_reproducible() -> None:
    # GIVEN gradients of 1e22 (finite in float32): Adam's exp_avg_sq = g*g overflows; the parameters stay finite
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, foreach=False)
    x = torch.full((2, 4), 1e22)
    rep = nanhunt.replay(m, (x, torch.zeros(2, 1)), loss_fn=lambda out, y: out.mean(), optimizer=opt,
                         dtype=torch.float32, bisect=True)
    # the trace finds it in both runs: it is reproducible
    assert rep.first is not None and (rep.first.phase, rep.first.op) == (Phase.UPDATE, "aten::addcmul_")
    assert rep.runs[0] is not None and rep.runs[1] is not None
    v = rep.verdict
    assert v is not None and v.kind != "not-reproducible", v
    assert v.kind == "not-precision"  # float32 throughout: no precision to blame


# ---------------------------------------------------------------- the proposed fix, measured: which origins remain


V, T = 16, 4  # vocabulary and sequence length of the Llama-style models


class RMSNorm(nn.Module):
    """Llama's, hand-written: in float16 ``x * x`` overflows for |x| > 256; the mean is inf, rsqrt makes it 0 and
    the output 0: absorbed (silent)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Causal self-attention; with ``cap`` its scores are soft-capped (``cap * tanh(s / cap)``, Gemma 2's):
    an overflowing ``q @ k`` becomes ``cap``, silently."""

    def __init__(self, cap: float | None = None, qk: float | None = None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.cap = cap
        if qk is not None:
            with torch.no_grad():
                self.q.weight.fill_(qk)
                self.k.weight.fill_(qk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        if self.cap is not None:
            s = self.cap * torch.tanh(s / self.cap)
        causal = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).triu(1)
        return self.o(s.masked_fill(causal, float("-inf")).softmax(-1) @ self.v(x))


class GatedMLP(nn.Module):
    def __init__(self, w: float | None = None) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.down_proj = nn.Linear(2 * D, D, bias=False)
        if w is not None:
            with torch.no_grad():
                for lin in (self.gate, self.up, self.down_proj):
                    lin.weight.fill_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        self.rms_1, self.attn, self.rms_2, self.mlp = RMSNorm(), attn, RMSNorm(), mlp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.rms_1(h))
        return h + self.mlp(self.rms_2(h))


class Llama(nn.Module):
    """Embedding (every entry ``emb``), ``blocks`` blocks, a final norm and the head."""

    def __init__(self, blocks: list[Block], emb: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        with torch.no_grad():
            self.emb.weight.fill_(emb)
        self.h = nn.ModuleList(blocks)
        self.norm = RMSNorm()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.h:
            h = block(h)
        return self.head(self.norm(h))


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(T).view(1, T)
    return ids, (ids + 1) % V


def _norm_inputs(m: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """max |x| entering each RMSNorm, by hand (forward pre-hooks)."""
    seen: dict[str, float] = {}
    hooks = [mod.register_forward_pre_hook(lambda _m, a, n=n: seen.__setitem__(n, float(a[0].abs().max())))
             for n, mod in m.named_modules() if isinstance(mod, RMSNorm)]
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    return seen


NORMS = ("h.0.rms_1", "h.0.rms_2", "h.1.rms_1", "h.1.rms_2", "norm")


def test_a_fix_for_silent_overflows_in_every_norm_names_the_class_and_leaves_no_origin() -> None:
    # GIVEN a Llama-style model in pure float16 whose residual stream holds 300 everywhere: every RMSNorm's x * x
    # (9e4 > 65504) overflows and is absorbed (rsqrt(inf) = 0): five silent origins, one per norm, a finite step
    torch.manual_seed(0)
    m = Llama([Block(Attention(), GatedMLP()) for _ in range(2)], emb=300.0).half()
    ids, y = _tokens()
    assert set(_norm_inputs(m, ids)) == set(NORMS) and min(_norm_inputs(m, ids).values()) > 256
    # WHEN it is replayed and bisected
    rep = nanhunt.replay(m, (ids, y), loss_fn=_lm_loss, dtype=torch.float32, bisect=True)
    assert [o.module for o in rep.origins] == list(NORMS) and all(o.silent for o in rep.origins)
    v = verdict_of(rep)
    # THEN the proof is the first norm, and the fix is every RMSNorm, by its class: measured with it, no origin
    # is left
    assert (v.kind, v.culprits, v.confirmed) == ("precision", ("h.0.rms_1",), True)
    assert v.fix_classes == (f"{__name__}:RMSNorm",)
    assert v.fix_regions == NORMS
    assert v.remaining == ()
    assert v.fix is not None and "nanhunt.keep_fp32_permanently(model, [RMSNorm])" in v.fix
    assert f"from {__name__} import RMSNorm" in v.fix
    # AND the fix, as written (keep_fp32 given the class), leaves no norm overflowing: by hand, every norm's
    # output is all 0 in float16 (rsqrt(inf)), and none is with it
    assert _norm_zeros(m, ids) == {n: True for n in NORMS}
    with nanhunt.keep_fp32(m, [RMSNorm]):
        assert _norm_zeros(m, ids) == {n: False for n in NORMS}


def _norm_zeros(m: nn.Module, ids: torch.Tensor) -> dict[str, bool]:
    """Whether each RMSNorm's output is all 0, by hand (forward hooks)."""
    zeros: dict[str, bool] = {}
    hooks = [mod.register_forward_hook(lambda _m, _a, o, n=n: zeros.__setitem__(n, not bool(o.any())))
             for n, mod in m.named_modules() if isinstance(mod, RMSNorm)]
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    return zeros


def test_a_fix_for_the_overflow_that_reaches_the_loss_also_covers_a_silent_one_before_it() -> None:
    # GIVEN autocast float16: block 0's soft-capped attention scores overflow (q @ k = 8 * 320 * 320) and the cap
    # absorbs it (tanh(inf) = 1), then its MLP's down_proj overflows (16 * 6400 * 10) and that reaches the loss
    torch.manual_seed(0)
    m = Llama([Block(Attention(cap=30.0, qk=40.0), GatedMLP(w=10.0))], emb=1.0)
    ids, y = _tokens()
    assert not step_finite(m, ids, y, _lm_loss)
    assert step_finite(m, ids, y, _lm_loss, fp32=["h.0.mlp.down_proj"])
    rep = nanhunt.replay(m, (ids, y), loss_fn=_lm_loss, bisect=True)
    assert rep.first is not None and (rep.first.module, rep.first.silent) == ("h.0.mlp.down_proj", False)
    # (then the final norm's inf * rsqrt(inf) = inf * 0 makes NaN of down_proj's inf)
    assert [(o.module, o.silent) for o in rep.origins][:2] == [("h.0.attn", True), ("h.0.mlp.down_proj", False)]
    v = verdict_of(rep)
    # THEN the proof is down_proj alone, and the fix covers the attention too: measured with both, nothing is left
    assert (v.kind, v.culprits, v.confirmed, v.origin_alone_fixes) == ("precision", ("h.0.mlp.down_proj",), True,
                                                                        True)
    assert (v.fix_regions, v.fix_classes, v.remaining) == (("h.0.attn", "h.0.mlp.down_proj"), (), ())
    assert v.fix is not None and "['h.0.attn', 'h.0.mlp.down_proj']" in v.fix


class SqrtGate(nn.Module):
    """``sqrt(x - 2)`` is NaN where x < 2, in any precision; ``nan_to_num`` absorbs it (no gradient flows
    through it: sqrt's would be NaN): a silent origin float32 cannot remove."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x.detach() - 2.0).nan_to_num(0.0)


def test_a_fix_that_cannot_remove_every_origin_says_which_remain() -> None:
    from tests._support.golden import render

    # GIVEN down_proj's overflow reaching the loss (as above, no soft-capped attention) and, before it, a NaN
    # that float32 does not prevent, absorbed
    torch.manual_seed(0)
    m = Llama([Block(Attention(), GatedMLP(w=10.0))], emb=1.0)
    m.h[0].rms_2 = nn.Sequential(SqrtGate(), RMSNorm())
    ids, y = _tokens()
    assert step_finite(m, ids, y, _lm_loss, fp32=["h.0.mlp.down_proj"])
    rep = nanhunt.replay(m, (ids, y), loss_fn=_lm_loss, bisect=True)
    assert [(o.module, o.op, o.silent) for o in rep.origins][:2] == [
        ("h.0.rms_2.0", "aten::sqrt", True), ("h.0.mlp.down_proj", "aten::mm", False)]
    v = verdict_of(rep)
    # THEN the fix is down_proj (the sqrt's module in float32 changed nothing), and the verdict says the sqrt's
    # NaN remains with it
    assert (v.kind, v.culprits, v.fix_regions) == ("precision", ("h.0.mlp.down_proj",), ("h.0.mlp.down_proj",))
    assert v.remaining is not None and [(o.module, o.op, o.kind) for o in v.remaining] == [
        ("h.0.rms_2.0", "aten::sqrt", "nan")]
    assert ("The suggested fix (`h.0.mlp.down_proj` in float32), measured in a traced replay: 1 origin(s) left: NaN "
            "in phase forward, `h.0.rms_2.0` at `aten::sqrt` (silent).") in render("md", rep)


def test_keep_fp32_given_a_class_wraps_each_of_its_modules_once_and_restores_them() -> None:
    m = Llama([Block(Attention(), GatedMLP()) for _ in range(2)], emb=1.0)
    norms = [mod for mod in m.modules() if isinstance(mod, RMSNorm)]
    with nanhunt.keep_fp32(m, [RMSNorm, "norm"]):  # "norm" is an RMSNorm too
        assert len(norms) == 5 and all(getattr(n.forward, "__nanhunt_fp32__", False) for n in norms)
        assert not getattr(m.head.forward, "__nanhunt_fp32__", False)
    assert all("forward" not in n.__dict__ for n in norms)
    with pytest.raises(KeyError, match="no module of the model is a Eye"):
        with nanhunt.keep_fp32(m, [Eye]):
            pass
