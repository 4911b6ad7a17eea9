"""Nothing lost: a trace leaves the model, the user's hooks, autograd and the RNG as it found them."""

from __future__ import annotations

import copy
import math
from typing import Any

import tests._support.models as M
import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanhunt
from nanhunt import NonFiniteError
from nanhunt._util._errors import TraceStateError

# ---------------------------------------------------------------- helpers

_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)

_GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


def _tensor_hooks(t: torch.Tensor) -> tuple[int, int]:
    post_acc = getattr(t, "_post_accumulate_grad_hooks", None)
    back = getattr(t, "_backward_hooks", None)
    return (len(post_acc or {}), len(back or {}))


def hook_counts(model: nn.Module, extra: tuple[torch.Tensor, ...] = ()) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    for name, mod in model.named_modules():
        for attr in _MODULE_HOOK_DICTS:
            counts[f"{name}.{attr}"] = len(getattr(mod, attr, None) or {})
    for name, p in model.named_parameters():
        counts[f"param {name}"] = _tensor_hooks(p)
    for i, t in enumerate(extra):
        counts[f"tensor {i}"] = _tensor_hooks(t)
        if t.grad_fn is not None:
            counts[f"tensor {i} grad_fn"] = (len(t.grad_fn._forward_hooks or {}), len(t.grad_fn._forward_pre_hooks or {}))
    for attr in _GLOBAL_HOOK_DICTS:
        counts[attr] = len(getattr(nn_module, attr, None) or {})
    return counts


def state(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: (p.detach().clone(), p.requires_grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "ids": [id(p) for p in model.parameters()],
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any], same_model: bool = False) -> None:
    if same_model:
        assert a["ids"] == b["ids"]  # the same Parameter objects, not replacements
    assert a["training"] == b["training"]
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        pa, ra, ga = a["params"][n]
        pb, rb, gb = b["params"][n]
        assert torch.equal(pa, pb) or (pa.isnan().any() and torch.equal(pa.isnan(), pb.isnan())), n
        assert ra == rb, n
        assert (ga is None) == (gb is None), n
        if ga is not None:
            assert torch.allclose(ga, gb, equal_nan=True), n
    assert a["buffers"].keys() == b["buffers"].keys()
    for n in a["buffers"]:
        assert torch.equal(a["buffers"][n], b["buffers"][n]), n


def assert_no_mode() -> None:
    assert _get_current_dispatch_mode() is None
    assert torch._C._len_torch_dispatch_stack() == 0


class Boom(Exception):
    pass


def mixed_model() -> nn.Module:
    """BatchNorm (buffers), Dropout (RNG), a frozen layer, an eval-mode submodule."""
    M.seeded(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3))
    m[0].weight.requires_grad_(False)
    m[1].eval()
    return m


# ---------------------------------------------------------------- hooks


@pytest.mark.parametrize("level", ["op", "module"])
@pytest.mark.parametrize("stop_at_first", [False, True])
def test_hook_counts_unchanged(level: str, stop_at_first: bool) -> None:
    # GIVEN a model WHEN a full step is traced THEN every hook dict has the size it had before
    m = mixed_model()
    before = hook_counts(m)
    with nanhunt.trace(m, level=level, stop_at_first=stop_at_first):
        out = m(M.batch(5, 4))
        out.sum().backward()
    assert hook_counts(m) == before
    assert _tensor_hooks(out) == (0, 0)
    assert_no_mode()


@pytest.mark.parametrize("level", ["op", "module"])
@pytest.mark.parametrize("where", ["forward", "after-backward", "inside-hook"])
def test_hook_counts_unchanged_after_exception(level: str, where: str) -> None:
    # GIVEN a model WHEN the block raises (between ops, or from inside a module's forward)
    m = mixed_model()
    before = hook_counts(m)
    raiser = None
    if where == "inside-hook":
        raiser = m[3].register_forward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
        before = hook_counts(m)
    out = None
    with pytest.raises(Boom):
        with nanhunt.trace(m, level=level) as t:
            out = m(M.batch(5, 4))
            if where == "forward":
                raise Boom()
            out.sum().backward()
            raise Boom()
    # THEN all hooks and the dispatch mode are gone, and the trace is still readable
    assert hook_counts(m) == before
    if out is not None:
        assert _tensor_hooks(out) == (0, 0)
    assert_no_mode()
    assert t.first is None
    if raiser is not None:
        raiser.remove()
    # ... and a new trace on the same model starts from a clean module stack and call count
    with torch.no_grad():
        m[4].weight[0, 0] = math.nan
    with nanhunt.trace(m, level=level) as t2:
        m(M.batch(5, 4))
    assert t2.first is not None
    assert (t2.first.module, t2.first.call_index) == ("4", 0)


