"""Known, injected faults: ``t.first`` must name the exact phase, module, op and call.

Each test builds a tiny deterministic model from ``models.py`` whose fault sits at
one known place, runs one step inside ``nanhunt.trace`` and checks the birth place
of the first non-finite value against the origin rule (DESIGN.md): an op whose
output holds a NaN while none of its inputs does, or an Inf while all its inputs
are finite.
"""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Callable

import tests._support.models as M
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import NonFiniteError, Occurrence, Phase, Role

# ---------------------------------------------------------------- helpers


def line_of(obj: object, marker: str = "FAULT") -> int:
    """Line number (in models.py) of the first source line of ``obj`` containing ``marker``."""
    lines, start = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    for i, text in enumerate(lines):
        if marker in text:
            return start + i
    raise AssertionError(f"no {marker!r} in {obj!r}")


def models_line(obj: object, func: str = "forward", marker: str = "FAULT") -> str:
    return f"models.py:{line_of(obj, marker)} in {func}"


def run_step(
    model: nn.Module,
    *inputs: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.float().sum(),
    backward: bool = True,
    level: str = "op",
    autocast: torch.dtype | None = None,
    **kw: object,
) -> nanhunt.Trace:
    with nanhunt.trace(model, level=level, **kw) as t:  # type: ignore[arg-type]
        with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
            out = model(*inputs)
        loss = loss_fn(out)
        if backward:
            loss.backward()
    return t


def assert_where(
    occ: Occurrence | None,
    *,
    phase: Phase,
    module: str | None,
    op: str | None,
    call_index: int = 0,
    kind: str | None = None,
    module_class: str | None = None,
) -> Occurrence:
    assert occ is not None, "expected a non-finite origin, got t.first = None"
    got = (occ.phase, occ.module, occ.op, occ.call_index)
    assert got == (phase, module, op, call_index), f"got {occ.describe()} / {got}"
    if kind is not None:
        assert occ.kind == kind
    if module_class is not None:
        assert occ.module_class == module_class
    assert not occ.allowed
    return occ


def assert_creates(occ: Occurrence) -> None:
    """The origin rule itself, checked on the records nanhunt returned."""
    if occ.kind == "nan":
        assert occ.output.has_nan
        assert not any(r.has_nan for r in occ.inputs)
    else:
        assert occ.output.has_inf
        assert all(r.finite for r in occ.inputs)


# ---------------------------------------------------------------- forward


def test_fp16_linear_overflow_under_autocast() -> None:
    # GIVEN fc1 with weights 1000 and inputs 100 (both exact in float16): 4 * 1000 * 100 = 4e5 > 65504
    m = M.fp16_overflow_mlp()
    x = torch.full((2, 4), 100.0)
    # WHEN one step runs with fc1 under float16 autocast
    t = run_step(m, x, autocast=torch.float16)
    # THEN the Inf is born in fc1's matmul on CPU (addmm: bias + x @ W^T), not in a cast
    occ = assert_where(t.first, phase=Phase.FORWARD, module="fc1", op="aten::addmm", kind="inf", module_class="Linear")
    assert_creates(occ)
    assert occ.output.dtype == "float16"
    assert [r.dtype for r in occ.inputs] == ["float16"] * 3
    assert all(r.op == "aten::_to_copy" and r.finite for r in occ.inputs)  # autocast's casts stayed finite
    assert occ.source is not None and occ.source.endswith(f"models.py:{line_of(M.MLP.forward, 'return')} in forward")
    assert "output" in occ.reached and "loss" in occ.reached


def test_fp16_overflow_is_absent_in_float32_reference() -> None:
    # GIVEN the same model and batch WHEN run in float32 THEN nothing is non-finite (a precision bug)
    m = M.fp16_overflow_mlp()
    t = run_step(m, torch.full((2, 4), 100.0))
    assert t.first is None
    assert t.origins == []


def test_exp_overflow_in_custom_activation() -> None:
    # GIVEN a custom activation computing exp, fed 200
    m = M.exp_overflow_mlp()
    # WHEN one training step runs
    t = run_step(m, torch.ones(2, 4))
    # THEN exp in the activation module is the birth place, at its source line
    occ = assert_where(t.first, phase=Phase.FORWARD, module="act", op="aten::exp", kind="inf", module_class="ExpActivation")
    assert_creates(occ)
    assert occ.source is not None and occ.source.endswith(models_line(M.ExpActivation.forward))
    assert occ.reached == ("output", "loss", "gradients")


