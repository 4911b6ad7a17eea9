"""The Guard's capture directory under FSDP2 (two gloo processes on the CPU) and ``nanhunt replay DIR`` in one
process: DCP shards consolidated into the unwrapped model, each rank's batch replayable, the manifest judged as
untrusted input. One distributed run (bounded in time, a stuck rank killed) serves every test of the module."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fixtures.models  # noqa: F401  the capture's model class, imported as a replay of it would find it
from nanhunt.cli import main
from nanhunt.records import Report

from .fsdp_guard_worker import batch, run
from tests._support.dist import rank_results, run_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
BAD_RANK, BAD_STEP = 1, 2

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    """(dump dir, out dir, each rank's result) of one 2-rank FSDP2 run whose rank 1 overflows at step 2."""
    base = tmp_path_factory.mktemp("fsdp")
    dump, out = base / "caps", base / "out"
    out.mkdir()
    run_ranks(run, lambda r, port: (r, 2, port, str(dump), str(out), BAD_RANK, BAD_STEP), timeout=TIMEOUT_S)
    results = rank_results(out)
    return dump, out, results


def _replay(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Report, str]:
    report = tmp_path / "r.json"
    code = main(["replay", *args, "--report", str(report)])
    err = capsys.readouterr().err
    return code, Report.from_json(report.read_text()), err


def test_both_ranks_stop_at_the_same_step_and_write_one_capture_directory(
        fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]]) -> None:
    # GIVEN two FSDP2 ranks of which only rank 1's batch at step 2 overflows bfloat16
    dump, _, results = fsdp_run
    cap = dump / "step000002"
    # THEN both stopped at step 2, know rank 1 saw it, and met again in a last collective
    for r, res in results.items():
        assert (res["stopped_at"], res["iterations"], res["after"]) == (2, 3, 2.0)
        ev = res["event"]
        assert (ev["step"], ev["kind"], ev["rank"], ev["ranks"], ev["pre_update"]) == (2, "loss", r, [1], True)
        # AND the event names the directory, and the command that replays it
        assert (ev["checkpoint"], ev["batch"], ev["capture_error"]) == (str(cap), None, None)
        # (fixtures.models is not torch's own: the command confirms it)
        assert res["describe"].endswith(
            f"capture of the pre-update state: nanhunt replay {cap} --model fixtures.models:MLP")
    # AND the one capture is a directory: DCP shards written by each rank, a batch per rank, the manifest
    assert os.listdir(dump) == ["step000002"]
    assert sorted(os.listdir(cap)) == ["batch-rank0.pt", "batch-rank1.pt", "event-rank0.json", "event-rank1.json",
                                       "manifest.json", "state"]
    assert sorted(os.listdir(cap / "state")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    man = json.loads((cap / "manifest.json").read_text())
    assert (man["nanhunt_capture_dir"], man["world_size"], man["wrapper"], man["ranks_seen"], man["step"]) == (
        1, 2, "fsdp2", [1], 2)
    assert (man["model_factory"], man["model_kwargs"], man["loss_fn"], man["optimizer_class"], man["scaler"]) == (
        "fixtures.models:MLP", {"d_in": 64}, "torch.nn.functional:mse_loss", "torch.optim.adam:Adam", None)
    assert man["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    assert "model" not in man and "optimizer" not in man  # the tensors are in the shards only


def test_replay_dir_names_the_culprit_on_rank_1(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],
                                                tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    # GIVEN the capture directory WHEN it is replayed in one process by the command the Guard printed (no rank)
    command = fsdp_run[2][0]["describe"].rpartition(": ")[2]
    assert command.startswith("nanhunt replay ")
    code, rep, err = _replay(shlex.split(command)[2:], tmp_path, capsys)
    # THEN rank 1's batch is replayed on the unwrapped model, and its overflow is named exactly
    assert code == 1
    assert rep.first is not None
    assert (rep.first.phase.value, rep.first.module, rep.first.op, rep.first.kind) == (
        "forward", "fc1", "aten::addmm", "inf")
    line = "capture of 2 ranks (fsdp2): rank 1's batch replayed (the first rank that saw the failure)"
    assert line in err.splitlines()
    assert line in rep.notes
    # AND the report carries the Guard's event of that rank (step 2, seen by rank 1)
    assert rep.guard_event is not None
    assert (rep.guard_event.step, rep.guard_event.rank, rep.guard_event.ranks) == (2, 1, (1,))


def test_replay_dir_loads_the_full_state_of_every_shard(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    from nanhunt.capture.capture import load_capture_dir

    # GIVEN the capture WHEN it is loaded THEN the unwrapped model holds both ranks' shards: exactly the state the
    # failing step began with, gathered whole by the run; the Adam state of the two updates before; rank 1's batch
    step = load_capture_dir(fsdp_run[0] / "step000002")
    assert type(step.model) is fixtures.models.MLP
    full = torch.load(fsdp_run[1] / "full-state.pt", weights_only=True)
    own = step.model.state_dict()
    assert sorted(own) == sorted(full) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert all(torch.equal(own[k], full[k]) for k in full)
    assert step.optimizer is not None
    states = [step.optimizer.state[p] for p in step.model.parameters()]
    assert [float(s["step"]) for s in states] == [2.0, 2.0, 2.0, 2.0]
    assert tuple(states[0]["exp_avg"].shape) == (32, 64)
    x, y = batch(BAD_RANK, BAD_STEP, big=True)
    assert torch.equal(step.inputs, x) and torch.equal(step.targets, y)
    assert step.dtype == torch.bfloat16 and step.rng is not None


def test_replay_rank_0_replays_its_finite_batch_and_says_so(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    # GIVEN the capture WHEN rank 0's batch is replayed
    code, rep, err = _replay([str(fsdp_run[0] / "step000002"), "--rank", "0"], tmp_path, capsys)
    # THEN its step is finite, and the replay says whose batch it was and who saw the failure
    assert (code, rep.status, rep.first) == (0, "clean", None)
    assert "capture of 2 ranks (fsdp2): rank 0's batch replayed (the failure was seen by rank(s) 1)" in err


def test_rank_out_of_range_is_one_line(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture of 2 ranks WHEN rank 2 is asked for THEN one line says the ranks it holds
    cap = fsdp_run[0] / "step000002"
    assert main(["replay", str(cap), "--rank", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nanhunt: error: --rank 2 is out of range: capture directory '{cap}' was written by 2 rank(s), 0 to 1; "
        "pick one of them")


def test_dtensor_file_and_directory_given_as_files_get_one_clear_line(
        fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    dump, out, _ = fsdp_run
    cap = dump / "step000002"
    # GIVEN one rank's state_dict() of an FSDP2 model saved with torch.save, given as a checkpoint
    state = out / "rank1-state.pt"
    assert main(["replay", str(state), str(cap / "batch-rank1.pt")]) == 2
    # THEN one line says what it is and how to replay
    assert capsys.readouterr().err.strip() == (
        f"nanhunt: error: checkpoint '{state}' holds DTensor shards (one rank's piece of an FSDP2 / tensor-parallel "
        "model), not full tensors: nanhunt cannot put the pieces together from one file; replay the capture "
        "directory nanhunt.Guard writes under FSDP2 (nanhunt replay DIR), or save full tensors "
        "(get_model_state_dict with StateDictOptions(full_state_dict=True))")
    # GIVEN the capture directory given with a batch file, as if it were a checkpoint file
    assert main(["replay", str(cap), str(cap / "batch-rank1.pt")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nanhunt: error: checkpoint '{cap}' is a nanhunt capture directory (written by the Guard under FSDP2), not "
        f"a file; replay it alone: nanhunt replay {cap} [--rank R]")
    # GIVEN its bare DCP directory THEN it is named as one
    assert main(["replay", str(cap / "state"), str(cap / "batch-rank1.pt")]) == 2
    assert "is a torch.distributed.checkpoint (DCP) directory, not a file" in capsys.readouterr().err


def test_tampered_manifest_is_refused_by_the_resolve_rules(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a copy of the capture whose manifest names os:system as the model factory
    cap = tmp_path / "cap"
    shutil.copytree(fsdp_run[0] / "step000002", cap)
    man = json.loads((cap / "manifest.json").read_text())
    (cap / "manifest.json").write_text(json.dumps({**man, "model_factory": "os:system"}))
    # WHEN it is replayed THEN the name is refused by the rules of a checkpoint's names: nothing is called
    assert main(["replay", str(cap)]) == 2
    assert capsys.readouterr().err.strip() == (
        "nanhunt: error: the file names model factory 'os:system', which nanhunt refuses: 'os' is Python's own "
        "module, which holds no model or optimizer; the file may be hostile; pass --model package.module:factory "
        "with your own")
    # AND a world size of the wrong type is refused by its own check
    (cap / "manifest.json").write_text(json.dumps({**man, "world_size": "2"}))
    assert main(["replay", str(cap)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nanhunt: error: capture directory '{cap}' is not a valid nanhunt capture: manifest.json field "
        "'world_size' is '2', expected an integer from 1 to 1048576")


def test_dcp_metadata_naming_other_globals_is_refused_unpickled(
        fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import pickle

    # GIVEN a copy of the capture whose DCP .metadata is a pickle that would call os.system when unpickled
    cap = tmp_path / "cap"
    shutil.copytree(fsdp_run[0] / "step000002", cap)
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (cap / "state" / ".metadata").write_bytes(pickle.dumps(Hostile()))
    # WHEN it is replayed THEN it is refused, and the command never ran
    assert main(["replay", str(cap)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"nanhunt: error: the capture's state '{cap / 'state'}': its .metadata names 'posix.system', "
                   "which is not part of a DCP checkpoint's metadata and would run code if unpickled; nanhunt "
                   "refuses it")
    assert not marker.exists()


def test_dtensor_file_in_a_fresh_process_gets_the_same_line(fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]],
                                                            ) -> None:
    import subprocess
    import sys

    # GIVEN the DTensor file replayed by a new process, where torch.distributed.tensor is not imported, so torch's
    # weights-only loader refuses the file instead of loading it
    dump, out, _ = fsdp_run
    state, bt = out / "rank1-state.pt", dump / "step000002" / "batch-rank1.pt"
    # WHEN it is replayed THEN the same line, not "holds pickled Python objects ... --trust-pickle"
    for extra in ([], ["--trust-pickle"]):
        done = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(state), str(bt), *extra],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2
        assert done.stderr.strip().splitlines()[-1] == (
            f"nanhunt: error: checkpoint '{state}' holds DTensor shards (one rank's piece of an FSDP2 / "
            "tensor-parallel model), not full tensors: nanhunt cannot put the pieces together from one file; replay "
            "the capture directory nanhunt.Guard writes under FSDP2 (nanhunt replay DIR), or save full tensors "
            "(get_model_state_dict with StateDictOptions(full_state_dict=True))")


@pytest.mark.parametrize("tamper, expected", [
    ("path", "its .metadata places data at '../outside.distcp', which is not a shard file of the checkpoint; "
             "nanhunt refuses it"),
    ("size", "the chunks of 'model.fc1.weight' do not tile its shape (1099511627776, 64); the capture is damaged"),
    ("overlap", "two entries of its .metadata claim the same bytes of '__0_0.distcp'; nanhunt refuses it"),
])
def test_dcp_metadata_pointing_outside_or_claiming_more_than_stored_is_refused(
        fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        tamper: str, expected: str) -> None:
    import dataclasses
    import pickle

    # GIVEN a copy of the capture whose DCP metadata (rewritten here, with DCP's own classes) places a shard
    # outside its directory, or claims a tensor of 2**40 rows that no shard holds
    cap = tmp_path / "cap"
    shutil.copytree(fsdp_run[0] / "step000002", cap)
    file = cap / "state" / ".metadata"
    meta = pickle.loads(file.read_bytes())  # written by this test's own run: trusted here
    if tamper == "path":
        key = next(iter(meta.storage_data))
        meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], relative_path="../outside.distcp")
    elif tamper == "overlap":  # a second entry read from the first one's bytes, shifted by one: N entries could
        # each claim nearly the whole file, and the full tensors outgrow what the shards hold
        first, second = sorted((k for k, v in meta.storage_data.items() if v.relative_path == "__0_0.distcp"),
                               key=lambda k: meta.storage_data[k].offset)[:2]
        meta.storage_data[second] = dataclasses.replace(meta.storage_data[second],
                                                        offset=meta.storage_data[first].offset + 1)
    else:
        md = meta.state_dict_metadata["model.fc1.weight"]
        meta.state_dict_metadata["model.fc1.weight"] = dataclasses.replace(md, size=torch.Size([2**40, 64]))
    file.write_bytes(pickle.dumps(meta))
    # WHEN it is replayed THEN one line refuses it, before anything of that size is allocated or read
    assert main(["replay", str(cap), "--model", "fixtures.models:MLP"]) == 2
    assert capsys.readouterr().err.strip() == f"nanhunt: error: the capture's state '{cap / 'state'}': {expected}"


def test_a_file_alone_and_rank_with_two_files_are_one_line_each(
        fsdp_run: tuple[Path, Path, dict[int, dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    bt = fsdp_run[0] / "step000002" / "batch-rank1.pt"
    # GIVEN one file where a capture directory or two files are expected THEN one line says what is missing
    assert main(["replay", str(bt)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nanhunt: error: '{bt}' is not a capture directory; a checkpoint file needs its batch file too: nanhunt "
        "replay CHECKPOINT BATCH")
    # GIVEN --rank with a checkpoint and a batch file THEN one line says it picks a directory's batch
    assert main(["replay", str(bt), str(bt), "--rank", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nanhunt: error: --rank picks a batch of a capture directory; with a checkpoint and a batch file, leave it out")
