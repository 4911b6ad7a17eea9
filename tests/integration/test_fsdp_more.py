"""Sharded training beyond the FSDP2 MLP of test_dcp_capture.py, each on two gloo processes on the CPU (bounded in
time, a stuck rank killed): ``nanhunt.trace`` on FSDP1 (``FullyShardedDataParallel``), a transformers model's
capture directory that replays with no ``--model``, and ``snapshot_every`` under FSDP2."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fixtures.models  # noqa: F401  the capture's model class, imported as a replay of it would find it
from nanhunt.capture.capture import load_capture_dir
from nanhunt.cli import main
from nanhunt.records import Report

from .dist_more_worker import SNAP_BAD_STEP, gpt2_run, snapshot_batch, snapshot_run, trace_run, two_ranks

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


def _replay(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Report]:
    report = tmp_path / "r.json"
    code = main(["replay", *args, "--report", str(report)])
    capsys.readouterr()
    return code, Report.from_json(report.read_text())


def _where(rep: Report) -> tuple[str, str | None, str | None, str | None, str] | None:
    f = rep.first
    return None if f is None else (f.phase.value, f.module, f.module_class, f.op, f.kind)


# ------------------------------------------------------------------------------------------------ FSDP1
def test_fsdp1_trace_names_the_op_on_rank1_and_rank0_received_it(tmp_path: Path) -> None:
    # GIVEN FSDP1 with every Linear its own unit (torch names them _fsdp_wrapped_module.fc1._fsdp_wrapped_module)
    # and only rank 1's batch overflowing fc1 in float16
    res = two_ranks(trace_run, tmp_path, "fsdp1", timeout=120)
    assert "_fsdp_wrapped_module.fc1._fsdp_wrapped_module" in res[0]["wrapped_names"]
    # WHEN each rank traces the step THEN rank 1 names the op in fc1, as the user wrote it
    assert res[1]["first"] == ["forward", "fc1", "Linear", "aten::addmm", "inf"]
    # AND rank 0 made none: it arrived through FSDP1's gradient reduce-scatter
    assert res[0]["first"] is None
    assert res[0]["received"] == ["c10d::_reduce_scatter_base_", "backward"]
    for r in (0, 1):
        assert res[r]["collectives"] == ["c10d::_reduce_scatter_base_", "c10d::allgather_"]
        assert res[r]["classes"] == {"": "MLP", "fc1": "Linear", "act": "GELU", "fc2": "Linear"}
        assert set(res[r]["modules"]) <= {"", "fc1", "act", "fc2"}
        # AND both name rank 1 first
        assert res[r]["first_rank"] == 1
        assert res[r]["summary"] == ("rank 1: Inf born in phase forward, module fc1 (Linear, call 0), op aten::addmm; "
                                     "rank 0 received it through the gradient reduce-scatter")


# ---------------------------------------------------------------------------- transformers under FSDP2 and DDP
@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
def test_gpt2_capture_directory_keeps_its_config_and_replays_without_model(
        wrapper: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a tiny GPT-2 under FSDP2 (or DDP, the Guard given the DDP module) whose rank 1 has only masked labels
    # (-100) at step 1: mean cross entropy 0/0
    dump = tmp_path / "caps"
    res = two_ranks(gpt2_run, tmp_path, str(dump), wrapper, timeout=240)
    # THEN both ranks stop at step 1, and the capture directory's manifest records the class and JSON config
    assert [res[r]["stopped_at"] for r in (0, 1)] == [1, 1]
    cap = dump / "step000001"
    man = json.loads((cap / "manifest.json").read_text())
    assert man["hf_model"]["class"] == "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"
    config = json.loads(man["hf_model"]["config"])
    assert (config["n_layer"], config["n_embd"], config["vocab_size"]) == (2, 32, 64)
    assert man["hf_model"]["attn_implementation"] == "eager"
    # AND the printed replay command asks for no --model
    command = res[1]["describe"].rpartition(": ")[2]
    assert command == f"nanhunt replay {cap}"
    # WHEN it is run as printed (from an unrelated directory: nothing of the test's code is imported)
    monkeypatch.chdir(tmp_path)
    code, rep = _replay(shlex.split(command)[2:], tmp_path, capsys)
    # THEN rank 1's batch is replayed on GPT-2 rebuilt from the config, and the 0/0 is named exactly
    assert code == 1
    assert _where(rep) == ("forward", "", "GPT2LMHeadModel", "aten::nll_loss_forward", "nan")
    assert rep.verdict is not None and rep.verdict.kind == "not-precision"
    assert f"capture of 2 ranks ({wrapper}): rank 1's batch replayed (the first rank that saw the failure)" in rep.notes


# ---------------------------------------------------------------------------- snapshot_every under FSDP2
@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, Any]]:
    out = tmp_path_factory.mktemp("fsdp-snapshot")
    return out / "caps" / f"step{SNAP_BAD_STEP:06d}", out, two_ranks(snapshot_run, out, str(out / "caps"), timeout=120)


def test_update_that_wrote_infinite_weights_is_captured_from_the_snapshot(
        snapshot_dir: tuple[Path, Path, dict[int, Any]]) -> None:
    cap, out, res = snapshot_dir
    # GIVEN FSDP2 with snapshot_every=1, whose update at step 2 (rank 1's gradient, through the reduce-scatter)
    # writes infinite weights on every rank's shards
    for r in (0, 1):
        assert res[r]["stopped_at"] == SNAP_BAD_STEP and res[r]["live_finite"] is False
        event = res[r]["event"]
        # THEN the capture holds the state before that update: the snapshot, not the live weights
        assert (event["kind"], event["captured_step"], event["pre_update"]) == ("params", 2, True)
        assert event["checkpoint"] == str(cap)
    man = json.loads((cap / "manifest.json").read_text())
    assert (man["step"], man["captured_step"], man["pre_update"]) == (2, 2, True)
    # AND its shards, consolidated, are exactly the state step 2 began with (gathered whole by the run), with
    # rank 1's batch of that step
    step = load_capture_dir(cap, model_factory="fixtures.models:MLP", rank=1)
    began = torch.load(out / "began.pt", weights_only=True)
    own = step.model.state_dict()
    assert sorted(own) == sorted(began) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert all(torch.equal(own[k], began[k]) for k in began)
    x, y = snapshot_batch(1, SNAP_BAD_STEP)
    assert torch.equal(step.inputs, x) and torch.equal(step.targets, y)
    assert step.optimizer is not None and step.optimizer.param_groups[0]["lr"] == 1e30


def test_snapshot_capture_replays_the_update_that_overflowed(snapshot_dir: tuple[Path, Path, dict[int, Any]],
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cap = snapshot_dir[0]
    # GIVEN the snapshot capture WHEN rank 1's batch is replayed in one process
    code, rep = _replay([str(cap), "--rank", "1", "--model", "fixtures.models:MLP"], tmp_path, capsys)
    # THEN the step starts finite and SGD's update is where the Inf is born
    assert code == 1
    assert _where(rep) == ("update", None, None, "aten::add_", "inf")
