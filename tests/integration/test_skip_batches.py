"""The skip list: every batch a rollback skipped, in dump_dir/skip_batches.json, with its dataset indices."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nanhunt
from nanhunt.guard._skip_list import WHAT
from nanhunt.guard.guard import GuardWarning

from tests._support.guard import BIG_INPUT, D_IN, batch, guard_for, mlp_setup, train_step

BAD = 13  # the sample that overflows float16


class _Indexed(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """48 samples, each with its index (as a dataset that wants its samples traceable returns it)."""

    def __init__(self, bad: int | None = BAD) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(48, D_IN, generator=g), torch.randn(48, 4, generator=g)
        if bad is not None:
            self.x[bad] = BIG_INPUT  # finite, but fc1 sums 64 of them: its float16 output overflows

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def _amp_loop(guard: nanhunt.Guard, model: torch.nn.Module, opt: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler, loader: DataLoader[Any], *, give_indices: bool = True
              ) -> dict[int, list[int]]:
    """One epoch of float16 steps; returns the indices of each step's batch, as the loader gave them."""
    seen: dict[int, list[int]] = {}
    for step, (idx, x, y) in enumerate(loader):
        seen[step] = idx.tolist()
        train_step(guard, model, opt, scaler, (x, y), indices=idx if give_indices else None)
    return seen


def _loader(dataset: Dataset[Any]) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_a_rolled_back_batch_is_listed_with_its_dataset_indices(tmp_path: Path) -> None:
    # GIVEN on_fail="rollback", a shuffled DataLoader whose sample 13 overflows float16, the loop handing each
    # batch's indices to guard.step
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="rollback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)
        seen = _amp_loop(guard, model, opt, scaler, _loader(_Indexed()))
    (bad_step,) = [s for s, idx in seen.items() if BAD in idx]
    # THEN the run went on past it, and skip_batches.json lists exactly that step, its detection, its event file
    # and the indices of its batch
    assert (guard.iterations, guard.rollbacks, guard.updates) == (6, 1, 5)
    data = _read(tmp_path / "skip_batches.json")
    assert data["what"] == WHAT and data["rank"] is None
    (entry,) = data["skipped"]
    assert entry == {
        "step": bad_step, "kind": "loss", "detail": "non-finite loss", "event": f"step{bad_step:06d}-event.json",
        "rollback": 1, "restored_step": bad_step, "batches": [{"step": bad_step, "indices": seen[bad_step]}],
        "indices_note": None,
    }
    assert (tmp_path / entry["event"]).is_file()
    # AND no temporary file is left beside it
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == []


def test_the_listed_indices_leave_the_bad_sample_out_of_a_rerun(tmp_path: Path) -> None:
    # GIVEN the skip list of a run that rolled back the batch holding sample 13
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path / "first", on_fail="rollback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)
        _amp_loop(guard, model, opt, scaler, _loader(_Indexed()))
    data = _read(tmp_path / "first" / "skip_batches.json")
    # WHEN a re-run leaves every listed index out (docs/guard.md's recipe)
    skipped = {i for e in data["skipped"] for b in e["batches"] for i in (b["indices"] or [])}
    dataset = _Indexed()
    kept = torch.utils.data.Subset(dataset, [i for i in range(len(dataset)) if i not in skipped])
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path / "again", on_fail="rollback")
    _amp_loop(guard, model, opt, scaler, _loader(kept))
    # THEN sample 13 is out, the re-run rolls back nothing and writes no skip list
    assert BAD in skipped and len(skipped) == 8
    assert (guard.rollbacks, guard.events) == (0, [])
    assert not (tmp_path / "again" / "skip_batches.json").exists()


def test_without_indices_the_entry_says_why(tmp_path: Path) -> None:
    # GIVEN the same run, the loop giving guard.step no indices
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="rollback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)
        seen = _amp_loop(guard, model, opt, scaler, _loader(_Indexed()), give_indices=False)
    (bad_step,) = [s for s, idx in seen.items() if BAD in idx]
    # THEN the step is listed, its indices null, and the note says how to give them
    (entry,) = _read(tmp_path / "skip_batches.json")["skipped"]
    assert (entry["step"], entry["batches"]) == (bad_step, [{"step": bad_step, "indices": None}])
    assert entry["indices_note"] == f"step {bad_step}: the loop gave no indices (guard.step(batch, indices=...))"


