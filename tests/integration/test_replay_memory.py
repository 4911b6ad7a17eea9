"""Replay and bisection keep one snapshot of the step's state; with ``host_snapshot`` (the default for a model
on an accelerator) that snapshot lives in host memory, pinned under CUDA, and is restored in place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt.hunt.pipeline import hunt
from nanhunt.step.step import Step, StepState


class _Block(nn.Module):
    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x * self.gain))


def _blocks(n: int = 6, culprit: int = 4, device: str = "cpu") -> nn.Sequential:
    """Residual blocks; block ``culprit`` scales its input past float16's range before its matmul."""
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(8, 1e6 if i == culprit else 1.0) for i in range(n))).to(device)


def _trained_step(device: str = "cpu", **kw: Any) -> Step:
    """Mid-training: AdamW moments and a grown GradScaler scale, one planted culprit."""
    model = _blocks(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8)
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    for _ in range(2):  # finite steps (the culprit off) give the optimizer state
        model[4].gain = 1.0
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    model[4].gain = 1e6
    opt.zero_grad(set_to_none=True)
    return Step.of(model, (x, y), loss_fn=F.mse_loss, dtype=torch.float16, scaler=scaler, optimizer=opt, **kw)


def _state_of(step: Step) -> list[torch.Tensor]:
    """Every tensor the step can change, copied: parameters, buffers, optimizer state, scaler state."""
    assert step.optimizer is not None and step.scaler is not None
    out = [t.detach().clone() for t in (*step.model.parameters(), *step.model.buffers())]
    for s in step.optimizer.state.values():
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out + [step.scaler._scale.clone(), step.scaler._growth_tracker.clone()]  # type: ignore[union-attr]


def _bit_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a, b))


def test_replay_and_bisection_take_one_snapshot(snapshots: list[StepState]) -> None:
    # GIVEN a float16 step with AdamW and a GradScaler whose block 4 overflows
    step = _trained_step()
    n_tensors = len(_state_of(step)) - 2  # the scaler's two scalars are no parameter, buffer or moment
    # WHEN it is replayed and bisected (two traced runs, the bisection's trials, the float32 control)
    report = hunt(step, prove=True)
    # THEN the verdict names the culprit block
    assert report.verdict is not None and report.verdict.kind == "precision"
    assert report.verdict.culprits == ("4.fc",)
    assert report.verdict.replays > 2
    # AND exactly one snapshot was taken, holding one copy of each parameter, buffer and optimizer tensor
    assert len(snapshots) == 1
    state = snapshots[0]
    assert state.opt_state is not None
    copies = [c for _, c in state.values] + [v for s in state.opt_state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor)]
    assert len(copies) == n_tensors == 6 * 4 + 6 * 4 * 2 + 6 * 4  # weights, biases, LayerNorm x2; exp_avg(_sq), step
    assert len({id(c) for c in copies}) == n_tensors


def test_a_cpu_step_keeps_its_snapshot_where_it_is(snapshots: list[StepState]) -> None:
    # GIVEN a step on the CPU (host and device are one memory)
    step = _trained_step()
    # WHEN it is replayed
    hunt(step)
    # THEN its snapshot is a plain clone: no host copy was made
    assert len(snapshots) == 1 and snapshots[0].homes == {}


def test_host_snapshot_restores_bit_identical(snapshots: list[StepState]) -> None:
    # GIVEN a step whose snapshot is forced into host memory (the code path of a model on an accelerator)
    step = _trained_step(host_snapshot=True)
    before = _state_of(step)
    # WHEN it is replayed and bisected (trials that run the update change the weights and the moments)
    report = hunt(step, prove=True)
    # THEN the culprit is the same as with an in-place snapshot
    assert report.verdict is not None and report.verdict.culprits == ("4.fc",)
    # AND the snapshot went through the host path: every parameter, buffer and optimizer tensor was copied there
    state = snapshots[0]
    assert len(state.homes) == len(before) - 2
    assert all(d == torch.device("cpu") for d in state.homes.values())
    # AND the model, optimizer and scaler are back bit for bit
    assert _bit_identical(_state_of(step), before)


def test_host_snapshot_puts_back_optimizer_state_the_step_replaced() -> None:
    # GIVEN a host snapshot of a step whose optimizer state is then replaced by tensors of another shape
    step = _trained_step()
    assert step.optimizer is not None
    before = _state_of(step)
    with StepState(step.model, step.optimizer, step.scaler, host=True) as state:
        p = next(iter(step.optimizer.state))
        step.optimizer.state[p]["exp_avg"] = torch.zeros(3)
        # WHEN it is restored
    # THEN the entry is a new tensor with the saved values, on the parameter's device, not the host copy itself
    restored = step.optimizer.state[p]["exp_avg"]
    assert restored.shape == p.shape and restored.device == p.device
    assert state.opt_state is not None and restored is not state.opt_state[p]["exp_avg"]
    assert _bit_identical(_state_of(step), before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_snapshot_lives_in_pinned_host_memory(snapshots: list[StepState]) -> None:
    # GIVEN a float16 step on CUDA
    step = _trained_step("cuda")
    before = _state_of(step)
    # WHEN it is replayed and bisected
    report = hunt(step, prove=True)
    assert report.verdict is not None and report.verdict.culprits == ("4.fc",)
    # THEN the one snapshot's parameter, buffer and optimizer copies are in pinned host memory
    state = snapshots[0]
    assert len(snapshots) == 1 and state.opt_state is not None
    copies = [c for _, c in state.values] + [v for s in state.opt_state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor)]
    assert copies and all(c.device.type == "cpu" and c.is_pinned() for c in copies)
    # AND the state is restored bit for bit on the device
    after = _state_of(step)
    assert all(t.device.type == "cuda" for t in after)
    assert _bit_identical([t.cpu() for t in after], [t.cpu() for t in before])
