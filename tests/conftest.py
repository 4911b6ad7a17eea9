"""Fixtures shared by every test directory; the suite's own packages trusted as a team trusts its own."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

# The suite's own packages (``fixtures``, ``tests``) are trusted as a team trusts its own: captures of their
# classes replay without --model (subprocesses inherit it). tests/security/test_names.py removes it to test the
# rule as a user meets it.
os.environ["NANHUNT_TRUST_NAMES"] = "fixtures,tests"


class ProcessWatch:
    """The Python processes started while it is on (:meth:`on` ... :meth:`off`): a ``subprocess`` command
    whose program is a Python interpreter, or a multiprocessing process. Other programs (``uname`` for the
    report's environment) are no Python process and not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: list[str] = []
        self._monkeypatch = monkeypatch

    def on(self) -> None:
        import multiprocessing.process
        import subprocess

        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start
        watch = self

        def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
            argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
            if argv and (os.path.basename(argv[0]).startswith("python") or argv[0] == sys.executable):
                watch.started.append(" ".join(argv[:4]))
            popen_init(self, args, *rest, **kwargs)

        def start(self: multiprocessing.process.BaseProcess) -> None:
            watch.started.append(f"a multiprocessing process of {getattr(self, '_target', None)!r}")
            process_start(self)

        self._monkeypatch.setattr(subprocess.Popen, "__init__", popen)
        self._monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)

    def off(self) -> list[str]:
        self._monkeypatch.undo()
        return self.started


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that starts a Python process (itself or through nanhunt: a bundle's repro is verified in a fresh
    interpreter) fails unless it is marked ``subprocess`` or ``distributed``: ``./scripts/test --fast`` leaves
    those out. tests/unit/test_tiers.py checks the same from the source, for tests a run does not reach."""
    if request.node.get_closest_marker("subprocess") or request.node.get_closest_marker("distributed"):
        yield
        return
    watch = ProcessWatch(pytest.MonkeyPatch())
    watch.on()
    try:
        yield
    finally:
        started = watch.off()
    assert not started, (f"{request.node.nodeid} starts Python processes ({'; '.join(started[:3])}) "
                         "without @pytest.mark.subprocess")


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
