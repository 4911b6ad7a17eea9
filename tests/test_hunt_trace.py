"""Hunting confident wrong answers of the live tracer on realistic training-step shapes.

Each test plants one fault whose birth place is known by construction (checked by hand in
the test where it is not obvious) and asserts ``(phase, module, op, call_index, kind)`` of
``t.first`` as DESIGN.md defines it. Tests marked ``xfail(strict=True)`` are bugs found by
this hunt: nanhunt answers something else (or nothing) there.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanhunt
from nanhunt import Phase
from models import FcHead as MLP
from models import FcThenNorm, where


# ---------------------------------------------------------------- masks next to real faults


class CausalBlock(nn.Module):
    """Single-head causal attention with a -inf mask buffer, then an MLP."""

    def __init__(self, d: int = 8, s: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 16), nn.Linear(16, d)
        self.register_buffer("causal", torch.full((s, s), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8**0.5 + self.causal
        x = x + scores.softmax(-1) @ self.v(x)
        return x + self.fc2(F.relu(self.fc1(x)))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CausalBlock(), CausalBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("level", ["op", "module"])
def test_causal_mask_is_never_blamed_for_a_real_fp16_overflow(level: str) -> None:
    # GIVEN a 2-block causal model (-inf mask buffers) whose second MLP overflows float16 under autocast
    torch.manual_seed(0)
    m = TinyGPT()
    with torch.no_grad():
        m.blocks[1].fc2.weight.mul_(1e4)
    x = torch.randn(2, 4, 8) * 10
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float32, enabled=False):
        assert torch.isfinite(m(x)).all()  # the float32 reference is finite: a precision fault
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.trace(m, level=level) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        scaler.scale(out.float().pow(2).mean()).backward()
    assert torch.isinf(out).any()
    # THEN the overflowing projection is named, never the masks
    op = "aten::addmm" if level == "op" else None
    assert where(t.first) == (Phase.FORWARD, "blocks.1.fc2", op, 0, "inf")
    assert not any(o.module is not None and o.module.startswith("blocks.0") for o in t.origins)


class RowMaskedLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~allowed, float("-inf"))


def test_log_softmax_of_a_fully_masked_row_is_born_in_the_loss() -> None:
    # GIVEN action masking (RL style) where sample 1 has no allowed action: its logits row is all -inf
    torch.manual_seed(0)
    m = RowMaskedLogits()
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    with nanhunt.trace(m) as t:
        loss = F.cross_entropy(m(torch.randn(3, 8), allowed), torch.tensor([0, 1, 3]))
        loss.backward()
    assert torch.isnan(loss)
    # THEN masked_fill(-inf) is no origin; log_softmax of the -inf row (-inf - -inf) is, in the loss
    assert where(t.first) == (Phase.LOSS, None, "aten::_log_softmax", 0, "nan")


def test_cross_entropy_with_every_target_ignored_is_nan_in_the_loss() -> None:
    # GIVEN a batch made only of padding tokens (ignore_index): mean over zero elements is 0/0
    torch.manual_seed(0)
    m = nn.Linear(4, 5)
    with nanhunt.trace(m) as t:
        loss = F.cross_entropy(m(torch.randn(3, 4)), torch.full((3,), -100))
        loss.backward()
    assert torch.isnan(loss)
    assert where(t.first) == (Phase.LOSS, None, "aten::nll_loss_forward", 0, "nan")


def test_multihead_attention_eval_fast_path_all_padded_sequence() -> None:
    # GIVEN nn.MultiheadAttention in eval under no_grad (the fused native fast path) and a batch
    # element whose keys are all padding
    torch.manual_seed(0)

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    m = Enc().eval()
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1] = True
    with torch.no_grad(), nanhunt.trace(m) as t:
        out = m(torch.randn(2, 4, 8), pad)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    # THEN the one fused op that made the NaN is named, in the attention module
    assert where(t.first) == (Phase.FORWARD, "attn", "aten::_native_multi_head_attention", 0, "nan")


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
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    assert math.isinf(total) and torch.equal(m.weight.grad, torch.zeros(1, 2))
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.call_index, occ.kind) == (Phase.UPDATE, None, 0, "inf")
    assert occ.op in ("aten::_foreach_norm", "aten::linalg_vector_norm")
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


class SharedCheckpointed(FcThenNorm):
    """``norm`` called twice, each call under torch.utils.checkpoint; only call 0 sees exact zeros."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a = checkpoint(self.norm, h, use_reentrant=self.reentrant)  # call 0: column 0 exactly zero
        b = checkpoint(self.norm, h.abs() + 1.0, use_reentrant=self.reentrant)  # call 1: no zeros
        return a + b


