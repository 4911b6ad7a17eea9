"""nanhunt.Guard under FSDP1 (``FullyShardedDataParallel``, default settings) on two gloo processes on the CPU: both
ranks stop together, the rank that saw the failure writes the ordinary per-rank capture files (the full state
dict FSDP1 gathers), and they replay in one process to the op, named as the user wrote it. One distributed run per
wrapping (bounded in time, a stuck rank killed) serves every test of the module."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fixtures.models  # noqa: F401  the capture's model class, imported as a replay of it would find it
from nanhunt.capture.capture import load_step
from nanhunt.cli import main
from nanhunt.records import Report

from .fsdp1_guard_worker import f16_batch, run
from .fsdp_guard_worker import batch
from tests._support.dist import rank_results, run_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # about 10 s on an idle machine; several times that when the 2 cores are shared
BAD_RANK, BAD_STEP = 1, 3
CK, BT = "step000003-rank1-checkpoint.pt", "step000003-rank1-batch.pt"

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]

Run = tuple[Path, Path, dict[int, dict[str, Any]], str]


@pytest.fixture(scope="module", params=["root", "linear", "orig-f16"])
def fsdp1_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """(dump dir, out dir, each rank's result) of one 2-rank FSDP1 run whose rank 1 overflows at step 3: the whole
    MLP one FSDP1 unit (``root``), or every Linear its own (``linear``), in bfloat16; or every Linear its own unit
    with ``use_orig_params=True``, in float16 with a ShardedGradScaler (``orig-f16``)."""
    base = tmp_path_factory.mktemp(f"fsdp1-{request.param}")
    dump, out = base / "caps", base / "out"
    out.mkdir()
    run_ranks(run, lambda r, port: (r, 2, port, str(dump), str(out), BAD_RANK, BAD_STEP, request.param),
              timeout=TIMEOUT_S)
    return dump, out, rank_results(out), request.param


def test_both_ranks_stop_at_step_3_and_rank_1_writes_the_capture_files(fsdp1_run: Run) -> None:
    # GIVEN two FSDP1 ranks of which only rank 1's batch at step 3 overflows bfloat16
    dump, _, results, _ = fsdp1_run
    # THEN both stopped at step 3, know rank 1 saw it, and met again in a last collective
    for r, res in results.items():
        assert (res["stopped_at"], res["iterations"], res["after"]) == (3, 4, 2.0)
        ev = res["event"]
        assert (ev["step"], ev["kind"], ev["rank"], ev["ranks"], ev["pre_update"]) == (3, "loss", r, [1], r == 1)
    # AND only rank 1 wrote a capture: the ordinary per-rank files, as under DDP
    assert (results[0]["event"]["checkpoint"], results[0]["event"]["capture_error"]) == (
        None, "another rank saw it; its capture holds the step")
    ev1 = results[1]["event"]
    assert (ev1["checkpoint"], ev1["batch"], ev1["captured_step"], ev1["capture_error"]) == (
        str(dump / CK), str(dump / BT), 3, None)
    assert sorted(os.listdir(dump)) == [BT, CK, "step000003-rank1-event.json"]
    assert results[1]["describe"].endswith(
        f"capture of the pre-update state: nanhunt replay {dump / CK} {dump / BT} --model fixtures.models:MLP")


def test_the_capture_holds_the_full_state_gathered_with_the_users_names(fsdp1_run: Run,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    dump, out, _, wrap = fsdp1_run
    # GIVEN rank 1's capture WHEN it is loaded in one process
    step = load_step(str(dump / CK), str(dump / BT))
    # THEN the unwrapped model holds the state the failing step began with, as FSDP1 gathers it whole, by the
    # names the user wrote (no _fsdp_wrapped_module, no flat parameter)
    assert type(step.model) is fixtures.models.MLP
    full = torch.load(out / "full-state.pt", weights_only=True)
    own = step.model.state_dict()
    assert sorted(own) == sorted(full) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert all(torch.equal(own[k], full[k]) for k in full)
    # AND Adam's state of the three updates before, per parameter, unflattened
    assert step.optimizer is not None and type(step.optimizer) is torch.optim.Adam
    states = [step.optimizer.state[p] for p in step.model.parameters()]
    assert [float(s["step"]) for s in states] == [3.0, 3.0, 3.0, 3.0]
    assert [tuple(s["exp_avg"].shape) for s in states] == [(32, 64), (32,), (4, 32), (4,)]
    # AND rank 1's batch, replayed in the run's autocast dtype (with its GradScaler's state)
    x, y = (f16_batch if wrap == "orig-f16" else batch)(BAD_RANK, BAD_STEP, big=True)
    assert torch.equal(step.inputs, x) and torch.equal(step.targets, y)
    assert step.rng is not None
    if wrap == "orig-f16":
        assert step.dtype == torch.float16
        assert step.scaler is not None and step.scaler.get_scale() == 1024.0
    else:
        assert (step.dtype, step.scaler) == (torch.bfloat16, None)


def test_replay_of_the_printed_command_names_fc1s_matmul(fsdp1_run: Run, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    # GIVEN the command the Guard printed on rank 1 WHEN it is run in one process
    command = fsdp1_run[2][1]["describe"].rpartition(": ")[2]
    report = tmp_path / "r.json"
    code = main(["replay", *shlex.split(command)[2:], "--report", str(report)])
    capsys.readouterr()
    rep = Report.from_json(report.read_text())
    # THEN the overflow is born in fc1's matmul in the forward, named as the user wrote it
    assert code == 1
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "forward", "fc1", "aten::addmm", "inf")
    # AND the report carries the Guard's event of rank 1
    assert rep.guard_event is not None
    assert (rep.guard_event.step, rep.guard_event.rank, rep.guard_event.ranks) == (3, 1, (1,))


def test_rollback_and_snapshots_are_refused_at_construction(fsdp1_run: Run) -> None:
    # GIVEN an FSDP1 model WHEN a Guard is built with on_fail="rollback" or snapshot_every THEN one line says why not
    for res in fsdp1_run[2].values():
        assert res["refused"] == {
            "rollback": "nanhunt.Guard cannot roll back under FSDP1 (FullyShardedDataParallel): it restores the "
                        "unwrapped model's tensors in place, which FSDP1 keeps as flat shards; use on_fail='raise', "
                        "'dump' or 'warn'",
            "snapshot_every": "nanhunt.Guard keeps no snapshots under FSDP1 (FullyShardedDataParallel): each would "
                              "gather the full state on every rank; drop snapshot_every (a check before "
                              "optimizer.step() captures the pre-update state)"}
