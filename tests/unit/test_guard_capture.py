"""The Guard's capture writer on its own: entry copies of the buffers, when it writes, and what it writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt._util._files import new_files
from nanhunt.guard._guard_capture import CaptureWriter, EntryBuffers, StepEntry


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.ones(4))  # never written
        self.register_buffer("scratch", torch.zeros(4), persistent=False)  # not saved: never copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.fc(x)) * self.mask
        return out


def _writer(tmp_path: Path, **kw: object) -> tuple[_Net, CaptureWriter]:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args: dict[str, object] = {
        "dump_dir": tmp_path, "loss_fn": F.mse_loss, "model_factory": None, "model_kwargs": None,
        "device_type": "cpu", "dtype": None, "snapshot_every": None, "max_captures": 1, "dump_all_ranks": False,
        "rank": None} | kw
    return model, CaptureWriter(model, opt, None, **args)  # type: ignore[arg-type]


def _names(buffers: EntryBuffers, copies: dict[int, torch.Tensor]) -> set[str]:
    return {buffers.named[k][0] for k in copies}


def test_entry_buffers_copy_all_at_first_then_only_those_that_change() -> None:
    model = _Net()
    buffers = EntryBuffers(model)
    assert {n for n, _ in buffers.named} == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "mask"}
    first = buffers.copy(first=True)
    assert _names(buffers, first) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "mask"}
    # WHEN a forward writes BatchNorm's statistics and the next step begins
    model(torch.randn(8, 4))
    later = buffers.copy(first=False)
    # THEN only the normalisation buffers are copied again, holding their values as this step begins
    assert _names(buffers, later) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    k = [n for n, _ in buffers.named].index("bn.running_mean")
    assert model.bn.running_mean is not None and torch.equal(later[k], model.bn.running_mean)
    # and a buffer written in place (its version moves) joins them
    with torch.no_grad():
        model.get_buffer("mask").mul_(2)
    assert "mask" in _names(buffers, buffers.copy(first=False))


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="snapshot_every"):
        _writer(tmp_path, snapshot_every=0)
    with pytest.raises(ValueError, match="loss_fn must be a named function"):
        _writer(tmp_path, loss_fn=lambda a, b: a)


def test_capture_writes_both_files_once_then_only_says_why_not(tmp_path: Path) -> None:
    model, writer = _writer(tmp_path)
    entry = StepEntry(0, (torch.ones(2, 4), torch.zeros(2, 4)), {"torch": torch.get_rng_state()})
    writer.begin(entry, first=True)
    # another rank saw it: nothing written
    assert writer.capture(entry, seen_here=False, live=True, began=True, bad_update=0, scaler_before=False) == (
        None, None, None, False, "another rank saw it; its capture holds the step")
    written = writer.capture(entry, seen_here=True, live=True, began=True, bad_update=0, scaler_before=False)
    assert written == (str(tmp_path / "step000000-checkpoint.pt"), str(tmp_path / "step000000-batch.pt"), 0, True,
                       None)
    assert sorted(os.listdir(tmp_path)) == ["step000000-batch.pt", "step000000-checkpoint.pt"]
    assert writer.captures == 1
    assert writer.capture(entry, seen_here=True, live=True, began=True, bad_update=0, scaler_before=False).error == \
        "max_captures=1 already written"


def test_a_failed_write_leaves_no_file_and_is_reported(tmp_path: Path) -> None:
    _, writer = _writer(tmp_path)
    entry = StepEntry(5, (torch.ones(2, 4), {"f": lambda: 0}), {"torch": torch.get_rng_state()})  # unpicklable
    written = writer.capture(entry, seen_here=True, live=True, began=True, bad_update=5, scaler_before=False)
    assert written.checkpoint is None and written.error is not None and written.error.startswith("AttributeError")
    assert os.listdir(tmp_path) == [] and writer.captures == 0


def test_snapshot_is_kept_only_while_the_weights_are_finite(tmp_path: Path) -> None:
    model, writer = _writer(tmp_path, snapshot_every=2)
    rng = {"torch": torch.get_rng_state()}
    for i in range(3):
        writer.begin(StepEntry(i, None, rng), first=i == 0)
    assert writer.snapshot is not None and writer.snapshot.step == 2
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    writer.begin(StepEntry(4, None, rng), first=False)
    assert writer.snapshot.step == 2 and writer.poisoned_at == 4
    writer.begin(StepEntry(6, None, rng), first=False)  # no snapshot once poisoned
    assert writer.snapshot.step == 2


def test_both_or_neither_removes_partial_files(tmp_path: Path) -> None:
    ck, bt = str(tmp_path / "c.pt"), str(tmp_path / "b.pt")
    with pytest.raises(RuntimeError):
        with new_files(ck, bt) as (ck_file, bt_file):
            ck_file.write(b"x")
            raise RuntimeError
    assert os.listdir(tmp_path) == []
    with new_files(ck, bt) as (ck_file, bt_file):
        ck_file.write(b"c")
        bt_file.write(b"b")
    assert sorted(os.listdir(tmp_path)) == ["b.pt", "c.pt"]