@pytest.mark.parametrize(
    "reentrant",
    [
        False,
        True,
    ],
    ids=["non-reentrant", "reentrant"],
)
def test_checkpointed_module_called_twice_backward_names_the_right_call(reentrant: bool) -> None:
    torch.manual_seed(0)
    m = SharedCheckpointed(reentrant)
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    # the truth, by hand: only call 0's input has zeros, so only its sqrt backward divides by zero
    assert torch.isinf(torch.ones(2) / (2 * torch.sqrt(torch.zeros(2)))).all()
    assert where(t.first) == (Phase.BACKWARD, "norm", "aten::div", 0, "inf")


def test_module_level_backward_of_the_second_call() -> None:
    # GIVEN norm called twice, only call 1 sees exact zeros WHEN traced at module level
    torch.manual_seed(0)

    class Twice(FcThenNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return self.norm(h.abs() + 1.0) + self.norm(h)

    m = Twice()
    with nanhunt.trace(m, level="module") as t:
        m(torch.randn(2, 4)).sum().backward()
    # THEN the first non-finite gradient (NaN: Inf * 0 in x*x's backward) is norm call 1's
    assert where(t.first) == (Phase.BACKWARD, "norm", None, 1, "nan")


# ---------------------------------------------------------------- bugs: -inf entering the step


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


# ---------------------------------------------------------------- bugs: phase after a backward


def test_second_loss_after_a_first_backward_is_phase_loss() -> None:
    # GIVEN a multi-task step with one backward per loss; the second loss takes log(0)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    with nanhunt.trace(m) as t:
        p = m(torch.randn(2, 4))
        p.pow(2).mean().backward(retain_graph=True)
        loss2 = -torch.log(p * torch.tensor([1.0, 0.0, 1.0])).sum()
        loss2.backward()
    assert math.isinf(loss2.item())
    # THEN no optimizer ran: the -inf of log(0) is born in the loss
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


def test_preprocessing_of_second_micro_batch_is_phase_forward() -> None:
    # GIVEN gradient accumulation with per-micro-batch standardisation; micro-batch 2 is constant: 0/0
    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as t:
        for x in (torch.randn(2, 4), torch.zeros(2, 4)):
            x = (x - x.mean()) / x.std()
            (m(x).sum() / 2).backward()
    # THEN it is glue before the model (as for the first micro-batch): forward, no module
    assert where(t.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")


def test_optimizer_step_fused_into_backward_is_phase_update() -> None:
    torch.manual_seed(0)
    m = MLP()
    opts = {p: torch.optim.SGD([p], lr=1e38, foreach=False) for p in m.parameters()}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in m.parameters()]
    try:
        with nanhunt.trace(m) as t:
            (m(torch.ones(2, 4)).sum() * 1e5).backward()
    finally:
        for h in handles:
            h.remove()
    assert not torch.isfinite(m.head.weight).all()
    occ = t.first
    # THEN SGD's `param.add_(grad, alpha=-lr)` overflows: an update (first param updated: head's)
    assert occ is not None
    assert (occ.phase, occ.op, occ.call_index, occ.kind) == (Phase.UPDATE, "aten::add_", 0, "inf")
    assert occ.module in (None, "head")


def test_trace_of_the_optimizer_step_alone_is_phase_update() -> None:
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e38, foreach=False)
    (m(torch.ones(2, 4)).sum() * 1e5).backward()
    with nanhunt.trace(m) as t:
        opt.step()
    assert not torch.isfinite(m.head.weight).all()
    assert where(t.first) == (Phase.UPDATE, None, "aten::add_", 0, "inf")