def test_exp_overflow_propagation_path() -> None:
    # GIVEN the exp overflow WHEN traced THEN t.path starts at the origin and follows dataflow edges
    t = run_step(M.exp_overflow_mlp(), torch.ones(2, 4))
    occ = t.first
    assert occ is not None
    path = t.path
    assert path[0].index == occ.output.index
    assert len(path) >= 2
    for prev, nxt in zip(path, path[1:]):
        assert prev.index in nxt.inputs
        assert not nxt.finite
    last = path[-1]
    assert last.phase is Phase.LOSS or last.role is Role.GRAD or last.phase is Phase.BACKWARD or last.module == ""


def test_log_zero_in_loss() -> None:
    # GIVEN a clean model and a loss taking log of an exact 0
    m = M.clean_mlp()
    # WHEN the loss is computed outside the model and backward runs
    t = run_step(m, M.batch(2, 4), loss_fn=M.log_zero_loss)
    # THEN the -Inf is born in the loss phase, outside any module
    occ = assert_where(t.first, phase=Phase.LOSS, module=None, op="aten::log", kind="inf")
    assert_creates(occ)
    assert occ.module_class is None
    assert occ.source is not None and occ.source.endswith(models_line(M.log_zero_loss, "log_zero_loss"))
    assert occ.output.min == -math.inf
    assert "loss" in occ.reached


def test_sqrt_zero_backward_is_inf() -> None:
    # GIVEN sqrt(x*x) with an exactly zero column: finite forward, Inf derivative
    m = M.sqrt_model()
    x = M.batch(2, 4)
    # WHEN forward alone runs THEN nothing is non-finite
    assert run_step(m, x, backward=False).first is None
    # WHEN backward runs THEN the Inf is born in backward, in the module of the forward sqrt,
    # and its source is the forward line that created the autograd node
    t = run_step(m, x)
    occ = assert_where(t.first, phase=Phase.BACKWARD, module="norm", op="aten::div", kind="inf", module_class="SqrtNorm")
    assert_creates(occ)
    assert occ.source is not None and occ.source.endswith(models_line(M.SqrtNorm.forward))
    assert "gradients" in occ.reached


def test_zero_over_zero() -> None:
    # GIVEN a block computing d / d with d = x - x WHEN a step runs THEN div creates a NaN
    M.seeded(0)
    m = M.Wrap(M.ZeroOverZero())
    t = run_step(m, M.batch(2, 4))
    occ = assert_where(t.first, phase=Phase.FORWARD, module="block", op="aten::div", kind="nan", module_class="ZeroOverZero")
    assert_creates(occ)
    assert occ.source is not None and occ.source.endswith(models_line(M.ZeroOverZero.forward))


def test_inf_minus_inf() -> None:
    # GIVEN +inf written by masked_fill (scalar already inf: no origin) WHEN a - a runs
    M.seeded(0)
    m = M.Wrap(M.InfMinusInf())
    t = run_step(m, M.batch(2, 4))
    # THEN the NaN is born in the subtraction
    occ = assert_where(t.first, phase=Phase.FORWARD, module="block", op="aten::sub", kind="nan")
    assert_creates(occ)
    assert any(r.has_inf for r in occ.inputs)  # Inf inputs are allowed for a NaN origin
    assert not any(o.op == "aten::masked_fill" for o in t.origins)


def test_fully_masked_attention_row() -> None:
    # GIVEN causal attention where query row 2 may see no key at all
    m = M.attn_model()
    keep = M.causal_keep(4)
    keep[2] = False
    # WHEN one step runs
    t = run_step(m, M.batch(1, 4, 8), keep)
    # THEN the NaN is born in the softmax of that row, not in the -inf masked_fill
    occ = assert_where(t.first, phase=Phase.FORWARD, module="attn", op="aten::_softmax", kind="nan", module_class="Attention")
    assert_creates(occ)
    assert occ.inputs[0].min == -math.inf
    assert occ.source is not None and "models.py" in occ.source


