"""scope= puts the dispatch mode on the stack only while the scope runs (its forward through
module hooks, its backward nodes through node hooks). What it records inside the scope must be
what a whole-step op trace records there; nothing may stay on the dispatch stack."""

from __future__ import annotations

from collections.abc import Callable

import tests._support.models as M
import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase, Role

# Make a model and its (non-scalar) output from a fresh copy each time.
Case = tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor], list[str]]


class Residual(nn.Module):
    """A block whose input is also changed in place inside it (the input's node is the block's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = M.SqrtNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.0)  # in place on the input: a node made inside the scope, reached through x
        return self.norm(self.fc(x)) + x


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = Residual()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        y = self.block(h)
        return self.head(y + h)  # h was changed in place by the block: its backward runs via this sum too


def _sqrt_residual() -> ResidualNet:
    M.seeded(0)
    m = ResidualNet()
    with torch.no_grad():
        m.block.fc.weight[0].zero_()
        m.block.fc.bias[0] = 0.0
    return m


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = inner
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(self.pre(x)))


def _wrapped(inner: nn.Module) -> nn.Module:
    M.seeded(0)
    return _Wrapped(inner)


def _tiny_lm() -> nn.Module:
    M.seeded(0)
    return M.TinyLM()


def _dict_logits(m: nn.Module) -> torch.Tensor:
    out = m(torch.ones(2, 4))
    assert isinstance(out, dict)
    return out["logits"]


CASES: dict[str, Case] = {
    "twice": (M.TwiceModel, lambda m: m(M.batch(2, 4)), ["scale", "fc"]),
    "sqrt-backward": (M.sqrt_model, lambda m: m(M.batch(2, 4)), ["norm", "fc"]),
    "attention": (M.attn_model, lambda m: m(M.batch(2, 3, 8), M.causal_keep(3)), ["attn", "attn.qkv"]),
    "fully-masked-row": (M.attn_model, lambda m: m(M.batch(2, 3, 8), torch.zeros(3, 3, dtype=torch.bool)), ["attn"]),
    "checkpoint": (lambda: M.Blocks(M.sqrt_model(), 4), lambda m: m(M.batch(2, 4)), ["inner", "head"]),
    "checkpoint-reentrant": (lambda: M.Blocks(M.sqrt_model(), 4, reentrant=True), lambda m: m(M.batch(2, 4).requires_grad_()),
                             ["inner", "inner.norm"]),
    "inplace-input": (_sqrt_residual, lambda m: m(M.batch(2, 4)), ["block", "block.norm", "pre"]),
    "dict-output": (lambda: M.big_body(M.DictOut()), _dict_logits, ["act", ""]),
    "custom-function": (lambda: _wrapped(M.BadGradModule()), lambda m: m(M.batch(2, 4)), ["inner"]),
    "inplace-view-write": (lambda: _wrapped(M.InplaceViewWrite()), lambda m: m(M.batch(2, 4)), ["inner"]),
    "transformer-encoder": (_tiny_lm, lambda m: m(torch.randint(0, 11, (2, 5))), ["enc.layers.1", "enc.layers.0.self_attn"]),
    "tied-weights": (lambda: _seeded(M.Tied), lambda m: m(M.batch(2, 4)), ["dec", "enc"]),
    "called-twice-backward": (M.twice_sqrt, lambda m: m(M.batch(2, 4)), ["norm"]),
    "batchnorm": (lambda: _seeded(M.BNModel), lambda m: m(M.batch(3, 4)), ["bn"]),
    "multihead-attention": (lambda: _seeded(M.MHAModel, True), lambda m: m(M.batch(2, 3, 8), M.causal_keep(3)), ["attn"]),
    "autocast-bf16": (lambda: _wrapped(nn.Sequential(nn.Linear(4, 4), nn.GELU())),
                      lambda m: _autocast(m, M.batch(2, 4)), ["inner", "inner.1"]),
}


def _seeded(cls: Callable[..., nn.Module], *args: object) -> nn.Module:
    M.seeded(0)
    return cls(*args)


def _autocast(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return m(x).float()


def _in(name: str | None, scope: str) -> bool:
    return name is not None and (scope == "" or name == scope or name.startswith(scope + "."))


def _op_rows(t: nanhunt.Trace, scope: str) -> list[tuple[str, str | None, int, str | None, bool]]:
    """The scope's op outputs, in order: what both traces must agree on."""
    return [(r.phase.value, r.module, r.call_index, r.op, r.finite) for r in t.records
            if r.role is Role.OUTPUT and r.op is not None and _in(r.module, scope) and r.phase is not Phase.UPDATE]


