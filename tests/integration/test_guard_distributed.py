"""nanhunt.Guard under torch.distributed (gloo, 2 processes on the CPU): all ranks stop together."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

import nanhunt
from nanhunt.capture.capture import load_step

from tests._support.guard import dist_worker
from tests._support.dist import rank_results, run_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


def test_only_rank1_goes_nonfinite_both_ranks_stop_and_rank1_writes_the_capture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    dump, out = tmp_path / "caps", tmp_path / "out"
    out.mkdir()
    # GIVEN two gloo ranks training the same model; only rank 1's batch at step 3 overflows float16
    # WHEN they run, bounded by a timeout: a rank left waiting in a collective would hang here
    run_ranks(dist_worker, lambda r, port: (r, 2, port, str(dump), str(out), 1, 3), timeout=TIMEOUT_S)
    results = rank_results(out)
    # THEN both ranks stopped at step 3, both know rank 1 saw it first, and they met again afterwards
    for r, res in results.items():
        assert res["stopped_at"] == 3 and res["iterations"] == 4
        ev = res["event"]
        assert (ev["step"], ev["kind"], ev["rank"], ev["ranks"]) == (3, "loss", r, [1])
        assert res["after"] == 2.0
    assert results[0]["event"]["checkpoint"] is None
    # AND the only capture is rank 1's, and it replays to the origin
    assert sorted(os.listdir(dump)) == ["step000003-rank1-batch.pt", "step000003-rank1-checkpoint.pt",
                                        "step000003-rank1-event.json"]
    step = load_step(str(dump / "step000003-rank1-checkpoint.pt"), str(dump / "step000003-rank1-batch.pt"))
    rep = nanhunt.replay(step.model, (step.inputs, step.targets), loss_fn=step.loss_fn, dtype=step.dtype,
                         scaler=step.scaler, optimizer=step.optimizer, rng=step.rng)
    assert rep.first is not None and (rep.first.phase.value, rep.first.module) == ("forward", "fc1")