def test_nan_in_batch() -> None:
    # GIVEN a batch holding a NaN
    x = M.batch(2, 4)
    x[1, 2] = math.nan
    # WHEN a clean model runs on it
    t = run_step(M.clean_mlp(), x)
    # THEN phase input, no op, at the root module the batch entered
    occ = assert_where(t.first, phase=Phase.INPUT, module=None, op=None, kind="nan")
    assert occ.output.role is Role.INPUT
    assert occ.output.shape == (2, 4)
    assert "loss" in occ.reached


def test_nan_in_batch_passed_as_keyword() -> None:
    # GIVEN a NaN batch passed to the model as a keyword argument
    x = M.batch(2, 4)
    x[0, 3] = math.nan
    m = M.clean_mlp()
    with nanhunt.trace(m) as t:
        m(x=x).sum().backward()
    # THEN it is still phase input at the root
    occ = assert_where(t.first, phase=Phase.INPUT, module=None, op=None, kind="nan")
    assert occ.output.role is Role.INPUT


def test_origin_carries_full_statistics() -> None:
    # GIVEN the exp overflow (one element of 8 per row overflows: fc1 row 0 is 50s, the others 0)
    m = M.exp_overflow_mlp()
    with torch.no_grad():
        m.fc1.weight[1:].zero_()
    # WHEN traced live with full_stats=True (no replay, no stop_at_first)
    with nanhunt.trace(m, full_stats=True) as t:
        m(torch.ones(2, 4)).sum().backward()
    occ = assert_where(t.first, phase=Phase.FORWARD, module="act", op="aten::exp", kind="inf")
    # THEN the full statistics of the tensors that matter are there: counts for output and inputs
    assert occ.output.full is not None
    assert (occ.output.full.posinf, occ.output.full.nan, occ.output.full.numel) == (2, 0, 16)
    assert all(r.full is not None for r in occ.inputs)


def test_default_trace_keeps_no_tensor_and_has_cheap_stats_only() -> None:
    # GIVEN the same overflow WHEN traced with the defaults THEN one read-back, no held tensors:
    # the culprit carries min/max only (full counts come from replay or full_stats=True)
    m = M.exp_overflow_mlp()
    t = run_step(m, torch.ones(2, 4))
    assert t.first is not None and t.first.op == "aten::exp" and t.first.output.full is None


def test_nan_in_target() -> None:
    # GIVEN a target holding a NaN that enters the step through the loss
    m = M.clean_mlp()
    y = torch.zeros(2, 3)
    y[0, 0] = math.nan
    # WHEN the loss is computed
    t = run_step(m, M.batch(2, 4), loss_fn=lambda out: F.mse_loss(out, y))
    # THEN phase input, no op, no module
    occ = assert_where(t.first, phase=Phase.INPUT, module=None, op=None, kind="nan")
    assert occ.output.role is Role.INPUT


def test_nan_in_weight() -> None:
    # GIVEN a NaN in fc2's weight
    m = M.clean_mlp()
    with torch.no_grad():
        m.fc2.weight[1, 1] = math.nan
    # WHEN a step runs THEN phase weights, module = the owner, no op
    t = run_step(m, M.batch(2, 4))
    occ = assert_where(t.first, phase=Phase.WEIGHTS, module="fc2", op=None, kind="nan", module_class="Linear")
    assert occ.output.role is Role.PARAM
    assert occ.output.shape == (3, 8)


@pytest.mark.parametrize(
    "level",
    [
        "op",
        "module",
    ],
)
def test_stale_nan_grad_is_found(level: str) -> None:
    # GIVEN fc1.weight.grad left all-NaN by an earlier step (zero_grad forgotten)
    m = M.clean_mlp()
    m.fc1.weight.grad = torch.full_like(m.fc1.weight, math.nan)
    # WHEN a clean step accumulates into it
    with nanhunt.trace(m, level=level) as t:
        m(M.batch(2, 4)).sum().backward()
    assert torch.isnan(m.fc1.weight.grad).all()
    # THEN the gradients are not reported finite: the NaN is named, at fc1, as a value entering the step
    # (no op creates it; module level names fc1's gradient)
    occ = t.first
    assert occ is not None, "fc1.weight.grad is NaN, yet t.first is None"
    assert (occ.module, occ.op, occ.kind) == ("fc1", None, "nan")


