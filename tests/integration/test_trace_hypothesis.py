"""Property: a NaN or Inf injected at a random place of a random MLP / conv stack is found there.

Every injection is an *origin* by construction: it makes an Inf from values that are
all finite (exp of >= 100, a product past float32's max) or a NaN from values that
hold none (log or sqrt of a negative, 0/0), never from a non-finite Python scalar.
The layers around it are small and randomly initialised, so nothing before the
injection is non-finite; what comes after may be (an Inf turning into NaN in a
matmul), but only later in execution order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import nanhunt
from nanhunt import Phase

# name -> (op that creates the value, kind)
INJECTIONS: dict[str, tuple[str, str]] = {
    "exp": ("aten::exp", "inf"),
    "exp_": ("aten::exp_", "inf"),
    "mul": ("aten::mul", "inf"),
    "log": ("aten::log", "nan"),
    "sqrt": ("aten::sqrt", "nan"),
    "div": ("aten::div", "nan"),
}


class Inject(nn.Module):
    """Turns its input into a non-finite value at a known op; ``partial`` keeps most of ``x``."""

    def __init__(self, how: str, partial: bool, seed: int) -> None:
        super().__init__()
        self.how = how
        self.partial = partial
        self.seed = seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.abs()
        if self.how == "exp":
            bad = torch.exp(a + 100.0)  # e^100 > float32 max
        elif self.how == "exp_":
            bad = a + 100.0
            bad.exp_()
        elif self.how == "mul":
            bad = (a + 1.0) * 1e30  # finite: <= ~1e31
            bad = bad * 1e30  # >= 1e60: Inf
        elif self.how == "log":
            bad = torch.log(-1.0 - a)
        elif self.how == "sqrt":
            bad = torch.sqrt(-1.0 - a)
        elif self.how == "div":
            z = x * 0.0
            bad = z / z
        else:  # pragma: no cover
            raise AssertionError(self.how)
        if not self.partial:
            return bad
        g = torch.Generator().manual_seed(self.seed)
        mask = torch.rand(x.shape, generator=g) < 0.3
        mask.view(-1)[0] = True  # at least one element is hit
        return torch.where(mask, bad, x)


ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "silu": nn.SiLU, "none": nn.Identity}


class Stack(nn.Module):
    def __init__(self, body: nn.Sequential, conv: bool) -> None:
        super().__init__()
        self.body = body
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@dataclass(frozen=True)
class Case:
    conv: bool
    acts: tuple[str, ...]
    width: int
    inject_at: int | None  # index in body where Inject sits; None: clean model
    how: str
    partial: bool
    level: str
    backward: bool
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    conv = draw(st.booleans())
    acts = tuple(draw(st.lists(st.sampled_from(sorted(ACTS)), min_size=1, max_size=3)))
    n_layers = 2 * len(acts) + (2 if conv else 0)  # (layer, act) pairs [+ flatten, head]
    clean = draw(st.integers(0, 7)) == 0
    return Case(
        conv=conv,
        acts=acts,
        width=draw(st.integers(2, 5)),
        inject_at=None if clean else draw(st.integers(0, n_layers)),
        how=draw(st.sampled_from(sorted(INJECTIONS))),
        partial=draw(st.booleans()),
        level=draw(st.sampled_from(["op", "op", "module"])),
        backward=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case: Case) -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(case.seed)
    w = case.width
    layers: list[nn.Module] = []
    for a in case.acts:
        layers.append(nn.Conv2d(w, w, 3, padding=1) if case.conv else nn.Linear(w, w))
        layers.append(ACTS[a]())
    if case.conv:
        layers += [nn.Flatten(), nn.Linear(w * 4 * 4, 3)]
    if case.inject_at is not None:
        layers.insert(case.inject_at, Inject(case.how, case.partial, case.seed))
    x = torch.randn((2, w, 4, 4) if case.conv else (3, w), generator=torch.Generator().manual_seed(case.seed + 1))
    return Stack(nn.Sequential(*layers), case.conv), x


# derandomize: the same 25 cases on every run, so that CI meets the module-level gap below only as its xfail;
# NANHUNT_HYPOTHESIS_RANDOM=1 explores new cases
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=os.environ.get("NANHUNT_HYPOTHESIS_RANDOM") != "1")
@given(cases())
def test_injected_fault_is_found_where_it_was_injected(case: Case) -> None:
    # GIVEN a random stack with an injection (or none) at a random position
    model, x = build(case)
    # WHEN one step is traced
    with nanhunt.trace(model, level=case.level) as t:
        out = model(x)
        if case.backward:
            out.sum().backward()
    if case.inject_at is None:
        # THEN a clean model raises no alarm
        assert torch.isfinite(out).all()
        assert t.first is None, t.first.describe() if t.first else ""
        return
    # THEN the first origin is the injection module, at the injected op (op level) and kind
    op, kind = INJECTIONS[case.how]
    occ = t.first
    assert occ is not None
    expected_module = f"body.{case.inject_at}"
    assert (occ.phase, occ.module, occ.call_index) == (Phase.FORWARD, expected_module, 0), occ.describe()
    assert occ.module_class == "Inject"
    assert occ.op == (op if case.level == "op" else None)
    assert occ.kind == kind
    if case.level == "op":
        # the rule holds on the records themselves
        if kind == "nan":
            assert occ.output.has_nan and not any(r.has_nan for r in occ.inputs)
        else:
            assert occ.output.has_inf and all(r.finite for r in occ.inputs)
    # nothing before the injection was flagged
    first_pos = t.origins.index(occ)
    assert first_pos == 0


@pytest.mark.parametrize("how", sorted(INJECTIONS))
def test_each_injection_is_an_origin_on_its_own(how: str) -> None:
    # GIVEN one Inject module alone WHEN traced THEN it is named with its op: the property's oracle is sound
    m = nn.Sequential(Inject(how, partial=False, seed=0))
    with nanhunt.trace(m) as t:
        m(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    op, kind = INJECTIONS[how]
    assert t.first is not None
    assert (t.first.module, t.first.op, t.first.kind) == ("0", op, kind)


# The case the random search found, with one change: the search drew a GELU after the injection, and GELU(+inf)
# is +inf in torch's scalar kernel but NaN in its vectorised one (erf's polynomial meets inf * 0), so whether the
# Inf was absorbed, and the xfail below held, depended on the build and the CPU. ReLU(+inf) is +inf in every kernel.
SAVED_ACTIVATION = Case(conv=False, acts=("gelu", "relu", "tanh"), width=2, inject_at=3, how="exp", partial=False,
                        level="module", backward=True, seed=126)


def test_the_saved_activation_case_absorbs_the_inf_on_every_kernel() -> None:
    # GIVEN the case below: Inf from exp at body.3, then ReLU, a Linear and tanh
    model, x = build(SAVED_ACTIVATION)
    body = model.body
    h = body[:5](x)
    # THEN the Inf reaches body.5 unchanged, body.5 makes +-inf (each row's weights share a sign: no inf - inf),
    # the tanh absorbs it (a finite output), and body.5's weight gradient is 0 * inf = NaN: the mechanism the gap
    # needs, whatever the CPU's kernels (before: GELU(+inf) was NaN in the vectorised kernel, no absorption)
    assert torch.isposinf(h).all()
    out = body[6](body[5](h))
    assert torch.isinf(body[5](h)).all() and out.abs().eq(1.0).all()
    out.sum().backward()
    assert body[5].weight.grad is not None and torch.isnan(body[5].weight.grad).all()


@pytest.mark.xfail(strict=True, reason="nanhunt gap: at module level, a forward Inf that a later module absorbs "
                   "(tanh(inf) = 1) but that reaches the gradients through an activation saved for backward "
                   "(0 * inf = NaN in the next Linear's weight gradient) is taken as silent, and the backward NaN "
                   "leads; op level links the saved activation and names the exp", raises=AssertionError)
def test_a_forward_inf_reaching_the_gradients_through_a_saved_activation_leads_at_module_level() -> None:
    # GIVEN the case above: Inf from exp at body.3, absorbed by the last tanh in forward, turned into NaN by
    # body.5's weight gradient (the tanh's gradient is 0 at +-inf, times the saved +inf)
    model, x = build(SAVED_ACTIVATION)
    with nanhunt.trace(model, level="module") as t:
        model(x).sum().backward()
    # THEN the leading origin is the injection, as at op level
    assert t.first is not None
    assert (t.first.phase, t.first.module) == (Phase.FORWARD, "body.3"), t.first.describe()