def _whole_and_scoped(make: Callable[[], nn.Module], step: Callable[[nn.Module], object],
                      scope: str) -> tuple[nanhunt.Trace, nanhunt.Trace]:
    """The same step on two fresh models: traced whole, then with ``scope=[scope]``."""
    traces = []
    for scopes in ((), (scope,)):
        m = make()
        with nanhunt.trace(m, scope=scopes) as t:
            step(m)
        traces.append(t)
    return traces[0], traces[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_scoped_records_match_the_whole_step_trace(case: str) -> None:
    make, run, scopes = CASES[case]
    m = make()
    with nanhunt.trace(m) as whole:
        run(m).sum().backward()
    for scope in scopes:
        m = make()
        with nanhunt.trace(m, scope=[scope]) as part:
            run(m).sum().backward()
        rows = _op_rows(part, scope)
        assert rows, f"{case}: scope {scope!r} recorded no op"
        assert rows == _op_rows(whole, scope), f"{case}: scope {scope!r}"
        assert torch._C._len_torch_dispatch_stack() == 0
        first = whole.first
        if first is not None and _in(first.module, scope) and first.op is not None:
            assert part.first is not None
            got = (part.first.phase, part.first.module, part.first.op, part.first.call_index, part.first.kind)
            assert got == (first.phase, first.module, first.op, first.call_index, first.kind)


def test_scoped_backward_fault_in_a_checkpointed_block() -> None:
    # GIVEN sqrt(0) inside a block run through reentrant checkpointing (its backward recomputes it)
    m = M.Blocks(M.sqrt_model(), 4, reentrant=True)
    # WHEN only the block is traced at op level
    with nanhunt.trace(m, scope=["inner"]) as t:
        m(M.batch(2, 4).requires_grad_()).sum().backward()
    # THEN the backward Inf is named in the block's sqrt module, phase backward
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.BACKWARD, "inner.norm", "aten::div", "inf")


def test_scope_sees_its_second_call_and_no_op_outside() -> None:
    m = M.TwiceModel()
    with nanhunt.trace(m, scope=["scale"]) as t:
        m(M.batch(2, 4)).sum().backward()
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.call_index, occ.kind) == (Phase.FORWARD, "scale", "aten::mul", 1, "inf")
    assert {r.module for r in t.records} == {"scale"}
    # backward ops of both calls were seen (the gradient of x * 1e25 is recorded per call)
    assert {(r.call_index) for r in t.records if r.phase is Phase.BACKWARD and r.op is not None} == {0, 1}


def test_exception_inside_the_scope_leaves_nothing_on_the_stack() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), Boom()))
    hooks_before = sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in m.modules())
    with pytest.raises(RuntimeError, match="boom"):
        with nanhunt.trace(m, scope=["1"]):
            m(torch.randn(2, 4))
    assert torch._C._len_torch_dispatch_stack() == 0
    assert sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in m.modules()) == hooks_before
    # and ops afterwards run untraced, normally
    assert torch.isfinite(m[0](torch.randn(2, 4))).all()


def test_node_hooks_are_removed_and_a_later_backward_is_untraced() -> None:
    m = M.sqrt_model()
    with nanhunt.trace(m, scope=["norm"]) as t:
        out = m(M.batch(2, 4))
    n = len(t.records)
    grad_fn = out.grad_fn
    assert grad_fn is not None
    assert not grad_fn._forward_pre_hooks if hasattr(grad_fn, "_forward_pre_hooks") else True
    out.sum().backward()  # after the block: must run plainly, and record nothing
    assert len(t.records) == n
    assert torch._C._len_torch_dispatch_stack() == 0