def test_inf_in_buffer() -> None:
    # GIVEN an Inf in a BatchNorm running_var (a buffer), model in eval mode
    M.seeded(0)
    m = M.BNModel().eval()
    with torch.no_grad():
        m.bn.running_var[2] = math.inf
    # WHEN a step runs THEN phase weights, module = bn, role buffer
    t = run_step(m, M.batch(3, 4))
    occ = assert_where(t.first, phase=Phase.WEIGHTS, module="bn", op=None, kind="inf", module_class="BatchNorm1d")
    assert occ.output.role is Role.BUFFER


def test_custom_autograd_function_backward_nan() -> None:
    # GIVEN a custom Function whose backward takes sqrt of a negative number
    M.seeded(0)
    m = M.Wrap(M.BadGradModule())
    x = M.batch(2, 4)
    # WHEN forward alone runs THEN nothing is non-finite
    assert run_step(m, x, backward=False).first is None
    # WHEN backward runs THEN the NaN is born in backward, attributed to the module that called apply
    t = run_step(m, x)
    occ = assert_where(t.first, phase=Phase.BACKWARD, module="block", op="aten::sqrt", kind="nan", module_class="BadGradModule")
    assert_creates(occ)
    assert occ.source is not None and "models.py" in occ.source


def test_custom_autograd_function_backward_source_line() -> None:
    # GIVEN the custom Function whose backward makes a NaN
    M.seeded(0)
    m = M.Wrap(M.BadGradModule())
    t = run_step(m, M.batch(2, 4))
    occ = t.first
    assert occ is not None and occ.op == "aten::sqrt"
    # THEN the source is the forward line that created its node (BadGrad.apply) or, at least,
    # the user's line in backward that ran the op; not an unrelated op inside the Function's forward
    apply_line = models_line(M.BadGradModule.forward, marker="BadGrad.apply")
    backward_line = models_line(M.BadGrad.backward, func="backward")
    assert occ.source is not None
    assert occ.source.endswith(apply_line) or occ.source.endswith(backward_line), occ.source


def test_functional_op_between_module_calls() -> None:
    # GIVEN user code that calls two submodules with a functional exp in between
    m = M.clean_mlp()
    x = M.batch(2, 4)
    # WHEN traced
    with nanhunt.trace(m) as t:
        h = m.fc1(x)
        h = torch.exp(h * 1000.0)  # THE FAULT
        m.fc2(h).sum().backward()
    # THEN phase forward, module None (outside any module), the user's line
    occ = assert_where(t.first, phase=Phase.FORWARD, module=None, op="aten::exp", kind="inf")
    assert_creates(occ)
    fault_line = line_of(test_functional_op_between_module_calls, "THE FAULT")
    assert occ.source is not None
    assert occ.source.endswith(f"test_trace_faults.py:{fault_line} in test_functional_op_between_module_calls")


def test_functional_op_in_root_forward() -> None:
    # GIVEN a root whose own forward runs torch.exp WHEN traced THEN the op belongs to the root ""
    M.seeded(0)
    m = M.RootFunctional()
    with torch.no_grad():
        m.fc.weight.fill_(1.0)
    t = run_step(m, torch.ones(2, 4))
    occ = assert_where(t.first, phase=Phase.FORWARD, module="", op="aten::exp", kind="inf", module_class="RootFunctional")
    assert occ.source is not None and occ.source.endswith(models_line(M.RootFunctional.forward))


def test_functional_op_before_model_is_not_phase_input() -> None:
    # GIVEN preprocessing that takes log of a negative batch value before the model runs
    m = M.clean_mlp()
    x = -M.batch(2, 4).abs() - 1.0
    # WHEN traced
    with nanhunt.trace(m) as t:
        m(torch.log(x)).sum().backward()
    # THEN an op is named, outside any module, and the phase is not input/weights (those name no op)
    occ = t.first
    assert occ is not None and occ.op == "aten::log" and occ.module is None
    assert occ.phase not in (Phase.INPUT, Phase.WEIGHTS)


