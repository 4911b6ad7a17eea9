"""Module-level tracing names the right module, call and phase."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase

from tests._support.models import FcThenNorm, where


pytestmark = pytest.mark.usefixtures("warm_tracer")


# ====================================================================== -inf entering the step


@pytest.mark.parametrize("level", ["op", "module"])
def test_batchnorm_running_mean_corrupted_to_minus_inf_is_an_origin(level: str) -> None:
    # GIVEN fine-tuning in eval mode; an earlier overflow left running_mean[1] = -inf (a batch mean of -inf
    # folded in by the momentum update); everything else is finite
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.bn(self.fc(x)))

    torch.manual_seed(0)
    m = Net().eval()
    m.bn.running_mean[1] = -math.inf
    with nanhunt.trace(m, level=level) as t:
        loss = F.mse_loss(m(torch.randn(3, 4)), torch.zeros(3, 1))
        loss.backward()
    assert math.isinf(loss.item())
    # THEN the state that entered the step non-finite is the origin (like a weight or optimizer state)
    assert where(t.first) == (Phase.WEIGHTS, "bn", None, 0, "inf")


def test_module_level_minus_inf_weight_is_an_origin() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        m[2].weight[0, 1] = -math.inf
    with nanhunt.trace(m, level="module") as t:
        loss = m(torch.rand(2, 4) + 1.0).mean()
        loss.backward()
    assert loss.item() == -math.inf
    assert where(t.first) == (Phase.WEIGHTS, "2", None, 0, "inf")


# ====================================================================== (2)/(3)/(6)/(7) module level


class FeaturesAndLogits(FcThenNorm):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, self.norm(h)  # (features, head output): features is fc's output as is


def test_module_level_root_returning_features_and_head_output() -> None:
    # GIVEN a model returning (features, head(features)), features being fc's output as is; the loss
    # uses the head output only; the head's sqrt(x*x) backward divides by zero on fc's zero column
    torch.manual_seed(0)
    m = FeaturesAndLogits()
    with nanhunt.trace(m, level="module") as t:
        feats, out = m(torch.randn(3, 4))
        out.sum().backward()
    assert torch.isfinite(out).all() and torch.isnan(m.fc.weight.grad).any()
    # THEN the NaN gradient w.r.t. fc's output was made by norm's backward (the gradient w.r.t. the
    # model's outputs is ones: finite)
    assert where(t.first) == (Phase.BACKWARD, "norm", None, 0, "nan")


class RowMaskedLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~allowed, float("-inf"))


class MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.register_buffer("banned", torch.tensor([False, False, True, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(self.banned, float("-inf"))  # invalid actions, on purpose


class NormPolicy(FcThenNorm):
    def __init__(self) -> None:
        super().__init__()
        self.head = MaskedHead()

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("fully-masked-row-in-the-loss", (Phase.LOSS, None, None, 0, "nan")),
        ("sqrt-backward-next-to-the-mask", (Phase.BACKWARD, "norm", None, 0, "nan")),
    ],
)
def test_module_level_intentional_mask_next_to_a_real_fault(case: str, want: tuple[object, ...]) -> None:
    torch.manual_seed(0)
    allowed = torch.ones(3, 5, dtype=torch.bool)
    if case == "fully-masked-row-in-the-loss":
        m: nn.Module = RowMaskedLogits()
        allowed[1] = False  # sample 1 has no allowed action: cross_entropy's log_softmax of -inf row is NaN
    else:
        m = NormPolicy()  # columns 2 and 4 masked on purpose; fc's zero column breaks norm's backward
    with nanhunt.trace(m, level="module") as t:
        loss = F.cross_entropy(m(torch.randn(3, 4), allowed), torch.tensor([0, 1, 3]))
        loss.backward()
    assert torch.isnan(loss) if case.startswith("fully") else torch.isfinite(loss)
    # THEN the real fault is named, never the mask (op level agrees: _log_softmax in the loss / sqrt's div)
    assert where(t.first) == want


def test_module_level_root_glue_backward_when_root_returns_a_child_output() -> None:
    # GIVEN pairwise distances computed by the root's own code between fc and head; the root returns
    # head's output as is
    class GlueThenHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.head = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return self.head(((h[:, None] - h[None]) ** 2).sum(-1).sqrt())

    torch.manual_seed(0)
    m = GlueThenHead()
    with nanhunt.trace(m, level="module") as t:
        m(torch.randn(3, 4)).sum().backward()
    # THEN the sqrt(0) backward on the diagonal (root's own code) made the NaN gradient w.r.t. fc's output
    # (op level names the root's aten::div too)
    assert where(t.first) == (Phase.BACKWARD, "", None, 0, "nan")


@pytest.mark.parametrize("alias", ["view_as", "reshape", "slice"])
def test_module_level_alias_of_a_child_output_passed_on_is_that_output(alias: str) -> None:
    class AliasNorm(FcThenNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            h = h.view_as(h) if alias == "view_as" else h.reshape(h.shape) if alias == "reshape" else h[:]
            return self.norm(h)

    torch.manual_seed(0)
    m = AliasNorm()
    with nanhunt.trace(m, level="module") as t:
        m(torch.randn(3, 4)).sum().backward()
    assert where(t.first) == (Phase.BACKWARD, "norm", None, 0, "nan")


class Stage(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Linear(n, n)
        self.b = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_module_level_freed_and_reused_output_memory_is_not_that_output() -> None:
    # GIVEN a pipeline stage called for two micro-batches; after the first, its output's memory is released
    # (the Python tensor stays alive for backward) and the next micro-batch, received non-finite from the
    # previous stage, lands in the same memory
    for n in (128, 64, 256, 32, 512):
        torch.manual_seed(0)
        m = Stage(n)
        with nanhunt.trace(m, level="module") as t:
            out1 = m(torch.randn(n, n))
            ptr = out1.data_ptr()
            out1.data = torch.empty(1)
            x2 = torch.full((n, n), float("nan"))
            reused = x2.data_ptr() == ptr
            m(x2)
        if reused:
            break
    else:
        pytest.skip("the allocator did not reuse the released memory here")
    # THEN the NaN entered the stage's second call from outside: phase input, not born in `a`
    assert where(t.first) == (Phase.INPUT, None, None, 1, "nan")


# ---------------------------------------------------------------- backward attribution


class PairDist(nn.Module):
    """Pairwise Euclidean distances (metric learning): sqrt(0) on the diagonal has an Inf gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return ((h[:, None] - h[None]) ** 2).sum(-1).sqrt()


# ---------------------------------------------------------------- module level


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
