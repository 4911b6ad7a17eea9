"""Make ``tests/models.py`` (the fixture models) importable as ``models``; fixtures shared by every test directory."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# The suite's own packages (tests/models.py as ``models``, ``fixtures``, ``tests``) are trusted as a team trusts its
# own: captures of their classes replay without --model (subprocesses inherit it). tests/security/test_names.py
# removes it to test the rule as a user meets it.
os.environ["NANHUNT_TRUST_NAMES"] = "models,fixtures,tests"


@pytest.fixture()
def one_thread() -> Iterator[None]:
    """One torch thread for the test (timing-free, but half-precision kernels and snapshots behave alike on any
    machine), the previous count back afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture()
def snapshots(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every ``nanhunt.step.step.StepState`` made while the test runs."""
    from nanhunt.step import step as step_module

    made: list[Any] = []
    init = step_module.StepState.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(step_module.StepState, "__init__", counting)
    yield made


@pytest.fixture(scope="session")
def warm_tracer() -> None:
    """The first trace and optimizer step of a process pay a one-off set-up (~1.5 s): not any test's time."""
    import torch
    from torch import nn

    import nanhunt

    m = nn.Linear(2, 1)
    opt = torch.optim.LBFGS(m.parameters(), max_iter=1)

    def closure() -> torch.Tensor:
        loss = m(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    with nanhunt.trace(m):
        opt.step(closure)
