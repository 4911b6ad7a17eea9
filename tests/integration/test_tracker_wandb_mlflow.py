"""The Guard's headroom history in a W&B run (offline mode, read back from its ``.wandb`` file) and in MLflow (a
local file store, read back through its client): the series at each window's read and a warning's event."""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nanhunt.guard.guard import HeadroomWarning

from tests._support.guard import batch, guard_for, mlp_setup, train_step

STEPS = 128
GROWTH = 1.05  # fc1's weight grows 5% a step: its float16 output is warned about at the read of step 124


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(tmp_path: Path, tracker: Any, log: Any = None) -> Any:
    """128 float16 steps (no GradScaler, the loss not handed over: the module warning comes first) with fc1's
    weight growing, sampled one step in 4; ``log`` is called after each step (the loop's own logging)."""
    model, opt, _ = mlp_setup(lr=0.0, scaler=False)
    guard = guard_for(model, opt, None, tmp_path / "caps", headroom_every=4, tracker=tracker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadroomWarning)
        for i in range(STEPS):
            train_step(guard, model, opt, None, batch(i % 16), hand_loss=False)
            with torch.no_grad():
                model.fc1.weight.mul_(GROWTH)
            if log is not None:
                log(i)
    guard.close()
    assert [(e.step, e.kind, e.module) for e in guard.events][:1] == [(124, "warning", "fc1")]
    return guard


# ------------------------------------------------------------------ W&B
def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a run's ``.wandb`` file: a 7-byte header, then LevelDB's log format (32 KiB blocks of
    chunks: CRC32C, length, type; a record in one chunk or split FIRST, MIDDLE..., LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7: pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


@pytest.mark.subprocess  # W&B runs its own service process
def test_a_wandb_run_offline_holds_the_series_and_the_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # GIVEN an offline W&B run the loop logs to every step, given to the Guard
    run = wandb.init(mode="offline", dir=str(tmp_path), project="nanhunt-test")
    try:
        guard = _run(tmp_path, run, log=lambda i: run.log({"my/loss": float(i)}))
    finally:
        run.finish()
        wandb.teardown()  # the service process ends once it has written the whole file (finish may return before)
    # WHEN its file is read back
    (path,) = tmp_path.rglob("offline-run-*/run-*.wandb")
    rows, alerts = [], []
    for r in _wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
        elif r.WhichOneof("record_type") == "alert":
            alerts.append((r.alert.title, r.alert.text, r.alert.level))
    # THEN the window's numbers joined the loop's own rows (its step never went back), against nanhunt/step
    ours = [row for row in rows if "nanhunt/step" in row]
    windows = [row for row in ours if "nanhunt/headroom/fc1/output" in row]
    assert [row["nanhunt/step"] for row in windows] == [60, 124]
    assert [row["_step"] for row in windows] == [60, 124] and all("my/loss" in row for row in windows)
    assert windows[1]["nanhunt/headroom/fc1/output"] < windows[0]["nanhunt/headroom/fc1/output"]
    assert "nanhunt/forecast_steps/fc1/output" in windows[1]
    # AND the warning: an alert, its text in the history, the count
    warning = guard.events[0]
    assert alerts[0] == (f"nanhunt warning at step {warning.step}", warning.describe(), "WARN")
    given = [e for e in guard.events if e.step == warning.step]  # the warnings of one step share its row
    (row,) = [row for row in ours if "nanhunt/event" in row]
    assert row["nanhunt/event"] == "\n".join(e.describe() for e in given)
    assert row["nanhunt/warnings"] == len(given) > 1


# ------------------------------------------------------------------ MLflow
@pytest.mark.parametrize("given", ["module", "run"])
def test_mlflow_with_a_local_file_store_holds_the_series_and_the_warning(tmp_path: Path, given: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 prefers a database; a folder is enough here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    # GIVEN an MLflow run, given to the Guard as the mlflow module (its active run) or as the run itself
    with mlflow.start_run() as run:
        guard = _run(tmp_path, mlflow if given == "module" else run)
    # THEN the run holds the series at each window's read, and the warning as a tag
    client = mlflow.MlflowClient()
    history = client.get_metric_history(run.info.run_id, "nanhunt/headroom/fc1/output")
    assert [m.step for m in history] == [60, 124] and history[1].value < history[0].value
    assert [m.step for m in client.get_metric_history(run.info.run_id, "nanhunt/max/fc1/output")] == [60, 124]
    warning = guard.events[0]
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["nanhunt/event/1"] == f"step {warning.step}: {warning.describe()}"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "nanhunt/warnings")][0] == (
        warning.step, 1.0)
