"""A Guard's capture whose replay stays finite: the replay says it did not reproduce the failure (exit 3), what a
capture cannot hold, and how to check; ``--repeat N`` replays it N times."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.cli import main as cli_main
from nanhunt.records import GuardEvent, Report

ROOT = Path(__file__).resolve().parents[2]
D = 8


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


class Switched(nn.Module):
    """``fc(x) * scale``: ``scale`` is a plain attribute (no parameter, no buffer), which no capture holds. The
    loop sets it to inf for one step; the model rebuilt from the capture has 1.0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


CALLS = [0]  # Counted's forward calls: state outside the model, as a global


class Counted(nn.Module):
    """Overflows at every third forward call (1-based), as a flaky kernel would now and then: 3e38 * 2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS[0] += 1
        h = self.fc(x)
        return h + torch.full_like(h, 3e38) * 2.0 if CALLS[0] % 3 == 0 else h


def _stopped(model: nn.Module, dump: Path, *, bad: int = 2) -> GuardEvent:
    """Train ``model`` with a Guard until it stops (at step ``bad``, a non-finite loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nanhunt.Guard(model, opt, None, dump_dir=dump, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(bad + 2):
            x, y = torch.randn(4, D, generator=g), torch.randn(4, 4, generator=g)
            if isinstance(model, Switched):
                model.scale = math.inf if i == bad else 1.0
            with guard.step((x, y)):
                opt.zero_grad()
                loss = guard.loss(F.mse_loss(model(x), y))
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev.step, ev.kind, ev.captured_step, ev.pre_update) == (bad, "loss", bad, True)
    return ev


def _replay(ev: GuardEvent, factory: str, tmp_path: Path, *more: str) -> tuple[int, Report, str]:
    out = tmp_path / "report.json"
    assert ev.checkpoint is not None and ev.batch is not None
    code = cli_main(["replay", ev.checkpoint, ev.batch, "--model", factory, "--report", str(out), *more])
    return code, Report.from_json(out.read_text()), out.read_text()


def test_a_guard_capture_that_replays_finite_is_not_reproducible(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a run the Guard stopped at step 2 with a non-finite loss that came from a module attribute no capture
    # holds
    torch.manual_seed(0)
    ev = _stopped(Switched(), tmp_path / "nan")
    capsys.readouterr()
    # WHEN its capture is replayed
    code, rep, _ = _replay(ev, f"{__name__}:Switched", tmp_path)
    out = capsys.readouterr().out
    # THEN it is not called clean: exit 3, the verdict not-reproducible after one finite replay, saying what the
    # capture cannot hold and how to check
    assert code == 3, out
    assert rep.status == "not-reproducible" and rep.runs == (None, None) and rep.first is None
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.replays) == ("not-reproducible", 1)
    assert rep.guard_event is not None and rep.guard_event.step == 2
    text = " ".join(out.split())
    assert text.startswith("Not reproducible: the Guard saw step 2 fail (non-finite loss), but the replay of its "
                           "capture stayed finite (1 replay).")
    for said in ("a module attribute that is not a buffer", "non-deterministic kernels", "--repeat N",
                 "snapshot_every"):
        assert said in text, said


def test_a_guard_capture_that_replays_finite_with_no_bisect_is_not_reproducible(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    ev = _stopped(Switched(), tmp_path / "nan")
    code, rep, _ = _replay(ev, f"{__name__}:Switched", tmp_path, "--no-bisect", "--repeat", "3")
    assert code == 3
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.replays) == ("not-reproducible", 3)
    assert "stayed finite (3 replays)" in " ".join(capsys.readouterr().out.split())


def test_repeat_finds_a_failure_that_comes_now_and_then(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a model non-finite at every third forward call, stopped by the Guard at step 2 (its third call)
    CALLS[0] = 0
    torch.manual_seed(0)
    ev = _stopped(Counted(), tmp_path / "nan")
    # WHEN replayed once (calls 1 and 2: finite)
    CALLS[0] = 0
    code, rep, _ = _replay(ev, f"{__name__}:Counted", tmp_path, "--no-bisect")
    # THEN not reproducible
    assert (code, rep.status, rep.runs) == (3, "not-reproducible", (None, None))
    # WHEN replayed up to 3 times: the second replay's first run is call 3
    CALLS[0] = 0
    capsys.readouterr()
    code, rep, _ = _replay(ev, f"{__name__}:Counted", tmp_path, "--no-bisect", "--repeat", "3")
    out = " ".join(capsys.readouterr().out.split())
    # THEN its two runs disagree, the non-finite one names where it was born, and a note says which replay it was
    assert code == 3 and rep.status == "not-reproducible"
    a, b = rep.runs
    assert a is not None and b is None and (a.phase.value, a.module, a.op) == ("forward", "", "aten::mul")
    said = "replay 2 of up to 3 was not finite: the one before it was (the step does not always fail)"
    assert said in rep.notes and said in out


@pytest.mark.parametrize("argv, said", [
    (["--repeat", "0"], "--repeat 0: replay at least once (--repeat 1, the default)"),
    (["--repeat", "x"], "argument --repeat: invalid int value: 'x'"),
])
def test_repeat_must_be_a_positive_count(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                         said: str) -> None:
    torch.manual_seed(0)
    ev = _stopped(Switched(), tmp_path / "nan")
    capsys.readouterr()
    assert ev.checkpoint is not None and ev.batch is not None
    assert cli_main(["replay", ev.checkpoint, ev.batch, "--model", f"{__name__}:Switched", *argv]) == 2
    assert said in capsys.readouterr().err


def test_a_capture_whose_event_lists_other_ranks_stays_clean(tmp_path: Path) -> None:
    # GIVEN rank 0's files of a step every rank saw fail: what rank 0 saw may have come through a collective
    torch.manual_seed(0)
    ev = _stopped(Switched(), tmp_path / "nan")
    assert ev.checkpoint is not None
    event_file = Path(ev.checkpoint[: -len("checkpoint.pt")] + "event.json")
    event = json.loads(event_file.read_text())
    event.update(rank=0, ranks=[0, 1])
    event_file.write_text(json.dumps(event))
    # WHEN replayed THEN it is clean: the note on other ranks (the CLI's) says whose capture to replay instead
    code, rep, _ = _replay(ev, f"{__name__}:Switched", tmp_path, "--no-bisect")
    assert (code, rep.status, rep.verdict) == (0, "clean", None)


def test_a_snapshot_capture_that_replays_finite_says_it_is_an_earlier_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture whose event says it is the last good snapshot, the start of step 1, before a failure at 2
    torch.manual_seed(0)
    ev = _stopped(Switched(), tmp_path / "nan")
    assert ev.checkpoint is not None
    event_file = Path(ev.checkpoint[: -len("checkpoint.pt")] + "event.json")
    event = json.loads(event_file.read_text())
    event.update(captured_step=1, pre_update=False)
    event_file.write_text(json.dumps(event))
    capsys.readouterr()
    # WHEN replayed THEN not reproducible, and the verdict says why: one step from an earlier start
    code, rep, _ = _replay(ev, f"{__name__}:Switched", tmp_path, "--no-bisect")
    out = " ".join(capsys.readouterr().out.split())
    assert (code, rep.status) == (3, "not-reproducible")
    assert ("verdict: Not reproducible: 1 replay of the capture stayed finite. The capture is the Guard's last good "
            "snapshot, the start of step 1: a replay runs that one step, not the steps up to step 2's failure. With "
            "the Guard's snapshot_every=1 the capture is the start of the failing step itself.") in out
