"""Adversarial review: cases where nanhunt's answer (phase, module, op, verdict) could be wrong.

Every test asserts what the origin rule (DESIGN.md) and the specs (issues 2 and 4)
say is right. Tests marked ``xfail(strict=True)`` are bugs nanhunt has today; the
others pass and guard behaviour that is already right.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase
from models import where

D = 8


@pytest.fixture
def nan_filled_uninitialised_memory() -> Iterator[None]:
    """Deterministic mode fills uninitialised memory with NaN (the project's own tests use it)."""
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill  # type: ignore[attr-defined]


# =====================================================================================
# Bugs (xfail strict)
# =====================================================================================

# ---------------------------------------------------------------- derived casts: float8


class Float8Cast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float8_e5m2)  # 1e5 > 57344 (e5m2 max): Inf born in this cast
        return y.float() * 2


def test_float8_cast_overflow_is_born_in_the_cast() -> None:
    m = Float8Cast()
    with nanhunt.trace(m) as t:
        out = m(torch.full((4,), 1e5))
    assert torch.isinf(out).all()
    assert where(t.first) == (Phase.FORWARD, "", "aten::_to_copy", 0, "inf")


class DoubleToHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half().float() * 2  # torch casts float64 -> float32 -> float16: 65519.999 -> 65520 -> inf


def test_float64_to_half_overflow_is_born_in_the_cast() -> None:
    m = DoubleToHalf()
    with nanhunt.trace(m) as t:
        out = m(torch.full((4,), 65519.999, dtype=torch.float64))
    assert torch.isinf(out).all()
    assert where(t.first) == (Phase.FORWARD, "", "aten::_to_copy", 0, "inf")


# ---------------------------------------------------------------- constants made in forward (lift_fresh)