def test_module_called_twice_fails_on_second_call() -> None:
    # GIVEN `scale` (x * 1e25) applied twice to values >= 1: the second call overflows float32
    M.seeded(0)
    m = M.TwiceModel()
    # WHEN a step runs
    t = run_step(m, M.batch(2, 4))
    # THEN the Inf is born in scale, call index 1
    occ = assert_where(t.first, phase=Phase.FORWARD, module="scale", op="aten::mul", call_index=1, kind="inf", module_class="Scale")
    assert_creates(occ)
    assert all(r.absmax >= 1e25 for r in occ.inputs)  # the input is call 0's (finite) output


def test_module_called_twice_backward_fails_on_second_call() -> None:
    # GIVEN SqrtNorm called twice; only its second call sees exact zeros
    m = M.twice_sqrt()
    # WHEN a step runs THEN the backward Inf belongs to norm call 1, at the forward sqrt line
    t = run_step(m, M.batch(2, 4))
    occ = assert_where(t.first, phase=Phase.BACKWARD, module="norm", op="aten::div", call_index=1, kind="inf")
    assert occ.source is not None and occ.source.endswith(models_line(M.SqrtNorm.forward))


# ---------------------------------------------------------------- in place


@pytest.mark.parametrize(
    ("block", "op", "dtype"),
    [
        (M.InplaceMulHalf, "aten::mul_", "float16"),
        (M.InplaceExp, "aten::exp_", "float32"),
    ],
    ids=["mul_-float16", "exp_"],
)
def test_inplace_op_is_named(block: type[nn.Module], op: str, dtype: str) -> None:
    # GIVEN a block whose in-place op overflows WHEN a step runs THEN that in-place op is named
    M.seeded(0)
    m = M.Wrap(block())
    t = run_step(m, M.batch(2, 4))
    occ = assert_where(t.first, phase=Phase.FORWARD, module="block", op=op, kind="inf", module_class=block.__name__)
    assert occ.output.dtype == dtype
    assert_creates(occ)
    assert occ.source is not None and occ.source.endswith(models_line(block.forward))


@pytest.mark.parametrize(
    ("block", "op"),
    [(M.InplaceViewWrite, "aten::mul_"), (M.InplaceViewExp, "aten::exp_")],
    ids=["select-mul_", "narrow-exp_"],
)
def test_inplace_write_through_view_is_named(block: type[nn.Module], op: str) -> None:
    # GIVEN a block that writes in place through a view of a fresh tensor
    M.seeded(0)
    m = M.Wrap(block())
    # WHEN a step runs THEN the in-place op on the view is named
    t = run_step(m, M.batch(2, 4))
    occ = assert_where(t.first, phase=Phase.FORWARD, module="block", op=op, kind="inf")
    assert_creates(occ)
    assert occ.source is not None and occ.source.endswith(models_line(block.forward))


@pytest.mark.parametrize(
    "block",
    [
        M.InplaceViewWrite,
        M.InplaceViewExp,
    ],
    ids=["select-mul_", "narrow-exp_"],
)
def test_inplace_write_through_view_reaches_loss(block: type[nn.Module]) -> None:
    # GIVEN the view write of the previous test; the base tensor is returned and summed into the loss
    M.seeded(0)
    m = M.Wrap(block())
    # WHEN a step runs
    with nanhunt.trace(m) as t:
        out = m(M.batch(2, 4))
        loss = out.sum()
        loss.backward()
    assert not torch.isfinite(loss)  # the Inf really got to the loss
    # THEN the origin is not reported as silent: it reached the output and the loss
    occ = t.first
    assert occ is not None
    assert "output" in occ.reached and "loss" in occ.reached


# ---------------------------------------------------------------- silent


def test_absorbed_overflow_is_a_silent_finding() -> None:
    # GIVEN exp overflow hidden by a clamp WHEN the forward runs (no backward)
    M.seeded(0)
    m = M.Wrap(M.SilentOverflow())
    with nanhunt.trace(m) as t:
        out = m(M.batch(2, 4))
        loss = out.sum()
    assert torch.isfinite(loss)
    # THEN it is still the first finding, reported silent
    occ = assert_where(t.first, phase=Phase.FORWARD, module="block", op="aten::exp", kind="inf")
    assert occ.reached == ()
    assert occ.silent
    assert "silent" in occ.describe()


