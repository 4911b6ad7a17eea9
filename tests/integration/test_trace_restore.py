"""Tracing a step at a breakpoint(): with restore=True the script's own step afterwards is the one it was about to
run (same dropout masks, same gradients, same weights); without it, the trace says so at a debugger's prompt."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 2))


def _train(steps: int, *, probe_at: int | None, restore: bool) -> list[float]:
    """A short loop with dropout and BatchNorm; at step ``probe_at`` the step is first traced by hand (forward,
    backward, no optimizer step), as a user does at a breakpoint, then the loop goes on."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        if i == probe_at:
            with nanhunt.trace(model, restore=restore) as t:
                F.mse_loss(model(x), y).backward()
            assert t.first is None
        opt.zero_grad(set_to_none=False) if i == probe_at else None  # a loop that zeroes before its backward
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_restoring_trace_leaves_the_scripts_own_steps_as_they_were() -> None:
    plain = _train(5, probe_at=None, restore=False)
    # GIVEN the same loop traced by hand at step 2 with restore=True
    traced = _train(5, probe_at=2, restore=True)
    # THEN every loss is the same to the bit: the dropout draws, BatchNorm's running stats and the grads came back
    assert [x.hex() for x in traced] == [x.hex() for x in plain]
    # AND without restore the run moved (the check above is not vacuous)
    assert [x.hex() for x in _train(5, probe_at=2, restore=False)] != [x.hex() for x in plain]


def test_restore_puts_back_also_when_the_block_raises() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    with pytest.raises(ValueError), nanhunt.trace(model, restore=True):
        F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        raise ValueError("the user's own error")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.subprocess
def test_a_trace_at_a_debuggers_prompt_says_what_it_changed(tmp_path: Path) -> None:
    # GIVEN a script stopped at breakpoint(), where the user traces the step by hand
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch, torch.nn.functional as F, nanhunt
        model = torch.nn.Linear(4, 2)
        x, y = torch.randn(3, 4), torch.randn(3, 2)
        breakpoint()
        """))
    commands = ("with nanhunt.trace(model) as t: F.mse_loss(model(x), y).backward()\n"
                "with nanhunt.trace(model, restore=True) as t: F.mse_loss(model(x), y).backward()\nc\n")
    done = subprocess.run([sys.executable, "-W", "always", str(script)], input=commands, capture_output=True,
                          text=True, timeout=300)
    out = done.stdout + done.stderr
    # THEN the plain trace warns once that the script's own step now starts from the changed state; the
    # restoring one does not
    assert out.count("this trace ran the step inside its block, at a debugger's prompt") == 1, out
    assert "restore=True" in out