class NanSentinelMean(nn.Module):
    """A clean, common pattern: mark entries NaN with a tensor constant, then nanmean them away."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.where(h > 0, h, torch.tensor(float("nan")))
        return torch.nanmean(h)


def test_tensor_nan_constant_then_nanmean_is_clean() -> None:
    torch.manual_seed(0)
    m = NanSentinelMean()
    with nanhunt.trace(m) as t:
        out = m(torch.randn(8, 4))
        out.backward()
    assert torch.isfinite(out) and all(torch.isfinite(p.grad).all() for p in m.parameters())
    # The same code with a Python-scalar NaN is clean (see test_python_nan_scalar_then_nanmean_is_clean).
    assert t.first is None, t.first.describe() if t.first else ""


class AssignNan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y[y > 0.5] = float("nan")  # index_put_ of a scalar: the batch holds no NaN
        return y.sum()


def test_scalar_assignment_is_not_phase_input() -> None:
    m = AssignNan()
    x = torch.ones(4, 2)
    with nanhunt.trace(m) as t:
        out = m(x)
    assert torch.isnan(out) and torch.isfinite(x).all()
    occ = t.first
    assert occ is not None
    # The NaN comes from the scalar the model's code wrote: forward, in the model, named by an op.
    assert occ.phase is Phase.FORWARD and occ.module == "" and occ.op is not None, occ.describe()


class TimesInfTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * torch.tensor(float("inf"))).sum()


def test_zero_dim_tensor_constant_is_not_phase_input() -> None:
    m = TimesInfTensor()
    with nanhunt.trace(m) as t:
        m(torch.ones(4, 2))
    occ = t.first
    assert occ is not None
    assert occ.phase is Phase.FORWARD and occ.op is not None, occ.describe()


# ---------------------------------------------------------------- phases around autograd.grad


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_loss_after_gradient_penalty_is_phase_loss() -> None:
    # GIVEN a WGAN-GP style step: autograd.grad(create_graph=True) in the training loop, then the loss
    torch.manual_seed(0)
    d = Critic()
    x = torch.randn(3, 4, requires_grad=True)
    with nanhunt.trace(d) as t:
        out = d(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        gp = ((g**2).sum(1) - 1).pow(2).mean()
        loss = gp + torch.log(out.mean() * 0)  # log(0): the loss makes -inf
        loss.backward()
    # THEN the log runs in the loss, outside the model
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


class Pow15(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(1.5)  # d/dx finite at 0; d2/dx2 = 0.75 x^-0.5 = inf at 0


class PenaltyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = Pow15()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x)


def test_double_backward_op_keeps_its_module() -> None:
    net = PenaltyNet()
    x = torch.zeros(3, requires_grad=True)
    with nanhunt.trace(net) as t:
        y = net(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        g.sum().backward()
    assert torch.isinf(x.grad).all()
    occ = t.first
    assert occ is not None and occ.phase is Phase.BACKWARD and occ.kind == "inf"
    # The node it runs was made by the backward of p's pow: the op belongs to p, not to "outside the model".
    assert occ.module == "p", occ.describe()


# ---------------------------------------------------------------- write-only destinations (out=, copy_)


class ExpIntoBuffer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.full((4,), float("-inf"))  # a running-max style initial value
        torch.exp(x, out=buf)  # exp(100) overflows float32: born here
        return buf.sum()


class CastIntoBuffer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = torch.full((2, 4), float("-inf"), dtype=torch.float16)  # a -inf-initialised fp16 cache
        cache[0].copy_(x)  # 1e5 into float16: born here
        return cache[0].float().sum()


@pytest.mark.parametrize(("block", "x", "op"), [(ExpIntoBuffer, 100.0, "aten::exp"), (CastIntoBuffer, 1e5, "aten::copy_")],
                         ids=["exp-out=", "copy_-cast"])
def test_write_only_destination_is_no_input(block: type[nn.Module], x: float, op: str) -> None:
    m = block()
    with nanhunt.trace(m) as t:
        out = m(torch.full((4,), x))
    assert torch.isinf(out)
    assert where(t.first) == (Phase.FORWARD, "", op, 0, "inf")


# ---------------------------------------------------------------- inference_mode: no version counters


class MaskThroughView(nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        s = s * 1.0
        s[:, 0].fill_(float("-inf"))  # intentional -inf mask written through a view
        return (s * 2).softmax(-1)


def test_inference_mode_mask_written_through_view_has_no_origin() -> None:
    m = MaskThroughView()
    torch.manual_seed(0)
    with torch.no_grad(), nanhunt.trace(m) as t0:
        m(torch.randn(3, 4))
    assert t0.first is None  # right under no_grad
    with torch.inference_mode(), nanhunt.trace(m) as t:
        out = m(torch.randn(3, 4))
    assert torch.isfinite(out).all()
    assert t.first is None, t.first.describe() if t.first else ""


# ---------------------------------------------------------------- batch norm running stats


def test_batchnorm_running_var_overflow_is_found() -> None:
    m = nn.Sequential(nn.BatchNorm1d(4))
    x = torch.tensor([[1e20] * 4, [-1e20] * 4])  # variance 1e40 > float32 max
    with nanhunt.trace(m) as t:
        out = m(x)
    assert torch.isfinite(out).all() and torch.isinf(m[0].running_var).all()
    # The step turned a buffer Inf: the op that did it is an origin (silent for this step's loss).
    assert where(t.first) == (Phase.FORWARD, "0", "aten::native_batch_norm", 0, "inf")


# ---------------------------------------------------------------- silent findings in backward and loss


class HookCleaned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.bias.fill_(-100.0)  # relu(h) == 0 everywhere: sqrt backward divides by 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=1.0, neginf=-1.0))  # user gradient sanitiser
        return F.relu(h).sqrt()


def test_backward_inf_absorbed_by_hook_is_silent() -> None:
    torch.manual_seed(0)
    m = HookCleaned()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    occ = t.first
    assert occ is not None and occ.phase is Phase.BACKWARD and occ.kind == "inf"
    assert occ.silent, f"reached={occ.reached} although every parameter gradient is finite"


def test_loss_inf_absorbed_inside_the_loss_is_silent() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    y = torch.tensor([[1.0, 0.0, 0.0]])
    with nanhunt.trace(m) as t:
        p = m(torch.randn(1, 4))
        weight = torch.log(p.detach() * y).clamp(min=-100.0)  # -inf clamped away, no gradient through it
        loss = -(weight * p).sum()
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(q.grad).all() for q in m.parameters())
    occ = t.first
    assert where(occ) == (Phase.LOSS, None, "aten::log", 0, "inf")
    assert occ is not None and occ.silent, f"reached={occ.reached} although the loss is finite"


# ---------------------------------------------------------------- scalar lists (foreach optimizers)


def test_foreach_adam_nan_lr_is_scalar_seeded_like_the_other_paths() -> None:
    seen: dict[str, str | None] = {}
    for label, kw in (("for-loop", {"foreach": False}), ("fused", {"fused": True}), ("foreach", {"foreach": True})):
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        opt = torch.optim.Adam(m.parameters(), lr=0.1, **kw)  # type: ignore[arg-type]
        opt.param_groups[0]["lr"] = math.nan  # Adam's constructor refuses nan; a scheduler does not
        with nanhunt.trace(m) as t:
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
        occ = t.first
        assert occ is not None and occ.phase is Phase.UPDATE
        seen[label] = occ.output.nonfinite_scalar
    # for-loop and fused say: the NaN came from a scalar (no op created it); foreach must say the same
    assert seen == {"for-loop": "nan", "fused": "nan", "foreach": "nan"}, seen


# ---------------------------------------------------------------- complex intermediates


class SpectralNormalise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        X = torch.fft.rfft(x)
        Y = X / X.abs()  # 0/0 on the empty frequency bins: NaN born here (complex)
        return torch.fft.irfft(Y, n=x.shape[-1])


def test_nan_born_in_complex_op_is_not_blamed_on_the_real_consumer() -> None:
    m = SpectralNormalise()
    with nanhunt.trace(m) as t:
        out = m(torch.ones(2, 8))
    assert torch.isnan(out).all()
    occ = t.first
    assert occ is not None and occ.kind == "nan"
    assert occ.op == "aten::div", occ.describe()


# ---------------------------------------------------------------- autocast weight cache


def test_autocast_cached_weight_is_not_phase_input() -> None:
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.fill_(1e5)  # fine in float32, Inf once cast to float16
    x = torch.ones(1, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        lin(x)  # an earlier micro-batch: autocast caches the float16 weight
        with nanhunt.trace(lin) as t:
            lin(x)
    occ = t.first
    assert occ is not None
    assert occ.phase is not Phase.INPUT, occ.describe()  # the batch is all ones


# ---------------------------------------------------------------- uninitialised memory (deterministic NaN fill)


class ComplementaryMasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out = torch.empty_like(h)
        pos = h > 0
        out[pos] = h[pos]  # index_put_ into empty: half written
        out[~pos] = 0.1 * h[~pos]  # the other half
        return out


class IndexCopyFill(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(4, 2)
        out.index_copy_(0, torch.tensor([0, 2]), x[:2])
        out.index_copy_(0, torch.tensor([1, 3]), x[2:])
        return out


class ResizeThenCopy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.new_zeros(0)
        b.resize_(4)  # grows: uninitialised memory
        b.copy_(x)
        return b.sum()


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
@pytest.mark.parametrize("block", [ComplementaryMasks, IndexCopyFill, ResizeThenCopy],
                         ids=["index_put_-masks", "index_copy_", "resize_"])
def test_filling_uninitialised_memory_without_views_is_no_origin(block: type[nn.Module]) -> None:
    torch.manual_seed(0)
    m = block()
    with nanhunt.trace(m) as t:
        out = m(torch.randn(4, 4) if block is ComplementaryMasks else torch.ones(4, 2) if block is IndexCopyFill
                else torch.ones(4))
    assert torch.isfinite(out).all()
    assert t.first is None, t.first.describe() if t.first else ""


class ReadsGarbage(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.empty(4)
        e[:2] = x[:2]  # e[2:] never written
        return e.sum()  # reads uninitialised memory


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="nanhunt bug: a read of never-written memory yields NaN yet t.first is None ('everything stayed finite')")
@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
def test_read_of_uninitialised_memory_is_reported() -> None:
    m = ReadsGarbage()
    with nanhunt.trace(m) as t:
        out = m(torch.ones(4))
    assert torch.isnan(out)
    occ = t.first
    assert occ is not None, "the output is NaN, yet no finding"
    assert occ.phase is Phase.FORWARD and occ.module == ""


# ---------------------------------------------------------------- loss computed between two model calls


def test_loss_between_two_calls_of_the_model_is_phase_loss() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))

    def nll(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -torch.log(p * y).sum()  # log(0) where y == 0

    with nanhunt.trace(m) as t:
        loss = nll(m(torch.randn(1, 4)), torch.tensor([[1.0, 0.0, 0.0]])) + nll(m(torch.randn(1, 4)), torch.ones(1, 3))
        loss.backward()
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


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
    from nanhunt.step import StepState, run_step

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


# ---------------------------------------------------------------- scalar-seeded NaN in a forward-only step


def test_scalar_seeded_nan_in_forward_only_output_is_reported() -> None:
    m = FillNan()
    with torch.no_grad(), nanhunt.trace(m) as t:
        out = m(torch.ones(3))
    assert torch.isnan(out).all()
    # t.first is None only "when everything stayed finite"; a NaN (never an intentional mask) reached the output
    assert where(t.first) == (Phase.FORWARD, "", "aten::masked_fill", 0, "nan")


# ---------------------------------------------------------------- user forward pre-hooks (old weight_norm)


def test_weight_norm_pre_hook_ops_belong_to_their_module() -> None:
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):
        wn = torch.nn.utils.weight_norm(nn.Linear(4, 4))  # recomputes .weight in a forward pre-hook
    m = nn.Sequential(nn.Linear(4, 4), wn)
    with torch.no_grad():
        wn.weight_v[0].zero_()  # g * v / ||v|| with v == 0: 0/0
        wn.weight_g[0] = 0.0
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    assert where(t.first) == (Phase.FORWARD, "1", "aten::_weight_norm_interface", 0, "nan")


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


# =====================================================================================
# Passing probes (guard behaviour that is right today)
# =====================================================================================


class PythonNanSentinel(NanSentinelMean):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.where(h > 0, h, float("nan"))
        return torch.nanmean(h)


def test_python_nan_scalar_then_nanmean_is_clean() -> None:
    torch.manual_seed(0)
    m = PythonNanSentinel()
    with nanhunt.trace(m) as t:
        m(torch.randn(8, 4)).backward()
    assert t.first is None


class FillNan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x > 0.5, float("nan"))


def test_masked_fill_nan_scalar_is_scalar_seeded_not_origin() -> None:
    m = FillNan()
    with nanhunt.trace(m) as t:
        m(torch.ones(3)).sum()  # the loss
    occ = t.first
    assert where(occ) == (Phase.FORWARD, "", "aten::masked_fill", 0, "nan")
    assert occ is not None and occ.output.nonfinite_scalar == "nan"


def test_minus_inf_tensor_constant_is_no_origin() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.masked_fill(torch.tensor([True, False, False]), torch.tensor(float("-inf"))).softmax(-1)

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(3))
    assert t.first is None


class MultiOut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, _ = x.max(dim=-1)
        s, _ = torch.sort(x, dim=-1)
        k, _ = torch.topk(x, 2)
        return v.exp() + s.sum(-1) + k.sum(-1)


def test_multi_output_ops_with_indices_then_overflow() -> None:
    m = MultiOut()
    with nanhunt.trace(m) as t:
        m(torch.full((2, 4), 100.0))
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")


@pytest.mark.filterwarnings("ignore:var_mean")
def test_var_mean_single_element_nan_is_found() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            var, mean = torch.var_mean(x, dim=-1)  # correction=1 over one element: 0/0
            return var + mean

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 1))
    assert where(t.first) == (Phase.FORWARD, "", "aten::var_mean", 0, "nan")


def test_cat_of_finite_and_overflowed_blames_the_overflow() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.exp()]).sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.full((4,), 100.0))
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")


def test_non_contiguous_view_then_overflow() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.t()[::2].exp().sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.full((4, 4), 100.0))
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")


def test_inplace_on_view_of_view_is_named() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 1
            h.view(2, 4)[1][::2].mul_(1e39)  # overflow through a view of a view
            return h.sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(8))
    assert where(t.first) == (Phase.FORWARD, "", "aten::mul_", 0, "inf")
    assert t.first is not None and "loss" not in (t.first.reached or ()) and "output" in (t.first.reached or ())


@pytest.mark.parametrize("broadcast", [False, True], ids=["same-shape", "broadcast"])
def test_copy_cast_overflow_into_fresh_buffer(broadcast: bool) -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros((3, 4) if broadcast else (4,), dtype=torch.float16)
            buf.copy_(x)  # float32 1e5 into float16
            return buf.float().sum()

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.tensor([1.0, 2.0, 1e5, 3.0]))
    assert where(t.first) == (Phase.FORWARD, "", "aten::copy_", 0, "inf")


def test_out_argument_into_fresh_buffer() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros(4)
            torch.exp(x, out=buf)
            return buf

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.full((4,), 100.0))
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 0, "inf")


def test_integer_scalar_overflow_in_half_is_an_origin() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.half() * 70000  # the int scalar itself does not fit float16

    m = M()
    with nanhunt.trace(m) as t:
        m(torch.ones(2))
    assert where(t.first) == (Phase.FORWARD, "", "aten::mul", 0, "inf")


def test_where_sqrt_classic_names_forward_sqrt() -> None:
    # where(h > 0, sqrt(h), 0): sqrt's NaN in the unselected branch flows back through sqrt's backward
    class W(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return torch.where(h > 0, h.sqrt(), torch.zeros_like(h))

    torch.manual_seed(0)
    m = W()
    with nanhunt.trace(m) as t:
        out = m(torch.randn(3, 4))
        out.sum().backward()
    assert torch.isfinite(out).all() and not torch.isfinite(m.fc.weight.grad).all()
    occ = t.first
    assert where(occ) == (Phase.FORWARD, "", "aten::sqrt", 0, "nan")
    assert occ is not None and "gradients" in (occ.reached or ())


def test_gradient_accumulation_fault_in_second_micro_batch() -> None:
    class E(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).exp()

    torch.manual_seed(0)
    m = E()
    with torch.no_grad():
        m.fc.weight.copy_(torch.eye(4))
        m.fc.bias.zero_()
    with nanhunt.trace(m) as t:
        for x in (torch.ones(2, 4), torch.full((2, 4), 100.0)):
            (m(x).sum() / 2).backward()
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 1, "inf")


def test_shared_submodule_under_two_names_uses_first_name() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = self.a
            self.c = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(x) * 1e38)

    torch.manual_seed(0)
    m = Two()
    with torch.no_grad():
        m.a.weight.fill_(1e38)
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 4)).sum().backward()
    assert where(t.first) == (Phase.FORWARD, "a", "aten::addmm", 0, "inf")


def test_grad_scaler_unscale_and_clip_first_is_the_scaled_backward() -> None:
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.fc(x))

    torch.manual_seed(0)
    m = Big()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    before = [p.detach().clone() for p in m.parameters()]
    with nanhunt.trace(m) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(torch.randn(8, 4) * 100)
        loss = out.float().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # step skipped
    occ = t.first
    assert occ is not None and occ.phase is Phase.BACKWARD and occ.kind == "inf"
    assert all(o.phase is not Phase.UPDATE for o in t.origins[:1])


@pytest.mark.parametrize("kw", [{"fused": True}, {"foreach": False}], ids=["fused", "for-loop"])
def test_adam_nan_lr_is_scalar_seeded(kw: dict[str, bool]) -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    opt = torch.optim.Adam(m.parameters(), lr=0.1, **kw)  # type: ignore[arg-type]
    opt.param_groups[0]["lr"] = math.nan
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
    occ = t.first
    assert occ is not None and (occ.phase, occ.module, occ.kind) == (Phase.UPDATE, None, "nan")
    assert occ.output.nonfinite_scalar == "nan"


def test_eval_inference_mode_clean_and_overflow() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).eval()
    with torch.inference_mode(), nanhunt.trace(m) as t:
        m(torch.randn(3, 4))
    assert t.first is None
    with torch.no_grad():
        m[3].weight.fill_(1e38)
    with torch.inference_mode(), nanhunt.trace(m) as t2:
        m(torch.full((3, 4), 10.0))
    occ = t2.first
    assert occ is not None and (occ.phase, occ.module, occ.kind) == (Phase.FORWARD, "3", "inf")


def test_custom_function_nan_only_in_backward() -> None:
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def, override]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            return g * 0 / 0

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Bad.apply(self.fc(x))

    torch.manual_seed(0)
    m = M()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    occ = t.first
    assert occ is not None and (occ.phase, occ.module, occ.op, occ.kind) == (Phase.BACKWARD, "", "aten::div", "nan")


def test_replay_restores_rebound_buffer_and_requires_grad() -> None:
    class Rebind(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("ema", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ema = 0.9 * self.ema + 0.1 * x.mean(0)  # re-binds the buffer
            self.fc.bias.requires_grad_(False)
            return self.fc(x) / self.ema

    m = Rebind()
    ema = m.ema
    nanhunt.replay(m, (torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss)
    assert m.ema is ema and torch.equal(ema, torch.ones(4))
    assert m.fc.bias.requires_grad


class HotCell(nn.Module):
    def __init__(self, hot: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.scale = 1 / (D * 4e4) if hot else 1.0
        with torch.no_grad():
            self.fc.bias.zero_()
            if hot:
                self.fc.weight.fill_(4e4)
            else:
                self.fc.weight.copy_(torch.eye(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_bisect_loss_region_is_the_culprit() -> None:
    w = torch.full((D, D), 4e4)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out @ w) * 1e-6 - y).pow(2).mean()  # the matmul in the loss overflows float16

    m = nn.Sequential(HotCell(False), HotCell(False))
    rep = nanhunt.replay(m, (torch.ones(2, D), torch.zeros(2, D)), loss_fn=loss_fn, bisect=True)
    assert rep.first is not None and (rep.first.phase, rep.first.module, rep.first.op) == (Phase.LOSS, None, "aten::mm")
    v = rep.verdict
    assert v is not None and v.kind == "precision" and v.culprits == ("<loss>",) and v.confirmed
    assert v.origin_alone_fixes is True


def test_bisect_model_returning_its_own_loss() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cells = nn.Sequential(HotCell(False), HotCell(True), HotCell(False))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.cells(x), y)

    m = WithLoss()
    rep = nanhunt.replay(m, ((torch.ones(2, D), torch.zeros(2, D)), None), bisect=True)
    v = rep.verdict
    assert rep.first is not None and rep.first.module == "cells.1.fc"
    assert v is not None and v.kind == "precision" and v.culprits == ("cells.1.fc",) and v.confirmed


class CloneOfPartlyWrittenEmpty(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.empty(4)
        e[:2] = x[:2]
        c = e.clone()  # still holds garbage in c[2:]
        c[2:] = x[2:]
        return c * 1


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
def test_clone_of_partly_written_empty_then_completed_is_clean() -> None:
    m = CloneOfPartlyWrittenEmpty()
    with nanhunt.trace(m) as t:
        out = m(torch.ones(4))
    assert torch.isfinite(out).all()
    assert t.first is None, t.first.describe() if t.first else ""
