"""The Guard's capture directory under HSDP (FSDP2 on a 2-D device mesh: replicated over dimension 0, sharded over
dimension 1; four gloo processes on the CPU), replayed in one process and under ``torchrun --nproc-per-node 4``,
which builds the recorded mesh again. One distributed run serves the module's tests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import fixtures.models  # noqa: F401  the capture's model class, imported as a replay of it would find it
from nanhunt.cli import main
from nanhunt.records import Report

from .fsdp_guard_worker import run
from tests._support.dist import rank_results, run_ranks, torchrun

ROOT = Path(__file__).resolve().parents[2]
WORLD, BAD_RANK, BAD_STEP = 4, 3, 1

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """(dump dir, each rank's result) of one 4-rank HSDP run whose rank 3 overflows at step 1."""
    base = tmp_path_factory.mktemp("hsdp")
    dump, out = base / "caps", base / "out"
    out.mkdir()
    run_ranks(run, lambda r, port: (r, WORLD, port, str(dump), str(out), BAD_RANK, BAD_STEP, "hsdp"), timeout=240,
              world=WORLD)
    return dump, rank_results(out)


def test_every_rank_stops_and_the_manifest_records_the_2d_mesh(hsdp_run: tuple[Path, dict[int, Any]]) -> None:
    # GIVEN four ranks on a 2 x 2 mesh, of which only rank 3's batch at step 1 overflows bfloat16
    dump, results = hsdp_run
    cap = dump / "step000001"
    # THEN every rank stopped at step 1 knowing rank 3 saw it, on the mesh the model was sharded on
    for r, res in results.items():
        assert "error" not in res, res["error"]
        assert (res["stopped_at"], res["event"]["ranks"], res["event"]["checkpoint"]) == (1, [3], str(cap))
        assert res["mesh"] == [[2, 2]]
    # AND the manifest records that mesh, with its dimension names, for the modules fully_shard wrapped that hold
    # parameters (the root holds none of its own: no mesh recorded, the replay gives it the others')
    man = json.loads((cap / "manifest.json").read_text())
    assert (man["world_size"], man["wrapper"], man["ranks_seen"]) == (4, "fsdp2", [3])
    assert [(e["module"], e["mesh"], e.get("mesh_dim_names")) for e in man["fsdp"]] == [
        ("fc2", [2, 2], ["replicate", "shard"]), ("fc1", [2, 2], ["replicate", "shard"]), ("", None, None)]


def test_replay_in_one_process_names_the_culprit(hsdp_run: tuple[Path, dict[int, Any]], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    report = tmp_path / "r.json"
    # GIVEN the capture WHEN it is replayed in one process (rank 3's batch, the shards consolidated)
    assert main(["replay", str(hsdp_run[0] / "step000001"), "--model", "fixtures.models:MLP", "--no-bisect",
                 "--report", str(report)]) == 1
    capsys.readouterr()
    rep = Report.from_json(report.read_text())
    # THEN fc1's bfloat16 matmul overflowed
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "forward", "fc1", "aten::addmm", "inf")
    assert rep.notes[0] == "capture of 4 ranks (fsdp2): rank 3's batch replayed (the first rank that saw the failure)"


def test_torchrun_replay_builds_the_2d_mesh_again(hsdp_run: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    # GIVEN the capture WHEN four ranks replay it under torchrun
    report = tmp_path / "r.json"
    proc = torchrun(["-m", "nanhunt", "replay", str(hsdp_run[0] / "step000001"), "--model", "fixtures.models:MLP",
                     "--no-bisect", "--report", str(report)], cwd=ROOT, nproc=WORLD,
                    launcher=("--monitor-interval", "10"))
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s*: (\d) \(local_rank.*\n\s*exitcode\s*: (-?\d+)", proc.stderr)}
    assert proc.returncode == 1 and codes == {r: 1 for r in range(WORLD)}, proc.stderr[-3000:]
    rep = Report.from_json(report.read_text())
    # THEN the report is rank 3's replay: fc1's matmul, every other rank received it
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "forward", "fc1", "aten::addmm", "inf")
    assert rep.notes[1].startswith("rank 3 went first: the report is its replay; rank 3: Inf born in phase forward, "
                                   "module fc1 ")
