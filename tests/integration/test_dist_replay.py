"""``torchrun --nproc-per-node 2 -m nanhunt replay DIR``: an FSDP2 capture directory replayed as it ran (two gloo
ranks on the CPU, each its own batch), the report shown by rank 0 and naming the rank that went first; the
bisection's trials run on both ranks. The capture comes from the FSDP2 Guard run of ``test_dcp_capture``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nanhunt.cli import main
from nanhunt.records import Report

from tests._support.dist import torchrun

from .test_dcp_capture import ROOT, fsdp_run  # noqa: F401  the capture directory, written by two FSDP2 ranks

pytestmark = pytest.mark.distributed


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # --monitor-interval: torchrun stops the other ranks as soon as a poll sees one exited non-zero; every rank
    # exits with the same code right after a barrier, and a 10 s poll lets the summary show each rank's own code
    # (at 2 s, rank 0's interpreter teardown was still running at the poll in 1 run of about 40: SIGTERM, -15)
    return torchrun(["-m", "nanhunt", *args], cwd=cwd, launcher=("--monitor-interval", "10"))


def test_torchrun_replay_names_the_culprit_and_the_rank_that_went_first(
        fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]], tmp_path: Path,  # noqa: F811
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cap = fsdp_run[0] / "step000002"
    # GIVEN the capture of two FSDP2 ranks of which only rank 1's batch overflows bfloat16 in fc1
    # WHEN it is replayed under torchrun on two ranks (each rank rebuilds, shards, loads its shards, replays its batch)
    report = tmp_path / "r.json"
    proc = _torchrun(["replay", str(cap), "--model", "fixtures.models:MLP", "--report", str(report)], ROOT)
    # THEN every rank exits 1 (non-finite found)
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s*: (\d) \(local_rank.*\n\s*exitcode\s*: (-?\d+)", proc.stderr)}
    assert proc.returncode == 1 and codes == {0: 1, 1: 1}, proc.stderr[-3000:]
    # AND rank 0 alone printed the report: once, naming the op rank 1's batch overflowed in
    head = "Inf born in phase forward, in fc1 "
    assert proc.stdout.count(head) == 1 and proc.stdout.startswith(head), proc.stdout[:2000]
    rep = Report.from_json(report.read_text())
    assert rep.first is not None
    assert (rep.status, rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "nonfinite", "forward", "fc1", "aten::addmm", "inf")
    # AND it says how it was replayed and that rank 1 went first, rank 0 receiving it through the reduce-scatter
    said = "capture of 2 ranks (fsdp2) replayed on 2 ranks under torchrun, each rank its own batch and RNG state"
    assert rep.notes[0] == said
    assert rep.notes[1].startswith("rank 1 went first: the report is its replay; rank 1: Inf born in phase forward, "
                                   "module fc1 ")
    assert rep.notes[1].endswith("op aten::addmm; rank 0 received it through the gradient reduce-scatter")
    err = proc.stderr.splitlines()
    assert err.count(said) == 1 and err.count(rep.notes[1]) == 1
    # AND the command that replays it is the torchrun command
    assert rep.command == (f"torchrun --nproc-per-node 2 -m nanhunt replay {cap} --model fixtures.models:MLP "
                           f"--report {report}")
    # AND the bisection ran on both ranks the trials the one-process replay of rank 1's batch runs: the same verdict
    assert rep.verdict is not None
    v = rep.verdict
    assert (v.kind, v.replays, v.origin_alone_fixes) == ("not-precision", 2, False)
    monkeypatch.chdir(ROOT)
    alone = tmp_path / "one.json"
    assert main(["replay", str(cap), "--model", "fixtures.models:MLP", "--report", str(alone)]) == 1
    capsys.readouterr()
    one = json.loads(alone.read_text())["verdict"]
    assert (one["kind"], one["replays"], one["origin_alone_fixes"]) == (v.kind, v.replays, v.origin_alone_fixes)
    # AND its float32 control fails where the one-process one does: fc1's addmm, not a weight already non-finite
    # (FSDP2's unsharded parameters left from the trial before the control are dropped at each reset)
    assert v.float32_first is not None
    f = one["float32_first"]
    assert (v.float32_first.phase.value, v.float32_first.module, v.float32_first.op) == (
        f["phase"], f["module"], f["op"]) == ("forward", "fc1", "aten::addmm")


def test_world_size_other_than_the_capture_is_one_line(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],  # noqa: F811
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cap = fsdp_run[0] / "step000002"
    # GIVEN the capture of 2 ranks WHEN a rank of a 3-rank torchrun replays it (torchrun's environment)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    # THEN one line says how to run it, before any process group is made, and the exit code is 2
    assert main(["replay", str(cap), "--model", "fixtures.models:MLP"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nanhunt: error: captured on 2 ranks, run with --nproc-per-node 2, or without torchrun to replay rank 1's "
        "batch in one process")
    # AND --rank, which picks one rank's batch for a one-process replay, is refused under torchrun
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["replay", str(cap), "--rank", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nanhunt: error: under torchrun every rank replays its own batch: leave --rank out (it picks one rank's batch "
        "for a replay in one process, without torchrun)")
