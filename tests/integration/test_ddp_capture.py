"""The Guard's capture directory under DDP (two gloo processes on the CPU): every rank writes its batch and the
replicated state once (DCP), ``nanhunt replay DIR`` replays the failing rank's batch in one process, and
``torchrun --nproc-per-node 2 -m nanhunt replay DIR`` replays the step as it ran, each rank its own batch under
DDP again (its gradient all-reduce included), naming the rank that went first. One distributed run serves the
module's tests."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fixtures.models  # noqa: F401  the capture's model class, imported as a replay of it would find it
from nanhunt.cli import main
from nanhunt.records import Report

from .fsdp_guard_worker import batch, run
from tests._support.dist import rank_results, run_ranks, torchrun

ROOT = Path(__file__).resolve().parents[2]
BAD_RANK, BAD_STEP = 1, 2

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    """(dump dir, out dir, each rank's result) of one 2-rank DDP run whose rank 1 overflows at step 2."""
    base = tmp_path_factory.mktemp("ddp")
    dump, out = base / "caps", base / "out"
    out.mkdir()
    run_ranks(run, lambda r, port: (r, 2, port, str(dump), str(out), BAD_RANK, BAD_STEP, "ddp"), timeout=120)
    return dump, out, rank_results(out)


def test_both_ranks_stop_and_write_one_capture_directory(ddp_run: tuple[Path, Path, dict[int, dict[str, Any]]]) -> None:
    # GIVEN two DDP ranks of which only rank 1's batch at step 2 overflows bfloat16
    dump, _, results = ddp_run
    cap = dump / "step000002"
    # THEN both stopped at step 2, know rank 1 saw it, and name the one directory they wrote
    for r, res in results.items():
        assert "error" not in res, res.get("error")
        assert (res["stopped_at"], res["iterations"], res["after"]) == (2, 3, 2.0)
        ev = res["event"]
        assert (ev["step"], ev["kind"], ev["rank"], ev["ranks"], ev["pre_update"]) == (2, "loss", r, [1], True)
        assert (ev["checkpoint"], ev["batch"], ev["capture_error"]) == (str(cap), None, None)
    assert os.listdir(dump) == ["step000002"]
    assert sorted(os.listdir(cap)) == ["batch-rank0.pt", "batch-rank1.pt", "event-rank0.json", "event-rank1.json",
                                       "manifest.json", "state"]
    man = json.loads((cap / "manifest.json").read_text())
    # AND the manifest says DDP, with the options a replay under torchrun wraps the model with again
    assert (man["world_size"], man["wrapper"], man["ranks_seen"], man["step"], man["model_factory"]) == (
        2, "ddp", [1], 2, "fixtures.models:MLP")
    assert man["ddp"] == {"find_unused_parameters": False, "gradient_as_bucket_view": False, "static_graph": False}
    assert "fsdp" not in man


def test_replay_dir_in_one_process_holds_the_step_and_names_the_culprit(
        ddp_run: tuple[Path, Path, dict[int, dict[str, Any]]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    from nanhunt.capture.capture import load_capture_dir

    cap = ddp_run[0] / "step000002"
    # GIVEN the capture WHEN it is loaded THEN it holds exactly the replicas' state the failing step began with
    step = load_capture_dir(cap)
    full = torch.load(ddp_run[1] / "full-state.pt", weights_only=True)
    own = step.model.state_dict()
    assert sorted(own) == sorted(full) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert all(torch.equal(own[k], full[k]) for k in full)
    x, y = batch(BAD_RANK, BAD_STEP, big=True)
    assert torch.equal(step.inputs, x) and torch.equal(step.targets, y)
    # WHEN the command the Guard printed replays it in one process
    command = ddp_run[2][0]["describe"].rpartition(": ")[2]
    report = tmp_path / "r.json"
    assert main([*shlex.split(command)[1:], "--report", str(report)]) == 1
    err = capsys.readouterr().err
    rep = Report.from_json(report.read_text())
    # THEN rank 1's batch overflows fc1's bfloat16 matmul, and the replay says whose batch it was
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "forward", "fc1", "aten::addmm", "inf")
    assert "capture of 2 ranks (ddp): rank 1's batch replayed (the first rank that saw the failure)" in err


def test_torchrun_replay_runs_the_step_under_ddp_and_names_the_rank_that_went_first(
        ddp_run: tuple[Path, Path, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    cap = ddp_run[0] / "step000002"
    # GIVEN the DDP capture WHEN it is replayed under torchrun on two ranks (torchrun's own 0.1 s poll), and rank 0
    # gets torchrun's SIGTERM after it returned from nanhunt's main, as when rank 1 exits first and rank 0 is still
    # tearing down (on a loaded machine, now and then; here every time)
    report, bundle = tmp_path / "r.json", tmp_path / "bundle"
    proc = torchrun([str(Path(__file__).with_name("replay_then_sigterm_worker.py")), "replay", str(cap), "--model",
                     "fixtures.models:MLP", "--report", str(report), "--bundle", str(bundle)], cwd=ROOT)
    # THEN every rank exits with the code they agreed on once rank 0 had shown and written everything: 1, non-finite
    # (before: rank 0 ended by the signal, -15)
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s*: (\d) \(local_rank.*\n\s*exitcode\s*: (-?\d+)", proc.stderr)}
    assert proc.returncode == 1 and codes == {0: 1, 1: 1}, proc.stderr[-3000:]
    rep = Report.from_json(report.read_text())
    # THEN the report is rank 1's: fc1's matmul overflowed, and rank 0 received it through DDP's all-reduce
    assert rep.first is not None
    assert (rep.status, rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "nonfinite", "forward", "fc1", "aten::addmm", "inf")
    # AND measured in full, with the shapes the op read, though DDP's second run records more ops than its first
    # (it rebuilds its buckets), so the first run's record indices are not the second's
    out = rep.first.output
    assert out.full is not None and out.full.posinf == 4 * 32 and out.full.numel == 4 * 32
    assert out.input_shapes == ((32,), (4, 64), (64, 32))
    assert [r.full is not None for r in rep.first.inputs] == [True, True, True]
    assert rep.notes[0] == ("capture of 2 ranks (ddp) replayed on 2 ranks under torchrun, each rank its own batch "
                            "and RNG state")
    assert rep.notes[1].startswith("rank 1 went first: the report is its replay; rank 1: Inf born in phase forward, "
                                   "module fc1 ")
    assert "rank 0 received it through" in rep.notes[1]
    assert proc.stdout.count("Inf born in phase forward, in fc1 ") == 1
    # AND the bisection ran its trials on both ranks to the same verdict as the one-process replay of rank 1's batch
    assert rep.verdict is not None and rep.verdict.kind == "not-precision"
    # AND the bundle holds a verified repro of the culprit op, made by rank 1 (its batch overflowed), written by rank 0
    assert rep.repro is not None and rep.repro.verified, rep.repro
    assert (rep.repro.op, rep.repro.autocast_dtype) == ("aten::addmm", "bfloat16")
    assert sorted(os.listdir(bundle)) == sorted([".nanhunt-bundle", "report.md", "report.json", "report.html",
                                                 "report.png", *rep.repro.files])
    assert "(repro verified)" in proc.stderr
    ran = subprocess.run([sys.executable, str(bundle / "repro.py")], capture_output=True, text=True, timeout=120)
    assert "inf" in ran.stdout.lower(), ran.stdout + ran.stderr


@pytest.fixture(scope="module")
def ddp_backward_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """(dump dir, each rank's result) of a 2-rank DDP run whose rank 1's batch at step 0 overflows in backward only."""
    base = tmp_path_factory.mktemp("ddp-backward")
    dump, out = base / "caps", base / "out"
    out.mkdir()
    run_ranks(run, lambda r, port: (r, 2, port, str(dump), str(out), BAD_RANK, 0, "ddp", "backward"),
              timeout=120)
    return dump, rank_results(out)


def test_a_backward_overflow_every_rank_received_replays_on_the_rank_that_made_it(
        ddp_backward_run: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    dump, results = ddp_backward_run
    cap = dump / "step000000"
    # GIVEN a DDP step whose loss is finite on both ranks and whose gradients overflow on rank 1 only, so that
    # after DDP's all-reduce both ranks see non-finite gradients: the Guard says both saw it
    for res in results.values():
        assert "error" not in res, res.get("error")
        assert (res["stopped_at"], res["event"]["kind"], res["event"]["ranks"]) == (0, "grads", [0, 1])
    # WHEN the capture is replayed in one process with no --rank (rank 0 is the first rank that saw it)
    report = tmp_path / "r.json"
    code = main(["replay", str(cap), "--model", "fixtures.models:MLP", "--report", str(report)])
    err = capsys.readouterr().err
    rep = Report.from_json(report.read_text())
    # THEN it is not called clean: rank 0's batch replays finite, so rank 1's is replayed, and its backward
    # overflow in fc1's weight gradient is the culprit
    assert code == 1 and rep.status == "nonfinite", err
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.kind) == ("backward", "fc1", "inf")
    said = ("capture of 2 ranks (ddp): rank 1's batch replayed (rank 0's replays finite: the failure it saw came "
            "from another rank)")
    assert rep.notes[0] == said and said in err.splitlines()
    # AND an explicit --rank 0 replays rank 0's batch as asked, clean
    assert main(["replay", str(cap), "--model", "fixtures.models:MLP", "--rank", "0", "--no-bisect"]) == 0
    capsys.readouterr()
