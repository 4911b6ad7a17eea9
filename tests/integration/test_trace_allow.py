"""``allow``: an allowed op's non-finite values are no origin; what is born from them downstream, or entered the
step from before it, still is."""

from __future__ import annotations

import torch
from torch import nn

import nanhunt
from nanhunt import Phase, Role
from tests._support.models import ExpActivation, where


def exp_head(*, zero_weight: bool = False) -> nn.Sequential:
    """fc(4, 4) -> fc(4, 4) -> exp -> fc(4, 1) on ones: the second layer's unit 0 sums 3 * 30 * 4 = 360, exp makes
    +Inf there only, and every weight after it is positive, so the forward output and the loss are +Inf, no NaN.
    ``zero_weight``: unit 0's weight from input 3 is 0, so its backward multiplies 0 by the +Inf gradient."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), ExpActivation(), nn.Linear(4, 1))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(0.5)
        m[0].weight.fill_(1.0)
        m[0].bias.zero_()
        m[1].bias.zero_()
        m[1].weight.zero_()
        m[1].weight[0, : 3 if zero_weight else 4] = 30.0
    return m


def test_allowed_overflow_and_the_infinities_it_feeds_are_no_origin() -> None:
    m = exp_head()
    with nanhunt.trace(m, allow=["aten::exp"]) as t:
        m(torch.ones(2, 4)).sum().backward()
    assert t.first is None
    assert [(where(o), o.allowed) for o in t.origins] == [((Phase.FORWARD, "2", "aten::exp", 0, "inf"), True)]


def test_nan_born_from_an_allowed_inf_downstream_is_an_origin() -> None:
    # allow says the exp's +Inf is intended, not what is made of it: 0 * Inf in the backward of module 1 makes a
    # NaN, a kind of value its inputs (+Inf, finite) do not hold. By the origin rule it is born there, and it is
    # the culprit: the allowed overflow only became harmful at that op.
    m = exp_head(zero_weight=True)
    with nanhunt.trace(m, allow=["aten::exp"]) as t:
        m(torch.ones(2, 4)).sum().backward()
    assert where(t.first) == (Phase.BACKWARD, "1", "aten::mm", 0, "nan")
    assert t.first is not None and not t.first.allowed
    assert [o.allowed for o in t.origins] == [True, False]


def test_stale_grad_from_an_earlier_backward_is_state_entering_the_step() -> None:
    # A backward before the trace (no zero_grad since) left +Inf in module 3's .grad; the traced backward adds into
    # it. That value was not made in the traced step, so the allowed exp cannot explain it: it enters the step as
    # state, first read by module 3's backward. Reporting it (phase backward, module 3, role state) is right; it
    # is no gradient the step made, so its description says what it is, and zeroing the gradients makes the step
    # clean.
    m = exp_head()
    m(torch.ones(2, 4)).sum().backward()
    with nanhunt.trace(m, allow=["aten::exp"]) as t:
        m(torch.ones(2, 4)).sum().backward()
    assert where(t.first) == (Phase.BACKWARD, "3", None, 0, "inf")
    assert t.first is not None and t.first.output.role is Role.STATE and t.first.output.inputs == ()
    assert t.first.describe() == ("Inf born in phase backward, module 3 (Linear, call 0), role state: "
                                  "a .grad from before the step, not zeroed")
    m.zero_grad(set_to_none=True)
    with nanhunt.trace(m, allow=["aten::exp"]) as t:
        m(torch.ones(2, 4)).sum().backward()
    assert t.first is None
