"""StepState's disk snapshot keeps the .grad tensors it cannot resize to nothing and back where they are (a numpy
array's memory, shared memory after ``model.share_memory()``, a tensor the optimizer state holds too), and puts
them back on their parameters when a restore fails half way: same objects, same values, no crash."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nanhunt.step.step import StepState

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="disk snapshot: Linux")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of the module on one torch thread (conftest's ``one_thread``)."""


def test_a_grad_in_a_numpy_array_s_memory_stays_on_its_parameter(tmp_path: Path) -> None:
    # GIVEN a parameter whose 2 MiB .grad is a numpy array's memory (a storage torch cannot resize)
    m = nn.Linear(512, 1024)
    g = torch.from_numpy(np.full((1024, 512), 0.5, dtype=np.float32))
    m.weight.grad = g
    # WHEN a disk snapshot of the model is entered and left
    with StepState(m, snapshot="disk", directory=str(tmp_path)):
        pass
    # THEN the parameter holds the same .grad object, its values intact (before: entering raised
    # "Trying to resize storage that is not resizable" and the .grad was left None)
    assert m.weight.grad is g
    assert bool((g == 0.5).all())


@pytest.mark.subprocess
def test_grads_in_shared_memory_survive_a_disk_snapshot(tmp_path: Path) -> None:
    # GIVEN a model whose grads live in shared memory (model.share_memory(): Hogwild, torch.multiprocessing)
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        from nanhunt.step.step import StepState
        torch.set_num_threads(1)
        m = nn.Linear(512, 1024)
        m(torch.ones(2, 512)).sum().backward()
        m.share_memory()
        g = m.weight.grad
        want = g.clone()
        with StepState(m, snapshot="disk", directory={str(tmp_path)!r}) as state:
            state.reset()
            m(torch.ones(2, 512)).sum().backward()
        assert m.weight.grad is g and torch.equal(g, want)
        print("ok")
    """)
    # WHEN a disk snapshot is entered, a step runs, and the snapshot is left (in a child: it crashed)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    # THEN the process lives and the grad is back (before: SIGSEGV regrowing the shared storage)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "ok"

def test_a_restore_failing_half_way_leaves_the_grads_on_their_parameters(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from nanhunt.step import snapshot as step_module

    # GIVEN a parameter with a 2 MiB .grad, spilled to the disk snapshot on entry
    m = nn.Linear(512, 1024)
    m(torch.ones(2, 512)).sum().backward()
    g = m.weight.grad
    assert g is not None
    want, nbytes = g.clone(), g.untyped_storage().nbytes()
    # AND a restore that fails after the weights are back, before the RNG is (any error half way: an optimizer
    # state entry that cannot be allocated on its device, say)
    real = step_module.set_rng_state
    calls: list[int] = []

    def fails_once(state: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("restore failed half way")
        real(state)  # type: ignore[arg-type]

    monkeypatch.setattr(step_module, "set_rng_state", fails_once)
    # WHEN the snapshot is left and its restore raises
    with pytest.raises(RuntimeError, match="half way"):
        with step_module.StepState(m, snapshot="disk", directory=str(tmp_path)):
            pass
    # THEN the .grad is back on its parameter, its memory and values too (before: .grad None, and the tensor the
    # user may still hold has a storage of 0 bytes: reading it crashes the process). Not read unless regrown.
    assert g.untyped_storage().nbytes() == nbytes, "the grad's storage was left at 0 bytes"
    assert m.weight.grad is g
    assert torch.equal(g, want)


@pytest.mark.subprocess
def test_a_grad_the_optimizer_state_also_holds_survives_a_disk_snapshot(tmp_path: Path) -> None:
    # GIVEN an optimizer that keeps the last gradient in its state by reference (set_to_none gives a fresh
    # tensor each step, so no copy is needed): one tensor is both a .grad and an optimizer state entry
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        from nanhunt.step.step import StepState
        torch.set_num_threads(1)
        m = nn.Linear(512, 1024)

        class KeepsGrad(torch.optim.SGD):
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            self.state[p]["prev_grad"] = p.grad
                return super().step(closure)

        opt = KeepsGrad(m.parameters(), lr=0.1)
        m(torch.ones(2, 512)).sum().backward()
        opt.step()
        g = m.weight.grad
        assert opt.state[m.weight]["prev_grad"] is g
        want = g.clone()
        with StepState(m, optimizer=opt, snapshot="disk", directory={str(tmp_path)!r}) as state:
            state.reset()
            m(torch.ones(2, 512)).sum().backward()
        assert m.weight.grad is g and torch.equal(g, want)
        assert torch.equal(opt.state[m.weight]["prev_grad"], want)
        print("ok")
    """)
    # WHEN a disk snapshot is entered, reset and left (in a child: it crashes)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    # THEN the process lives (before: SIGSEGV in reset(): the optimizer state entry is the spilled .grad, its
    # storage resized to 0 bytes, and restore copies the saved state into it)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "ok"