def test_a_rollback_from_the_snapshot_lists_every_step_it_undid(tmp_path: Path) -> None:
    # GIVEN snapshot_every=1, no GradScaler, and step 3's update writing Inf into the weights (lr 1e36), found
    # when step 4's loss comes out non-finite; the loop calls guard.rollback() itself (on_fail="dump")
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, snapshot_every=1, on_fail="dump", max_captures=0)
    for step in range(6):
        for group in opt.param_groups:
            group["lr"] = 1e36 if step == 3 else 1e-2
        # finite gradients, an Inf update
        train_step(guard, model, opt, None, batch(step, big_target=step == 3), dtype=torch.bfloat16,
                   indices=range(8 * step, 8 * step + 8))
        if guard.events and guard.events[-1].kind == "params":
            guard.rollback(change="lr back to 1e-2")
    # THEN the entry names the detection at step 4, restored to step 3's start, both batches with their indices
    (entry,) = _read(tmp_path / "skip_batches.json")["skipped"]
    assert (entry["step"], entry["kind"], entry["restored_step"], entry["event"]) == (4, "params", 3, None)
    assert entry["batches"] == [{"step": 3, "indices": list(range(24, 32))},
                                {"step": 4, "indices": list(range(32, 40))}]


def test_a_skip_list_that_cannot_be_written_warns_and_the_last_one_stays(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a rollback whose skip list was written, then a second rollback whose file cannot be replaced
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="rollback")
    dataset = _Indexed()
    dataset.x[40] = BIG_INPUT
    loader = _loader(dataset)
    real_replace = os.replace
    calls = {"n": 0}

    def failing_replace(src: str, dst: str) -> None:
        if str(dst).endswith("skip_batches.json"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = _amp_loop(guard, model, opt, scaler, loader)
    # THEN the run went on, a GuardWarning said the list could not be written, and the file holds the first
    # rollback's entry, whole, with no temporary file left
    bad = sorted(s for s, idx in seen.items() if BAD in idx or 40 in idx)
    assert guard.rollbacks == 2 and len(bad) == 2
    failed = [str(w.message) for w in caught if "skip list" in str(w.message)]
    assert failed == [f"nanhunt.Guard: could not write the skip list in {tmp_path}: cannot write "
                      f"{str(tmp_path / 'skip_batches.json')!r}: No space left on device"]
    assert [e["step"] for e in _read(tmp_path / "skip_batches.json")["skipped"]] == bad[:1]
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_indices_of_the_wrong_type_are_refused_when_the_step_begins(tmp_path: Path) -> None:
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="rollback")
    with pytest.raises(TypeError, match=r"^guard.step\(indices=...\) takes the dataset indices of the batch: a "
                                        r"sequence, NumPy array or tensor of ints, not dict$"):
        guard.step((torch.zeros(1),), indices={"a": 1})


@pytest.mark.subprocess
@pytest.mark.slow
def test_nanhunt_run_rollback_lists_the_step_and_why_it_has_no_indices(tmp_path: Path) -> None:
    from tests.integration.test_run import _nanhunt_run

    # GIVEN the float16 loop whose batch 2 overflows, run unchanged under nanhunt run --on-fail rollback
    done = _nanhunt_run("plain_loop.py", "--bad-step", "2", cwd=tmp_path, options=("--on-fail", "rollback"))
    assert done.returncode == 0, done.stderr[-3000:]
    # THEN its skip list names step 2, with no indices and the reason: nanhunt run sees the model's inputs only
    (entry,) = _read(tmp_path / "nan-captures" / "skip_batches.json")["skipped"]
    assert (entry["step"], entry["kind"], entry["event"], entry["batches"]) == (
        2, "loss", "step000002-event.json", [{"step": 2, "indices": None}])
    assert entry["indices_note"] == (
        "step 2: nanhunt run sees the inputs the model is called with, not their dataset indices (guard the loop "
        "with nanhunt.Guard: guard.step(batch, indices=...))")