def test_hook_counts_unchanged_after_nonfinite_error() -> None:
    m = M.exp_overflow_mlp()
    before = hook_counts(m)
    with pytest.raises(NonFiniteError):
        with nanhunt.trace(m, stop_at_first=True):
            m(torch.ones(2, 4)).sum().backward()
    assert hook_counts(m) == before
    assert_no_mode()


def test_module_level_tensor_hooks_removed_before_backward() -> None:
    # GIVEN module level (it hooks module outputs for gradients) WHEN backward runs after the block
    m = M.clean_mlp()
    with nanhunt.trace(m, level="module") as t:
        out = m(M.batch(2, 4))
    n = len(t.records)
    # THEN the output carries no hook of nanhunt's and backward after exit records nothing
    assert _tensor_hooks(out) == (0, 0)
    out.sum().backward()
    assert len(t.records) == n
    assert all(p.grad is not None for p in m.parameters())


def test_user_hooks_still_there_and_firing() -> None:
    # GIVEN user hooks of every kind on the model
    m = M.clean_mlp()
    calls: dict[str, int] = {}

    def count(key: str) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            calls[key] = calls.get(key, 0) + 1

        return hook

    handles = [
        m.fc1.register_forward_pre_hook(count("pre")),
        m.fc1.register_forward_hook(count("fwd")),
        m.fc2.register_forward_hook(count("fwd_kw"), with_kwargs=True),
        m.fc2.register_full_backward_hook(count("bwd")),
        m.fc2.register_full_backward_pre_hook(count("bwd_pre")),
        m.fc1.weight.register_hook(count("tensor")),
        m.fc1.bias.register_post_accumulate_grad_hook(count("post_acc")),
    ]
    before = hook_counts(m)
    expected = {"pre": 1, "fwd": 1, "fwd_kw": 1, "bwd": 1, "bwd_pre": 1, "tensor": 1, "post_acc": 1}
    # WHEN a step is traced THEN each user hook fires once
    for level in ("op", "module"):
        calls.clear()
        with nanhunt.trace(m, level=level) as t:
            m(M.batch(2, 4)).sum().backward()
        assert calls == expected, level
        assert t.first is None
        # ... and they are all still registered, and fire again outside the trace
        assert hook_counts(m) == before
        calls.clear()
        m(M.batch(2, 4)).sum().backward()
        assert calls == expected
    for h in handles:
        h.remove()


def test_user_hook_that_changes_output_is_respected() -> None:
    # GIVEN a user forward hook that replaces fc1's output by zeros
    m = M.exp_overflow_mlp()
    h = m.fc1.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
    # WHEN traced THEN the model sees the replaced output (exp(0) is finite): nothing to report
    with nanhunt.trace(m) as t:
        out = m(torch.ones(2, 4))
    assert torch.isfinite(out).all()
    assert t.first is None
    h.remove()


# ---------------------------------------------------------------- model state, RNG


@pytest.mark.parametrize("level", ["op", "module"])
def test_traced_step_equals_untraced_step(level: str) -> None:
    # GIVEN two identical models (dropout, BatchNorm buffers, a frozen layer, an eval submodule)
    a = mixed_model()
    b = copy.deepcopy(a)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    x = M.batch(6, 4)
    # WHEN one step runs traced on one and untraced on the other, from the same RNG state
    torch.manual_seed(123)
    with nanhunt.trace(a, level=level) as t:
        out_a = a(x)
        out_a.sum().backward()
        opt_a.step()
    rng_a = torch.get_rng_state()
    torch.manual_seed(123)
    out_b = b(x)
    out_b.sum().backward()
    opt_b.step()
    rng_b = torch.get_rng_state()
    # THEN outputs, parameters, grads, buffers, flags and the RNG are bit-identical
    assert t.first is None
    assert torch.equal(out_a, out_b)
    assert torch.equal(rng_a, rng_b)
    assert_same_state(state(a), state(b))
    assert a[0].weight.requires_grad is False and a[1].training is False and a.training is True


