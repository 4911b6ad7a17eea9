"""The Lightning callback under DDP: a real 2-process Lightning run (torchrun, gloo on the CPU) where
only rank 1's weights turn inf: both ranks stop at the same optimizer step, only rank 1 writes its capture, and
the capture replays on one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanhunt.cli import main as cli_main

pytest.importorskip("lightning.pytorch")

from tests._support.dist import torchrun  # noqa: E402
from tests.integration.test_lightning_callback import STEP  # noqa: E402

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_two_lightning_ranks_stop_together_and_the_rank_that_saw_it_writes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a Lightning DDP run on 2 processes where only rank 1's fc1 bias turns inf as step 3 begins
    # WHEN it trains (bounded: a rank left waiting in a collective would hang)
    proc = torchrun([str(Path(__file__).with_name("ddp_lightning_worker.py")), str(tmp_path)], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # THEN both ranks stop at step 3, both know rank 1 saw it (weights non-finite as the step began: "params"),
    # and only rank 1 writes
    for r, rr in enumerate(res):
        ev = rr["event"]
        assert (rr["world"], rr["result"], rr["global_step"]) == (2, "stopped", STEP)
        assert (ev["step"], ev["rank"], ev["ranks"], ev["kind"]) == (STEP, r, [1], "params")
    assert sorted(p.name for p in (tmp_path / "nan").iterdir()) == [
        "step000003-rank1-batch.pt", "step000003-rank1-checkpoint.pt", "step000003-rank1-event.json"]
    # AND rank 1's capture replays in one process through training_step, naming the inf bias's module
    ev = res[1]["event"]
    code = cli_main(["replay", ev["checkpoint"], ev["batch"], *ev["replay_args"], "--no-bisect"])
    first = capsys.readouterr().out.splitlines()[0]
    assert code == 1
    assert first == "Inf born in phase weights, in fc1 (Linear, call 0) (param).", first