# ---------------------------------------------------------------- no false alarm


def test_clean_mlp_full_step_has_no_origin() -> None:
    # GIVEN a clean MLP and SGD WHEN forward, loss, backward and step run THEN nothing is reported
    m = M.clean_mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = M.batch(5, 4), torch.tensor([0, 1, 2, 1, 0])
    with nanhunt.trace(m) as t:
        F.cross_entropy(m(x), y).backward()
        opt.step()
    assert t.first is None
    assert t.origins == []
    assert t.finite
    phases = {r.phase for r in t.records}
    assert {Phase.WEIGHTS, Phase.INPUT, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.UPDATE} <= phases


def test_clean_mlp_under_autocast_has_no_origin() -> None:
    t = run_step(M.clean_mlp(), M.batch(4, 4), autocast=torch.float16)
    assert t.first is None
    t = run_step(M.clean_mlp(), M.batch(4, 4), autocast=torch.bfloat16)
    assert t.first is None


@pytest.mark.parametrize("level", ["op", "module"])
def test_causal_attention_with_minus_inf_mask_has_no_origin(level: str) -> None:
    # GIVEN attention with a causal -inf mask (no row fully masked)
    m = M.attn_model()
    # WHEN forward and backward run
    with nanhunt.trace(m, level=level) as t:
        out = m(M.batch(2, 4, 8), M.causal_keep(4))
        out.sum().backward()
    # THEN -inf in the scores is intentional: no false alarm, and the step is finite where it matters
    assert t.first is None
    assert t.origins == []
    if level == "op":
        assert any(r.min == -math.inf for r in t.records)  # the -inf scores were seen, and judged intentional
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_inplace_minus_inf_mask_passed_to_child_has_no_origin() -> None:
    # GIVEN an additive mask built in place with -inf (no row fully masked) and passed to a child module
    M.seeded(0)
    m = M.InplaceMaskAttention()
    # WHEN forward and backward run
    with nanhunt.trace(m) as t:
        out = m(M.batch(1, 4, 8), M.causal_keep(4))
        out.sum().backward()
    assert torch.isfinite(out).all()
    # THEN no false alarm (masked_fill_ with a -inf scalar creates nothing)
    assert t.first is None, t.first.describe() if t.first else ""


def test_view_of_inplace_minus_inf_mask_passed_to_child_has_no_origin() -> None:
    # GIVEN the in-place -inf mask of the previous test, handed to the child as a view (unsqueeze(0))
    M.seeded(0)
    m = M.InplaceMaskAttention(mask_view=True)
    # WHEN forward and backward run
    with nanhunt.trace(m) as t:
        out = m(M.batch(1, 4, 8), M.causal_keep(4))
        out.sum().backward()
    assert torch.isfinite(out).all()
    # THEN no false alarm
    assert t.first is None, t.first.describe() if t.first else ""


@pytest.fixture
def nan_filled_uninitialised_memory():  # type: ignore[no-untyped-def]
    """Deterministic mode fills torch.empty's memory with NaN: garbage made reproducible."""
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.isnan(torch.empty(4)).all()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
@pytest.mark.parametrize("block", [M.EmptyThenFill, M.SliceAssign], ids=["empty-then-copy_", "slice-assign-backward"])
def test_uninitialised_memory_is_no_origin(block: type[nn.Module]) -> None:
    # GIVEN a module that allocates uninitialised memory (torch.empty in forward, new_empty_strided in the
    # backward of a slice assignment) and writes it before any read; the garbage is NaN
    M.seeded(0)
    m = M.Wrap(block())
    # WHEN a step runs
    with nanhunt.trace(m) as t:
        out = m(M.batch(4, 4))
        out.sum().backward()
    assert torch.isfinite(out).all()
    # THEN never-read garbage is no origin
    assert t.first is None, t.first.describe() if t.first else ""
    assert t.origins == []


