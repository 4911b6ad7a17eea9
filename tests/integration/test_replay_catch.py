"""The replay's second run catches and measures the culprit by its key (module, call, op, n-th): an input culprit
(no op) is measured by its index, an op whose phase the tracer relabels after it ran is still caught, and a hunt
under ranks never runs the step a third time on one rank only (collectives no other rank would join)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nanhunt.hunt.pipeline import hunt
from nanhunt.records import Phase, Repro
from nanhunt.hunt._twice import trace_twice
from nanhunt.step.step import Step
from nanhunt.tracing.tracer import Trace


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of the module on one torch thread (conftest's ``one_thread``)."""


class _BodyHead(nn.Module):
    """forward runs ``body``; the loss calls ``head`` (a submodule called after the model call)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_an_input_culprit_is_measured_in_full_by_the_second_run() -> None:
    # GIVEN a step whose batch holds one NaN (the culprit is the input: no op)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    step = Step(m, x, loss_fn=lambda out: out.sum(), dtype=torch.float32)
    # WHEN it is replayed at op level
    r = trace_twice(step)
    # THEN the reported culprit is the input, with its full counts (the report's "1 NaN of 12"); before: the
    # second run neither zoomed (zoom dropped when a culprit is caught) nor caught (no op): no counts
    first = r.final.first
    assert r.reproducible and first is not None
    assert (first.phase, first.module, first.op) == (Phase.INPUT, None, None)
    assert first.output.full is not None and first.output.full.nan == 1


def test_a_culprit_whose_phase_turns_forward_later_is_caught_by_the_second_run() -> None:
    # GIVEN a loss that takes log of the model's output (NaN born there), then calls the model's head: the
    # tracer relabels the log from loss to forward glue once the head call shows it made its argument
    m = _BodyHead()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return m.head(torch.log(out - 100.0)).sum()

    step = Step(m, torch.randn(3, 4), loss_fn=loss_fn, dtype=torch.float32)
    # WHEN it is replayed at op level
    r = trace_twice(step)
    first = r.final.first
    assert r.reproducible and first is not None
    assert (first.phase, first.module, first.op) == (Phase.FORWARD, None, "aten::log")
    # THEN the second run caught the log's call and measured it in full; before: its key said forward, the op ran
    # as loss, so nothing matched (no counts, and the repro needed a third run of the step)
    assert r.runs[1]._caught is not None
    assert first.output.full is not None and first.output.full.nan == 12


class _FakeRanks:
    """The one rank of a distributed replay that went first: its repro is made here (``make`` runs), as
    ``_dist_replay._Ranks.repro`` does on the maker while every other rank waits in a gather."""

    first_rank = 0

    def traced(self, final: Trace) -> None:
        pass

    def repro(self, make: Callable[[str], Repro | None], bundle: str) -> Repro | None:
        return make(bundle)

    def __getattr__(self, name: str) -> Any:  # the bisection's calls: not used (prove=False)
        raise AssertionError(f"unexpected call {name}")


def test_a_repro_under_ranks_never_runs_the_step_again(tmp_path: Path) -> None:
    # GIVEN a step whose two runs disagree (NaN from log in the first run, from sqrt in the second)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4))
    runs: list[int] = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        bad = torch.log(out - 100.0) if len(runs) == 1 else torch.sqrt(out - 100.0)
        return bad.sum()

    step = Step(m, torch.randn(3, 4), loss_fn=loss_fn, dtype=torch.float32)
    # WHEN it is hunted with a bundle as one rank of a distributed replay (the rank that makes the repro)
    report = hunt(step, bundle=str(tmp_path / "bundle"), ranks=_FakeRanks())  # type: ignore[arg-type]
    # THEN the step ran twice, not a third time on this rank alone: under torchrun that run's all-reduce /
    # all-gather meets the other ranks' gather of the repro (a hang until the process group's timeout)
    assert report.status == "not-reproducible"
    assert len(runs) == 2