# ---------------------------------------------------------------- bugs: module level


class ReturnsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())  # the root's output *is* fc2's output


class ReturnsOwn(ReturnsChild):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu()) * 1.0  # the root's own tensor


@pytest.mark.parametrize(
    "cls",
    [
        ReturnsOwn,
        ReturnsChild,
    ],
    ids=["root-makes-its-output", "root-returns-child-output"],
)
def test_module_level_nan_from_the_loss_backward_is_phase_loss(cls: type[nn.Module]) -> None:
    # GIVEN a soft-label loss with 0 * log(0) (NaN in the loss, NaN gradient w.r.t. the model output)
    torch.manual_seed(0)
    m = cls()
    y = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    with nanhunt.trace(m, level="module") as t:
        p = m(torch.randn(2, 4)).softmax(-1)
        loss = -(y * (p * y).log()).sum()
        loss.backward()
    assert torch.isnan(loss)
    # THEN module level (no ops) sees it first as the gradient w.r.t. the model output: the loss's backward
    assert where(t.first) == (Phase.LOSS, None, None, 0, "nan")


@pytest.mark.parametrize(
    ("case", "want_module"),
    [
        ("child-consumes", "norm"),
        ("parent-glue", ""),
        ("user-full-backward-hooks", "norm"),
    ],
)
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the input needs no gradient
def test_module_level_backward_names_the_module_whose_backward_made_it(case: str, want_module: str) -> None:
    torch.manual_seed(0)
    if case == "parent-glue":
        m: nn.Module = PairDist()  # the sqrt is the root's own code, after fc
    else:
        m = FcThenNorm()
    handles = ([mod.register_full_backward_hook(lambda *a: None) for mod in m.modules()]
               if case == "user-full-backward-hooks" else [])
    try:
        with nanhunt.trace(m, level="module") as t:
            m(torch.randn(3, 4)).sum().backward()
    finally:
        for h in handles:
            h.remove()
    # the sqrt(0) backward's Inf times the zero difference (x*x / (h_i - h_j)^2 backward) is a NaN
    # gradient w.r.t. fc's output, made by the backward of the code that consumed it
    assert where(t.first) == (Phase.BACKWARD, want_module, None, 0, "nan")


class MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.register_buffer("banned", torch.tensor([False, False, True, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(self.banned, float("-inf"))  # invalid actions, on purpose


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = MaskedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize(
    "level",
    [
        "op",
        "module",
    ],
)
def test_action_masked_logits_with_finite_loss_are_clean(level: str) -> None:
    torch.manual_seed(0)
    m = Policy()
    with nanhunt.trace(m, level=level) as t:
        loss = F.cross_entropy(m(torch.randn(3, 8)), torch.tensor([0, 1, 3]))
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert t.first is None


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


def test_module_level_minus_inf_output_is_the_origin_when_nothing_else_explains_the_nan() -> None:
    # GIVEN a module whose output is -inf only, and a root that multiplies it by 0 in its own code
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).clamp(max=0) * 0.0  # -inf * 0 = NaN, made by the root's own code

    torch.manual_seed(0)
    m = Root()
    with torch.no_grad():
        m.fc.weight.fill_(-3e4)
    with nanhunt.trace(m, level="module") as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(torch.full((2, 4), 2.0))
        out.float().sum().backward()
    assert torch.isnan(out).all()
    assert where(t.first) == (Phase.FORWARD, "fc", None, 0, "inf")


def test_preprocessing_between_two_calls_without_backward_is_forward_glue() -> None:
    # GIVEN two model calls in one step, the second micro-batch standardised between them: 0/0
    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as t:
        loss = m(torch.randn(2, 4)).sum()
        x2 = torch.zeros(2, 4)
        x2 = (x2 - x2.mean()) / x2.std()
        loss = loss + m(x2).sum()
        loss.backward()
    # THEN the NaN is born in glue that feeds the second call: forward, no module (not the first call's loss)
    assert where(t.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")