def test_scoped_gradient_penalty_double_backward() -> None:
    # GIVEN a gradient penalty through the scope (create_graph=True), then the penalty's backward
    def make() -> nn.Module:
        M.seeded(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1))

    def run(m: nn.Module) -> None:
        x = M.batch(3, 4).requires_grad_()
        (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()

    whole, part = _whole_and_scoped(make, run, "1")
    # THEN the scope's ops of both backward passes are recorded (the first pass's, then the
    # penalty's backward through the nodes the first pass made inside the scope)
    # (a node made in the first pass outside the scope is not taken for the scope's)
    rows = _op_rows(part, "1")
    assert rows == _op_rows(whole, "1")
    assert sum(r[0] == "backward" for r in rows) > 10
    assert part.first is None


def test_scope_inside_a_non_reentrant_checkpoint() -> None:
    # GIVEN a scope inside a block that non-reentrant checkpointing recomputes during backward
    # (the block's other modules are recomputed inside the scope's backward nodes)
    make, run, _ = CASES["checkpoint"]
    whole, part = _whole_and_scoped(make, lambda m: run(m).sum().backward(), "inner.norm")
    # THEN only the scope's own ops are recorded, as the whole-step trace attributes them
    assert _op_rows(part, "inner.norm") == _op_rows(whole, "inner.norm")
    assert {r.module for r in part.records} == {"inner.norm"}


class ViewScale(nn.Module):
    """Scales one column in place through a view: finite forward; its backward multiplies the
    incoming gradient by 1e20 inside the CopySlices node autograd made for the base."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.abs() * 1e-20 + 1e-20  # tiny, so that scaling it stays finite
        h[:, 0].mul_(1e20)
        return h


class BigGrad(_Wrapped):
    """Its output, times 1e20: the gradients flowing back into ``inner`` are large."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1e20


@pytest.mark.parametrize("scope", [(), ("inner",)], ids=["whole", "scoped"])
def test_backward_of_an_in_place_op_on_a_view_belongs_to_its_module(scope: tuple[str, ...]) -> None:
    # GIVEN a backward overflow born in the backward of an in-place op on a view (the nodes for
    # it are made after the op returns: CopySlices for the base, a new node for the view)
    M.seeded(0)
    m = BigGrad(ViewScale())
    with nanhunt.trace(m, scope=scope) as t:
        y = m(M.batch(2, 4))
        assert torch.isfinite(y).all()
        y.sum().backward()
    # THEN the origin is that backward, in the module that ran the op (it was "outside the model")
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.BACKWARD, "inner", "aten::mul", "inf")


def test_a_mode_left_on_a_stack_after_the_block_records_nothing() -> None:
    # GIVEN a finished scoped trace whose mode something pushed again (as a thread's stack could
    # keep it): ops run under it must run plainly and add nothing to the finished trace
    from nanhunt._util import _dispatch

    m = M.sqrt_model()
    with nanhunt.trace(m, scope=["norm"]) as t:
        m(M.batch(2, 4)).sum().backward()
    n, first = len(t.records), t.first
    mode = _dispatch.TraceMode(t._on_op)
    _dispatch.push_mode(mode)
    try:
        y = torch.exp(torch.full((2,), 1000.0))
    finally:
        assert _dispatch.pop_mode(mode)
    assert torch.isinf(y).all()
    assert len(t.records) == n and t.first == first


class Stash(nn.Module):
    """Keeps an intermediate as an attribute (an auxiliary output read by the caller later)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = M.SqrtNorm()
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.aux = self.norm(h)  # sqrt(0) at the zeroed unit: Inf in its backward
        return h.tanh()


class StashNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Stash()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.block(x))
        assert self.block.aux is not None
        return y + self.block.aux.sum()  # the stashed branch joins the loss outside the block


def _stash_net() -> StashNet:
    M.seeded(0)
    m = StashNet()
    with torch.no_grad():
        m.block.fc.weight[0].zero_()
        m.block.fc.bias[0] = 0.0
    return m


def test_scope_sees_the_backward_of_a_tensor_it_stashed() -> None:
    # GIVEN a scope that keeps an intermediate as an attribute, read later outside it
    whole, part = _whole_and_scoped(_stash_net, lambda m: m(M.batch(2, 4)).sum().backward(), "block")
    # THEN the backward of the stashed branch is recorded as the whole-step trace records it
    assert _op_rows(part, "block") == _op_rows(whole, "block")
    occ = part.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.BACKWARD, "block.norm", "aten::div", "inf")
