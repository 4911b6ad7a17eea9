"""The statistics work under every dtype x autocast combination, and nanhunt's exit never hides the user's exception.

The case behind it: a ``.half()`` model traced inside ``torch.autocast("cpu", dtype=torch.bfloat16)`` raised
``Unexpected floating ScalarType in at::autocast::prioritize`` from the statistics' read-back (``torch.stack`` is
on autocast's "promote" list, which refuses float16 under a bfloat16 autocast and bfloat16 under a float16 one),
and that error replaced the user's own exception, a KeyboardInterrupt included.

Complex tensors are measured on their real view (a NaN/Inf in either part shows), so they are part of the matrix.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanhunt
from nanhunt.tracing import stats
from nanhunt._util._errors import NanhuntError, TraceStateError
from nanhunt.records import Phase
from nanhunt.tracing.stats import PendingStats

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX = (torch.complex64, torch.complex128)

# autocast state -> (the dtype autocast computes a Linear in, or None when it is off)
AUTOCAST: dict[str, torch.dtype | None] = {
    "none": None,
    "cpu-float16": torch.float16,
    "cpu-bfloat16": torch.bfloat16,
    "nested-bfloat16-float16": torch.float16,  # the inner one rules
    "disabled": None,
    "nested-bfloat16-disabled": None,
}


@contextlib.contextmanager
def autocast_state(name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if name == "cpu-float16":
            stack.enter_context(torch.autocast("cpu", dtype=torch.float16))
        elif name == "cpu-bfloat16":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        elif name == "nested-bfloat16-float16":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            stack.enter_context(torch.autocast("cpu", dtype=torch.float16))
        elif name == "disabled":
            stack.enter_context(torch.autocast("cpu", enabled=False))
        elif name == "nested-bfloat16-disabled":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            stack.enter_context(torch.autocast("cpu", enabled=False))
        else:
            assert name == "none"
        yield


def compute_dtype(model_dtype: torch.dtype, state: str) -> torch.dtype:
    """The dtype a Linear of ``model_dtype`` runs in under ``state``: autocast casts float16/bfloat16/float32,
    never float64 nor complex."""
    target = AUTOCAST[state]
    if target is None or model_dtype in (torch.float64, *COMPLEX):
        return model_dtype
    return target


def overflow_value(model_dtype: torch.dtype, state: str) -> float | None:
    """A power of two finite in the model's dtype and in the compute dtype whose square overflows the compute
    dtype (so the first Linear's addmm is the origin, not a cast); None when the model's dtype holds none."""
    c = compute_dtype(model_dtype, state)
    real = c.to_real() if c.is_complex else c
    v = 2.0 ** ((math.frexp(torch.finfo(real).max)[1] + 1) // 2)
    store = model_dtype.to_real() if model_dtype.is_complex else model_dtype
    return v if v <= torch.finfo(store).max else None


def tiny_model(dtype: torch.dtype, planted: float | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    if dtype.is_complex:  # no ReLU for complex values
        model = nn.Sequential(nn.Linear(4, 4, dtype=dtype), nn.Linear(4, 4, dtype=dtype))
    else:
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).to(dtype)
    first = model[0]
    assert isinstance(first, nn.Linear)
    if planted is not None:
        with torch.no_grad():
            first.weight.fill_(planted)
            first.bias.zero_()
    return model


def step(model: nn.Module, x: torch.Tensor) -> None:
    out = model(x)
    (out.abs() if out.is_complex() else out).float().sum().backward()


def nanhunt_leftovers(model: nn.Module) -> list[str]:
    """Every hook, mode or optimizer hook a trace could have left behind."""
    left: list[str] = []
    for name, mod in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                     "_backward_pre_hooks"):
            if getattr(mod, attr, None):
                left.append(f"{name or '<root>'}.{attr}")
    for name, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            left.append(f"param {name} post-accumulate-grad hook")
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(nn_module, attr, None):
            left.append(attr)
    if optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks:
        left.append("optimizer step hooks")
    if _get_current_dispatch_mode() is not None:
        left.append("dispatch mode")
    if not torch.is_grad_enabled():
        left.append("grad mode")
    return left


MATRIX = list(itertools.product(FLOATS + COMPLEX, AUTOCAST))
PLANTABLE = [(d, s) for d, s in MATRIX if overflow_value(d, s) is not None]


def _id(p: Any) -> str:
    return str(p).replace("torch.", "")


# ------------------------------------------------------------------ statistics alone


@pytest.mark.parametrize(("dtype", "state"), MATRIX, ids=_id)
def test_pending_stats_read_back_under_every_autocast_state(dtype: torch.dtype, state: str) -> None:
    # GIVEN more tensors of one dtype than a chunk holds (the chunk stacking runs too), one holding +inf
    n = PendingStats.CHUNK + 5
    tensors = [torch.arange(4, dtype=torch.float32).to(dtype) + i for i in range(n)]
    tensors[-1][1] = float("inf")
    pending = PendingStats()
    # WHEN they are queued and read back inside the autocast state
    with autocast_state(state):
        for i, t in enumerate(tensors):
            pending.add(i, t)
        values = pending.read()
    # THEN every range is exact (complex: over the real view, whose zeros are the imaginary parts)
    for i in range(n - 1):
        assert values[i] == (0.0 if dtype.is_complex and i > 0 else float(i), float(i + 3))
    assert values[n - 1] == (0.0 if dtype.is_complex else float(n - 1), float("inf"))


# ------------------------------------------------------------------ the trace


@pytest.mark.parametrize(("dtype", "state"), MATRIX, ids=_id)
def test_clean_model_traces_and_exits_cleanly(dtype: torch.dtype, state: str) -> None:
    # GIVEN a tiny model in `dtype` that stays finite
    model = tiny_model(dtype)
    x = torch.randn(2, 4).to(dtype)
    # WHEN one step is traced inside the autocast state
    with autocast_state(state):
        with nanhunt.trace(model) as t:
            step(model, x)
    # THEN the trace exits cleanly, finds nothing and leaves nothing behind
    assert t.first is None
    assert t.records
    assert nanhunt_leftovers(model) == []


@pytest.mark.parametrize(("dtype", "state"), PLANTABLE, ids=_id)
def test_planted_overflow_is_found_in_the_first_linear(dtype: torch.dtype, state: str) -> None:
    # GIVEN the first Linear's weights and the input at a value whose products overflow the compute dtype
    v = overflow_value(dtype, state)
    model = tiny_model(dtype, planted=v)
    assert v is not None
    x = torch.full((2, 4), v, dtype=dtype)
    # WHEN one step is traced inside the autocast state
    with autocast_state(state):
        with nanhunt.trace(model) as t:
            step(model, x)
    # THEN the first origin is that Linear's matrix product in the forward
    first = t.first
    assert first is not None
    assert (first.module, first.op, first.phase) == ("0", "aten::addmm", Phase.FORWARD)
    assert first.kind == "inf" or dtype.is_complex  # a complex product of infinities may be NaN
    assert nanhunt_leftovers(model) == []


def test_no_overflow_possible_combinations_are_the_expected_ones() -> None:
    # GIVEN the matrix WHEN a planted overflow is impossible THEN it is only because float16 cannot hold
    # the square root of a wider compute dtype's maximum (a float16 model under a bfloat16 autocast)
    assert sorted({(d, s) for d, s in MATRIX} - set(PLANTABLE), key=str) == [(torch.float16, "cpu-bfloat16")]


@pytest.mark.parametrize("options", [{"level": "module"}, {"full_stats": True}, {"stop_at_first": True}],
                         ids=["module", "full_stats", "stop_at_first"])
def test_failing_configuration_with_other_trace_options(options: dict[str, Any]) -> None:
    # GIVEN the mirror of the reported configuration: a bfloat16 model whose first Linear overflows in float16
    model = tiny_model(torch.bfloat16, planted=256.0)
    x = torch.full((2, 4), 256.0, dtype=torch.bfloat16)
    # WHEN traced inside a float16 autocast, with each trace option
    with torch.autocast("cpu", dtype=torch.float16):
        with contextlib.suppress(nanhunt.NonFiniteError), nanhunt.trace(model, **options) as t:
            step(model, x)
    # THEN the trace exits cleanly and names the first Linear
    assert t.first is not None and t.first.module == "0"
    assert nanhunt_leftovers(model) == []


# ------------------------------------------------------------------ the user's exception wins


def _failing_config() -> tuple[nn.Module, torch.Tensor]:
    """The reported one: a .half() model (run inside a bfloat16 autocast)."""
    return tiny_model(torch.float16), torch.randn(2, 4, dtype=torch.float16)


@pytest.mark.parametrize("exc_type", [ValueError, KeyboardInterrupt])
def test_user_exception_propagates_unchanged_in_the_failing_configuration(exc_type: type[BaseException]) -> None:
    # GIVEN a .half() model traced inside a bfloat16 autocast
    model, x = _failing_config()
    raised = exc_type("the user's own")
    # WHEN the block raises after a step
    with pytest.raises(exc_type) as info:
        with torch.autocast("cpu", dtype=torch.bfloat16), nanhunt.trace(model) as t:
            step(model, x)
            raise raised
    # THEN that very exception propagates, nothing is left installed, and the results are readable
    assert info.value is raised
    assert nanhunt_leftovers(model) == []
    assert t.first is None


@pytest.fixture
def broken_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """nanhunt's own finishing work fails, whatever the configuration."""

    def read(self: PendingStats) -> dict[int, tuple[float, float]]:
        raise RuntimeError("read-back exploded")

    monkeypatch.setattr(stats.PendingStats, "read", read)


@pytest.mark.parametrize("exc_type", [ValueError, KeyboardInterrupt])
def test_user_exception_wins_over_a_failing_finish(broken_read_back: None, exc_type: type[BaseException]) -> None:
    # GIVEN a trace whose read-back will fail on exit
    model, x = tiny_model(torch.float32), torch.randn(2, 4)
    raised = exc_type("the user's own")
    # WHEN the block raises
    with pytest.raises(exc_type) as info:
        with nanhunt.trace(model) as t:
            step(model, x)
            raise raised
    # THEN the user's exception propagates unchanged, carrying nanhunt's failure as a note
    assert info.value is raised
    notes = getattr(raised, "__notes__", [])
    assert any("nanhunt" in n and "read-back exploded" in n for n in notes)
    assert nanhunt_leftovers(model) == []
    # AND the trace says why it has no results
    with pytest.raises(TraceStateError, match="could not finish.*read-back exploded"):
        _ = t.first


def test_failing_finish_without_user_exception_is_a_nanhunt_error(broken_read_back: None) -> None:
    # GIVEN a trace whose read-back will fail on exit
    model, x = tiny_model(torch.float32), torch.randn(2, 4)
    # WHEN the block completes normally
    with pytest.raises(NanhuntError, match="trace could not finish") as info:
        with nanhunt.trace(model):
            step(model, x)
    # THEN a nanhunt error is raised, caused by the raw one, with everything removed
    assert isinstance(info.value.__cause__, RuntimeError)
    assert nanhunt_leftovers(model) == []


def test_interrupt_during_the_finish_propagates_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a Ctrl-C that lands in the read-back on exit
    def read(self: PendingStats) -> dict[int, tuple[float, float]]:
        raise KeyboardInterrupt

    monkeypatch.setattr(stats.PendingStats, "read", read)
    model, x = tiny_model(torch.float32), torch.randn(2, 4)
    # WHEN the block completes normally
    with pytest.raises(KeyboardInterrupt):
        with nanhunt.trace(model) as t:
            step(model, x)
    # THEN the interrupt is not wrapped, nothing is left, and the trace says it did not finish
    assert nanhunt_leftovers(model) == []
    with pytest.raises(TraceStateError, match="could not finish"):
        _ = t.first


def test_user_exception_wins_over_a_failing_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a hook handle whose removal raises once (after removing, so that nothing leaks into other tests)
    model, x = tiny_model(torch.float32), torch.randn(2, 4)
    original = torch.utils.hooks.RemovableHandle.remove
    failed: list[bool] = []

    def remove(self: torch.utils.hooks.RemovableHandle) -> None:
        original(self)
        if not failed:
            failed.append(True)
            raise RuntimeError("remove exploded")

    monkeypatch.setattr(torch.utils.hooks.RemovableHandle, "remove", remove)
    raised = ValueError("the user's own")
    # WHEN the block raises
    with pytest.raises(ValueError) as info:
        with nanhunt.trace(model):
            step(model, x)
            raise raised
    # THEN the user's exception propagates unchanged, and the rest was still torn down
    assert info.value is raised
    assert failed
    assert any("remove exploded" in n for n in getattr(raised, "__notes__", []))
    assert nanhunt_leftovers(model) == []