@pytest.mark.usefixtures("nan_filled_uninitialised_memory")
def test_piecewise_filled_empty_is_no_origin() -> None:
    # GIVEN a module that fills torch.empty piece by piece through slices (as code building a
    # tensor without torch.cat does); the garbage is NaN until written
    M.seeded(0)
    m = M.Wrap(M.PiecewiseFill())
    # WHEN a step runs
    with nanhunt.trace(m) as t:
        out = m(M.batch(4, 4))
        out.sum().backward()
    assert torch.isfinite(out).all()
    # THEN no false alarm
    assert t.first is None, t.first.describe() if t.first else ""


# ---------------------------------------------------------------- level="module"


@pytest.mark.parametrize(
    ("make", "x", "autocast", "want"),
    [
        (M.exp_overflow_mlp, lambda: torch.ones(2, 4), None, (Phase.FORWARD, "act", 0, "inf")),
        (M.fp16_overflow_mlp, lambda: torch.full((2, 4), 100.0), torch.float16, (Phase.FORWARD, "fc1", 0, "inf")),
        (M.TwiceModel, lambda: M.batch(2, 4), None, (Phase.FORWARD, "scale", 1, "inf")),
        (lambda: M.Wrap(M.ZeroOverZero()), lambda: M.batch(2, 4), None, (Phase.FORWARD, "block", 0, "nan")),
    ],
    ids=["exp", "fp16-linear", "called-twice", "zero-over-zero"],
)
def test_module_level_names_module_without_op(make, x, autocast, want) -> None:  # type: ignore[no-untyped-def]
    # GIVEN a known forward fault WHEN traced at module level
    M.seeded(0)
    m = make()
    t = run_step(m, x(), level="module", autocast=autocast)
    # THEN the module and call are named, no op
    phase, module, call, kind = want
    occ = assert_where(t.first, phase=phase, module=module, op=None, call_index=call, kind=kind)
    assert occ.output.role is Role.OUTPUT


def test_module_level_nan_in_batch_and_weight() -> None:
    x = M.batch(2, 4)
    x[0, 0] = math.nan
    t = run_step(M.clean_mlp(), x, level="module")
    assert_where(t.first, phase=Phase.INPUT, module=None, op=None, kind="nan")
    m = M.clean_mlp()
    with torch.no_grad():
        m.fc1.bias[0] = math.inf
    t = run_step(m, M.batch(2, 4), level="module")
    assert_where(t.first, phase=Phase.WEIGHTS, module="fc1", op=None, kind="inf")


def test_module_level_backward_fault_names_module_of_backward() -> None:
    # GIVEN sqrt(0) whose backward is Inf, inside `norm`, fed by `fc`
    m = M.sqrt_model()
    # WHEN traced at module level
    t = run_step(m, M.batch(2, 4), level="module")
    # THEN the backward fault belongs to norm (op level agrees: see test_sqrt_zero_backward_is_inf)
    assert_where(t.first, phase=Phase.BACKWARD, module="norm", op=None)


def test_module_level_nan_weight_is_not_silent() -> None:
    # GIVEN a NaN weight in fc2, which makes the model output NaN
    m = M.clean_mlp()
    with torch.no_grad():
        m.fc2.weight[0, 0] = math.nan
    with nanhunt.trace(m, level="module") as t:
        out = m(M.batch(2, 4))
        out.sum().backward()
    assert torch.isnan(out).any()
    # THEN the weights origin is first and it reached the output
    occ = assert_where(t.first, phase=Phase.WEIGHTS, module="fc2", op=None, kind="nan")
    assert "output" in occ.reached


# ---------------------------------------------------------------- allow=


def test_allow_module_lists_origin_but_never_first() -> None:
    # GIVEN exp overflow in `act` declared intentional
    m = M.exp_overflow_mlp()
    # WHEN traced with allow=["act"]
    t = run_step(m, torch.ones(2, 4), allow=["act"])
    # THEN act's origin is in t.origins, flagged allowed, and t.first is the next, unallowed origin (fc2's NaN)
    allowed = [o for o in t.origins if o.module == "act"]
    assert len(allowed) == 1 and allowed[0].allowed and allowed[0].op == "aten::exp"
    assert t.first is not None and t.first is not allowed[0]
    assert_where(t.first, phase=Phase.FORWARD, module="fc2", op="aten::addmm", kind="nan")
    assert t.origins.index(allowed[0]) < t.origins.index(t.first)


