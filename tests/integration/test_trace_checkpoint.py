"""Activation checkpointing (reentrant and not): the origin names the right call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanhunt
from nanhunt import Phase

from tests._support.models import FcThenNorm, where


pytestmark = pytest.mark.usefixtures("warm_tracer")


# ====================================================================== reentrant checkpoint call index


class TwiceInOneSegment(FcThenNorm):
    """ALBERT-style sharing: ``norm`` applied twice inside one checkpointed segment."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return checkpoint(lambda h: self.norm(self.norm(h)), h, use_reentrant=True)


def test_reentrant_checkpoint_shared_module_twice_in_one_segment() -> None:
    torch.manual_seed(0)
    m = TwiceInOneSegment()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    # by hand: norm(norm(h)); h's column 0 is 0, so call 0's output (|h|) is 0 there too. Backward runs
    # call 1's sqrt backward first: 1 / (2 * sqrt(0)) = inf (the same trace without checkpoint says call 1)
    assert where(t.first) == (Phase.BACKWARD, "norm", "aten::div", 1, "inf")


class NestedCheckpoints(FcThenNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)

        def inner(v: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.norm, v, use_reentrant=True)

        a = checkpoint(inner, h, use_reentrant=True)  # norm call 0: column 0 exactly 0
        b = checkpoint(inner, h.abs() + 1.0, use_reentrant=True)  # norm call 1: no zero
        return a + b


def test_nested_reentrant_checkpoints_name_the_right_call() -> None:
    # GIVEN norm under a reentrant checkpoint nested in another, called twice (call 0's input has a zero column):
    # the inner checkpoint's forward runs inside the outer's recomputation, its own recomputation after it
    torch.manual_seed(0)
    m = NestedCheckpoints()
    # WHEN forward and backward run traced
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    # THEN only call 0's input has zeros: only its sqrt backward divides by zero (backward runs call 1's first)
    assert where(t.first) == (Phase.BACKWARD, "norm", "aten::div", 0, "inf")


# ====================================================================== every recomputed call, nested or not


class _Block(nn.Module):
    """Elementwise after a Linear(5, 5): every record of a call has the batch's shape (2 rows: call 0, 3: call 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * 2


def _checkpointed(kind: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind == "none":
        return fn
    return lambda v: checkpoint(fn, v, use_reentrant=kind == "reentrant")


class _NestedTwice(nn.Module):
    """``block`` called on two batches, each call inside an ``outer`` checkpoint around an ``inner`` one."""

    def __init__(self, outer: str, inner: str) -> None:
        super().__init__()
        self.pre = nn.Linear(5, 5)
        self.block = _Block()
        self.outer, self.inner = outer, inner

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        run = _checkpointed(self.outer, lambda v: _checkpointed(self.inner, self.block)(v) + 1.0)
        return run(self.pre(a)).sum() + run(self.pre(b)).sum()


KINDS = ("none", "reentrant", "non-reentrant")


@pytest.mark.parametrize("outer,inner", [(o, i) for o in KINDS for i in KINDS if (o, i) != ("none", "none")])
def test_recomputed_calls_keep_their_forward_call_index(outer: str, inner: str) -> None:
    # GIVEN block (and its children) called on a 2-row batch (call 0), then on a 3-row one (call 1), each call
    # inside checkpoints nested as named: backward recomputes call 1 first, then call 0
    torch.manual_seed(0)
    m = _NestedTwice(outer, inner)
    # WHEN forward and backward run traced
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 5), torch.randn(3, 5)).backward()
    # THEN every record of block's modules, forward and backward (recomputed ops included), names the call of
    # its rows: 2 rows call 0, 3 rows call 1
    seen: dict[tuple[Phase, int], set[int]] = {}
    for r in t.records:
        if r.module is not None and r.module.startswith("block") and r.shape[:1] in ((2,), (3,)):
            seen.setdefault((r.phase, r.shape[0]), set()).add(r.call_index)
    assert seen == {(Phase.FORWARD, 2): {0}, (Phase.FORWARD, 3): {1}, (Phase.BACKWARD, 2): {0},
                    (Phase.BACKWARD, 3): {1}}


@pytest.mark.slow
def test_gpt2_gradient_checkpointing_recomputed_overflow_names_the_forward_call() -> None:
    # GIVEN a tiny GPT-2 (transformers, non-reentrant gradient checkpointing) whose block 1 c_fc weight is
    # scaled by 1e14: gelu_new's pow(x, 3) overflows float32 there (|x| ~ 1e13, cubed > 3.4e38)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable()
    model.train()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1e14)
    ids0, ids1 = torch.randint(0, 32, (1, 3)), torch.randint(0, 32, (1, 5))
    # WHEN two micro-batches (3 tokens: call 0, 5 tokens: call 1) run forward, then one backward of both losses,
    # which recomputes call 1's block first, then call 0's
    with nanhunt.trace(model) as t:
        (model(ids0, labels=ids0).loss + model(ids1, labels=ids1).loss).backward()
    # THEN the culprit is call 0's forward pow, and each recomputed pow names the call of its micro-batch
    act = "transformer.h.1.mlp.act"
    assert where(t.first) == (Phase.FORWARD, act, "aten::pow", 0, "inf")
    assert [(o.phase, o.module, o.op, o.call_index, o.output.shape) for o in t.origins] == [
        (Phase.FORWARD, act, "aten::pow", 0, (1, 3, 32)),
        (Phase.FORWARD, act, "aten::pow", 1, (1, 5, 32)),
        (Phase.BACKWARD, act, "aten::pow", 1, (1, 5, 32)),
        (Phase.BACKWARD, act, "aten::pow", 0, (1, 3, 32)),
    ]
    # and every record of block 1 made in its recomputations names its micro-batch's call (3 tokens: call 0)
    calls = {(r.shape[-2], r.call_index) for r in t.records if r.phase is Phase.BACKWARD
             and (r.module or "").startswith("transformer.h.1") and len(r.shape) == 3 and r.shape[-2] in (3, 5)}
    assert calls == {(3, 0), (5, 1)}


def test_reentrant_checkpointed_call_then_plain_call_names_the_checkpointed_one() -> None:
    class CheckpointedThenPlain(FcThenNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return checkpoint(self.norm, h, use_reentrant=True) + self.norm(h.abs() + 1.0)

    torch.manual_seed(0)
    m = CheckpointedThenPlain()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).sum().backward()
    # call 0 (checkpointed) sees the zero column; its recomputation in backward is call 0, not the last call
    assert where(t.first) == (Phase.BACKWARD, "norm", "aten::div", 0, "inf")


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
