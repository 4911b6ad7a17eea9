"""The origin rule: the first op that makes a non-finite value from finite inputs, on tiny known models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import FcHead as MLP, where


# ---------------------------------------------------------------- shared weights under autocast


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


@pytest.mark.parametrize("level", ["op", "module"])
def test_tied_embedding_lm_head_fp16_overflow_is_in_the_head(level: str) -> None:
    # GIVEN embedding and lm head sharing one weight (30 everywhere); body output 8*30*30 = 7200 is fine in
    # float16, the head's logits 8*7200*30 = 1.7e6 are not
    m = TiedLM()
    with torch.no_grad():
        m.emb.weight.fill_(30.0)
        m.body.weight.fill_(30.0)
        m.body.bias.zero_()
    ids = torch.tensor([[1, 2, 3]])
    with nanhunt.trace(m, level=level) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = m(ids)
        F.cross_entropy(logits.float().view(-1, 10), torch.tensor([1, 2, 3])).backward()
    assert logits.dtype == torch.float16 and torch.isinf(logits).all()
    # THEN the head's matmul (no bias: mm) owns the Inf, not the embedding that owns the weight
    assert where(t.first) == (Phase.FORWARD, "head", "aten::mm" if level == "op" else None, 0, "inf")


# ---------------------------------------------------------------- gradient accumulation / clipping / scaling


def test_second_micro_batch_overflows_the_accumulated_grad() -> None:
    # GIVEN two micro-batches whose head gradients are each 3e38 (finite): their sum is not
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc.weight.copy_(torch.eye(4))
        m.fc.bias.zero_()
        m.head.weight.fill_(1e-10)
        m.head.bias.zero_()
    x = torch.ones(1, 4)  # head's input is exactly 1: d loss / d head.weight = 3e38 per micro-batch
    with nanhunt.trace(m) as t:
        for _ in range(2):
            loss = (m(x) * 3e38).sum()
            assert torch.isfinite(loss)
            loss.backward()
    assert torch.isinf(m.head.weight.grad).all() and torch.isfinite(m.fc.weight.grad).all()
    # THEN the Inf is born in backward, in AccumulateGrad's in-place add for head's parameters
    assert where(t.first) == (Phase.BACKWARD, "head", "aten::add_", 0, "inf")


def test_clip_grad_norm_norm_overflow_is_a_silent_update_finding() -> None:
    # GIVEN finite gradients of 1e25 whose squared norm overflows float32: clip_grad_norm_ gets an
    # Inf total norm and zeroes every gradient (clip coefficient max_norm / inf = 0)
    m = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    with nanhunt.trace(m) as t:
        (m(torch.ones(1, 2)) * 1e25).sum().backward()
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
    assert math.isinf(total) and torch.equal(m.weight.grad, torch.zeros(1, 2))
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.call_index, occ.kind) == (Phase.UPDATE, None, 0, "inf")
    assert occ.op == "aten::_foreach_norm"  # foreach=True: the fused norm, whatever the default
    assert all(r.finite for r in occ.inputs)
    assert "gradients" not in (occ.reached or ())  # absorbed: the gradients end finite


def test_grad_scaler_scale_overflows_a_finite_loss() -> None:
    # GIVEN a finite loss of 1.6e37: scaler.scale multiplies it by 65536
    m = nn.Linear(4, 1)
    with torch.no_grad():
        m.weight.fill_(1e18)
        m.bias.zero_()
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.trace(m) as t:
        loss = m(torch.ones(2, 4)).pow(2).mean()
        scaler.scale(loss).backward()
    assert torch.isfinite(loss)
    assert where(t.first) == (Phase.LOSS, None, "aten::mul", 0, "inf")


# ---------------------------------------------------------------- backward attribution


class PairDist(nn.Module):
    """Pairwise Euclidean distances (metric learning): sqrt(0) on the diagonal has an Inf gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return ((h[:, None] - h[None]) ** 2).sum(-1).sqrt()


def test_pairwise_distance_diagonal_backward_op_level() -> None:
    torch.manual_seed(0)
    m = PairDist()
    with nanhunt.trace(m) as t:
        d = m(torch.randn(3, 4))
        d.sum().backward()
    assert torch.isfinite(d).all() and torch.isnan(m.fc.weight.grad).any()
    # THEN the root's own sqrt backward divides by zero
    assert where(t.first) == (Phase.BACKWARD, "", "aten::div", 0, "inf")


# ---------------------------------------------------------------- -inf entering the step


def _inf_weight() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        m[2].weight[0, 1] = -math.inf  # a trainable weight that overflowed to -inf in an earlier update
    return m, None


def _inf_stale_grad() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    g = torch.zeros_like(m[2].weight)
    g[0, 1] = -math.inf  # forgot zero_grad after a step that overflowed
    m[2].weight.grad = g
    return m, None


def _inf_momentum() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.state[m[2].weight]["momentum_buffer"][0, 1] = -math.inf
    return m, opt


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (_inf_weight, (Phase.WEIGHTS, "2", None, 0, "inf")),
        (_inf_stale_grad, (Phase.BACKWARD, "2", None, 0, "inf")),
        (_inf_momentum, (Phase.UPDATE, None, None, 0, "inf")),
    ],
    ids=["weight", "stale-grad", "momentum-buffer"],
)
def test_minus_inf_entering_as_weight_grad_or_optimizer_state_is_an_origin(make, want) -> None:  # type: ignore[no-untyped-def]
    m, opt = make()
    with nanhunt.trace(m) as t:
        loss = m(torch.rand(2, 4) + 1.0).mean()
        loss.backward()
        if opt is not None:
            opt.step()
    bad = [not torch.isfinite(loss), not torch.isfinite(m[2].weight.grad).all(), not torch.isfinite(m[2].weight).all()]
    assert any(bad)  # the step really went non-finite somewhere
    assert where(t.first) == want


def test_negative_overflow_turned_into_nan_op_level_names_the_overflow_module_level_the_nan() -> None:
    # GIVEN a Linear whose float16 output overflows to -inf only (no NaN, no +inf); the next Linear's
    # mixed-sign weights turn -inf + inf into NaN
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        m[0].weight.fill_(-3e4)
        m[0].bias.zero_()
        m[1].weight.copy_(torch.tensor([[1.0, -1.0, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0]]))
    found = {}
    for level in ("op", "module"):
        with nanhunt.trace(m, level=level) as t:
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(torch.full((2, 4), 2.0))
            out.float().sum().backward()
        assert torch.isnan(out).all()
        found[level] = where(t.first)
        m.zero_grad()
    # THEN the op level sees the overflow (addmm, no -inf scalar anywhere); the module level cannot tell
    # a -inf-only output from a mask returned on purpose, so it names the module that made NaN of it
    assert found["op"] == (Phase.FORWARD, "0", "aten::addmm", 0, "inf")
    assert found["module"] == (Phase.FORWARD, "1", None, 0, "nan")

D = 8


# ---------------------------------------------------------------- batch norm running stats


def test_batchnorm_running_var_overflow_is_found() -> None:
    m = nn.Sequential(nn.BatchNorm1d(4))
    x = torch.tensor([[1e20] * 4, [-1e20] * 4])  # variance 1e40 > float32 max
    with nanhunt.trace(m) as t:
        out = m(x)
    assert torch.isfinite(out).all() and torch.isinf(m[0].running_var).all()
    # The step turned a buffer Inf: the op that did it is an origin (silent for this step's loss).
    assert where(t.first) == (Phase.FORWARD, "0", "aten::native_batch_norm", 0, "inf")


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