@pytest.mark.parametrize("allow", [["aten::exp"], ["exp"], ("act",), "act"])
def test_allow_by_op_name_or_module(allow: object) -> None:
    t = run_step(M.exp_overflow_mlp(), torch.ones(2, 4), allow=allow)
    assert t.first is not None and t.first.op != "aten::exp"
    assert t.origins[0].op == "aten::exp" and t.origins[0].allowed


def test_allow_everything_gives_no_first() -> None:
    # GIVEN exp overflow in act and the NaN it causes in fc2, both modules allowed WHEN traced
    t = run_step(M.exp_overflow_mlp(), torch.ones(2, 4), backward=False, allow=["act", "fc2"])
    # THEN origins are listed but none is first
    assert t.origins and all(o.allowed for o in t.origins)
    assert t.first is None


def test_allow_covers_submodules() -> None:
    # GIVEN the faulty block nested as block.* WHEN its parent is allowed THEN its origin is allowed
    M.seeded(0)
    outer = nn.Sequential(M.Wrap(M.ZeroOverZero()))
    t = run_step(outer, M.batch(2, 4), backward=False, allow=["0"])
    assert t.origins and t.origins[0].module == "0.block" and t.origins[0].allowed
    assert t.first is None


# ---------------------------------------------------------------- stop_at_first


def test_stop_at_first_raises_inside_the_op() -> None:
    # GIVEN the exp overflow
    m = M.exp_overflow_mlp()
    # WHEN traced with stop_at_first
    with pytest.raises(NonFiniteError) as info:
        with nanhunt.trace(m, stop_at_first=True) as t:
            m(torch.ones(2, 4)).sum().backward()
    # THEN it is a FloatingPointError carrying the occurrence of the exp
    err = info.value
    assert isinstance(err, FloatingPointError)
    assert_where(err.occurrence, phase=Phase.FORWARD, module="act", op="aten::exp", kind="inf")
    assert err.occurrence.output.full is not None and err.occurrence.output.full.posinf > 0
    # ... raised from inside the user's frame (a debugger lands there)
    frames = traceback.extract_tb(info.tb)
    user = [f for f in frames if f.filename.endswith("models.py")]
    assert user, [f"{f.filename}:{f.lineno}" for f in frames]
    assert (user[-1].name, user[-1].lineno) == ("forward", line_of(M.ExpActivation.forward))
    # ... and the trace is cleaned up, with t.first the same occurrence
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert t.first == err.occurrence
    assert not m.act._forward_hooks and not m.act._forward_pre_hooks


def test_stop_at_first_in_backward() -> None:
    m = M.sqrt_model()
    with pytest.raises(NonFiniteError) as info:
        with nanhunt.trace(m, stop_at_first=True):
            m(M.batch(2, 4)).sum().backward()
    assert_where(info.value.occurrence, phase=Phase.BACKWARD, module="norm", op="aten::div", kind="inf")
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_stop_at_first_clean_does_not_raise() -> None:
    m = M.clean_mlp()
    with nanhunt.trace(m, stop_at_first=True) as t:
        m(M.batch(2, 4)).sum().backward()
    assert t.first is None


def test_stop_at_first_skips_allowed() -> None:
    # GIVEN an allowed exp overflow WHEN stop_at_first THEN it stops at the next, unallowed origin
    m = M.exp_overflow_mlp()
    with pytest.raises(NonFiniteError) as info:
        with nanhunt.trace(m, stop_at_first=True, allow=["act"]):
            m(torch.ones(2, 4))
    assert_where(info.value.occurrence, phase=Phase.FORWARD, module="fc2", op="aten::addmm", kind="nan")


def test_stop_at_first_does_not_claim_silent() -> None:
    m = M.exp_overflow_mlp()
    with pytest.raises(NonFiniteError) as info:
        with nanhunt.trace(m, stop_at_first=True):
            m(torch.ones(2, 4)).sum().backward()
    # THEN the message does not claim the value was absorbed: nothing downstream ever ran
    assert "silent" not in str(info.value)
    assert "absorbed" not in str(info.value)