@pytest.mark.parametrize("level", ["op", "module"])
def test_empty_block_touches_nothing(level: str) -> None:
    m = mixed_model()
    before = state(m)
    rng = torch.get_rng_state()
    grad_mode = torch.is_grad_enabled()
    with nanhunt.trace(m, level=level) as t:
        pass
    assert t.first is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.is_grad_enabled() == grad_mode
    assert_same_state(before, state(m), same_model=True)


def test_state_untouched_after_nonfinite_step() -> None:
    # GIVEN a model that makes NaN WHEN traced (and the block raises afterwards) THEN params/buffers
    # are exactly what an untraced run leaves
    a = M.exp_overflow_mlp()
    b = copy.deepcopy(a)
    with pytest.raises(Boom):
        with nanhunt.trace(a):
            a(torch.ones(2, 4)).sum().backward()
            raise Boom()
    b(torch.ones(2, 4)).sum().backward()
    assert_same_state(state(a), state(b))


def test_trace_holds_no_reference_to_the_model() -> None:
    import gc
    import weakref

    m = M.clean_mlp()
    ref = weakref.ref(m)
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
    del m
    gc.collect()
    assert ref() is None
    assert t.first is None


# ---------------------------------------------------------------- dispatch mode, misuse


def test_dispatch_mode_stack_empty_after_exit() -> None:
    m = M.clean_mlp()
    with nanhunt.trace(m):
        assert _get_current_dispatch_mode() is not None  # op level is active inside
        m(M.batch(2, 4))
    assert_no_mode()
    with nanhunt.trace(m, level="module"):
        assert _get_current_dispatch_mode() is None  # module level installs no mode
    assert_no_mode()


def test_user_dispatch_mode_outside_is_kept() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    m = M.clean_mlp()
    with Count() as mode:
        with nanhunt.trace(m) as t:
            m(M.batch(2, 4))
        assert _get_current_dispatch_mode() is mode
    assert seen, "the user's outer mode saw no op"
    assert_no_mode()
    assert t.first is None


def test_entering_twice_raises() -> None:
    m = M.clean_mlp()
    t = nanhunt.trace(m)
    with t:
        m(M.batch(2, 4))
    with pytest.raises(TraceStateError):
        with t:
            pass
    assert_no_mode()
    assert t.first is None  # the first run's results survive


def test_nested_enter_of_same_trace_raises() -> None:
    m = M.clean_mlp()
    t = nanhunt.trace(m)
    before = hook_counts(m)
    with t:
        with pytest.raises(TraceStateError):
            t.__enter__()
    assert hook_counts(m) == before
    assert_no_mode()


def test_reading_results_inside_block_raises() -> None:
    m = M.exp_overflow_mlp()
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 4))
        for attr in ("first", "origins", "path", "records"):
            with pytest.raises(TraceStateError, match="running"):
                getattr(t, attr)
    assert t.first is not None


def test_reading_results_before_start_raises() -> None:
    t = nanhunt.trace(M.clean_mlp())
    with pytest.raises(TraceStateError):
        t.first  # noqa: B018


def test_bad_level_raises_before_installing_anything() -> None:
    m = M.clean_mlp()
    before = hook_counts(m)
    with pytest.raises(ValueError, match=r"^level must be one of \('op', 'module'\), not 'ops'$"):
        nanhunt.trace(m, level="ops")
    assert hook_counts(m) == before


def test_level_given_as_text_is_held_as_the_member() -> None:
    from nanhunt.records import Level

    assert nanhunt.trace(M.clean_mlp(), level="module").level is Level.MODULE
    assert nanhunt.trace(M.clean_mlp(), level=Level.OP).level is Level.OP


def test_sequential_traces_are_independent() -> None:
    # GIVEN one trace of a faulty step, then one of a clean step on the same model
    m = M.clean_mlp()
    x = M.batch(2, 4)
    bad = x.clone()
    bad[0, 0] = math.nan
    with nanhunt.trace(m) as t1:
        m(bad).sum().backward()
    m.zero_grad()
    with nanhunt.trace(m) as t2:
        m(x).sum().backward()
    assert t1.first is not None and t2.first is None
    assert len(t2.records) <= len(t1.records)
