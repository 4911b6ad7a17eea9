"""What the Guard adds to a clean step, counted in torch ops (not timed): on the CPU it reads its scalars and
computes nothing of its own; a sampled step reduces each output and gradient in one pass, no inf-norm."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanhunt.guard._headroom import READ_STEPS
from tests._support.guard import batch, guard_for, mlp_setup, train_step


class _Ops(TorchDispatchMode):
    """Counts the aten ops run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _ops_of(dump: Path | None, steps: int, **guard_kw: Any) -> Counter[str]:
    """The ops of ``steps`` clean float16 + GradScaler steps after a first one (which makes the scale and the
    optimizer's state), from a fresh model: guarded, or plain where ``dump`` is None."""
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = None if dump is None else guard_for(model, opt, scaler, dump, **guard_kw)
    counted = _Ops()
    for i in range(steps + 1):
        with counted if i else _Ops():
            if guard is None:
                _plain_step(model, opt, scaler, batch(i))
            else:
                train_step(guard, model, opt, scaler, batch(i))
    assert guard is None or guard.events == []
    return counted.ops


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                b: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = b
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(opt)
    scaler.update()


def test_a_clean_cpu_step_only_reads_its_scalars(tmp_path: Path) -> None:
    # GIVEN the same clean float16 + GradScaler loop, plain and guarded (no headroom history)
    plain = _ops_of(None, 3)
    guarded = _ops_of(tmp_path, 3, headroom_every=None)
    # THEN per step the Guard adds four reads of CPU scalars (the scale and growth tracker at entry, GradScaler's
    # found_inf and the loss in check_grads) and the detached view of the loss it keeps, and no op that computes:
    # no copy of the scaler state, no flag made of the loss, no stack or conversion to gather them
    assert guarded - plain == Counter({"_local_scalar_dense": 4 * 3, "detach": 3})
    assert plain - guarded == Counter()


def test_a_sampled_step_reduces_each_output_and_gradient_in_one_pass(tmp_path: Path) -> None:
    # GIVEN the same clean loop guarded without the headroom history and sampling it at every step
    unsampled = _ops_of(tmp_path / "none", 3, headroom_every=None)
    sampled = _ops_of(tmp_path / "every", 3, headroom_every=1)
    # THEN each output and output gradient of the 4 modules (the model and its 3 layers) is reduced by one aminmax,
    # and nothing takes an inf-norm; a step's extremes are one stack, written into the buffer at the window's read
    # (none in these steps): besides the hooks' detached views, that is all a sampled step adds
    assert sampled - unsampled == Counter({"aminmax": 3 * 8, "detach": 3 * 8, "stack": 3})
    assert unsampled - sampled == Counter()


def test_the_window_holds_each_modules_largest_magnitude_exactly(tmp_path: Path) -> None:
    # GIVEN a Guard sampling every step, and the modules' outputs and output gradients kept aside
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path, headroom_every=1)
    seen: dict[tuple[str, str], list[torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def fwd(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen.setdefault(("output", name), []).append(out.detach().clone())
            out.register_hook(lambda g: seen.setdefault(("output gradient", name), []).append(g.clone()))
        return fwd

    for name, mod in model.named_children():
        mod.register_forward_hook(keep(name))
    # WHEN four steps run and the window is read
    for i in range(4):
        train_step(guard, model, opt, scaler, batch(i))
    watch = guard._watch
    assert len(watch._rows) == 4 < READ_STEPS
    watch.read()
    # THEN each module's history holds what a float32 inf-norm of its output (gradient: unscaled) gives, exactly
    for (cond, name), ts in seen.items():
        kept = [v for _, v, _ in watch.history[(cond, watch.names.index(name))]]
        scale = 1024.0 if cond == "output gradient" else 1.0
        norms = [float(torch.linalg.vector_norm(t, math.inf, dtype=torch.float32)) for t in ts]
        assert kept == [math.log2(v / scale) for v in norms], (cond, name)
