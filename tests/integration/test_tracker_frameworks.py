"""nanhunt's callbacks at their defaults put the Guard's headroom history in the run's own tracker: a Lightning run
with a CSVLogger and a TensorBoardLogger, a ``transformers.Trainer`` run with ``report_to="tensorboard"``; each
read back from its files after 128 steps."""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt.guard.guard import GuardWarning

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS = 128
BF16_SQUARED_BITS = math.log2(torch.finfo(torch.bfloat16).max) / 2  # judged against its range's square root


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # tiny ops: intra-op threads only wait on each other on a busy machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _scalars(logdir: Path) -> EventAccumulator:
    files = list(logdir.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


# ------------------------------------------------------------------ Lightning
pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from nanhunt.integrations.lightning import NanhuntCallback as LightningCallback  # noqa: E402


class TinyModule(pl.LightningModule):
    def __init__(self, d_in: int = 8, hidden: int = 16, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def test_a_lightning_run_logs_the_headroom_to_its_csv_and_tensorboard_loggers(tmp_path: Path) -> None:
    # GIVEN a bfloat16 Lightning run with a CSVLogger and a TensorBoardLogger, nanhunt's callback sampling every step
    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", precision="bf16-mixed",
                         logger=[CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")],
                         callbacks=[LightningCallback(dump_dir=tmp_path / "caps", headroom_every=1)],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModule(), _loader())
    # THEN the CSV has a row at each window's read (steps 63 and 127) with the modules' headroom and the loss
    (path,) = (tmp_path / "csv").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("nanhunt/loss")]
    assert [int(r["step"]) for r in rows] == [63, 127]
    for r in rows:
        for name in ("fc1/output", "fc2/output", "fc1/output_grad", "_model_/output"):
            bits, biggest = float(r[f"nanhunt/headroom/{name}"]), float(r[f"nanhunt/max/{name}"])
            assert bits == pytest.approx(BF16_SQUARED_BITS - math.log2(biggest), abs=1e-3)
    # AND the TensorBoard logger holds the same series at the same steps
    acc = _scalars(tmp_path / "tb")
    for name in ("headroom/fc1/output", "max/fc2/output_grad", "loss"):
        assert [e.step for e in acc.Scalars(f"nanhunt/{name}")] == [63, 127]
    assert acc.Scalars("nanhunt/headroom/fc1/output")[0].value == pytest.approx(
        float(rows[0]["nanhunt/headroom/fc1/output"]), abs=1e-4)


# ------------------------------------------------------------------ transformers.Trainer
transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from nanhunt.integrations.transformers import NanhuntCallback as TrainerNanhunt  # noqa: E402
from tests._support.hf import tiny_gpt2, token_data  # noqa: E402


class PoisonLast(TrainerCallback):
    """Turns one weight inf as the last optimizer step begins: a detection at step STEPS - 1."""

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == STEPS - 1:
            with torch.no_grad():
                model.get_submodule("transformer.h.0.mlp.c_fc").weight[0, 0] = float("inf")


def test_a_trainer_run_logs_the_headroom_to_its_report_to_tensorboard(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a Trainer run reporting to TensorBoard, nanhunt's callback sampling one step in 4 (on_fail="dump": the
    # run goes on after the detection of its last step)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
                             logging_steps=50, report_to="tensorboard", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    callback = TrainerNanhunt(dump_dir=tmp_path / "caps", headroom_every=4, on_fail="dump")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data(),
                      callbacks=[PoisonLast(), callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GuardWarning)
        trainer.train()
    # THEN its TensorBoard holds nanhunt's series beside the Trainer's own, under train/ as the Trainer's are,
    # at each window's read (16 samples of 1 in 4: steps 60 and 124)
    acc = _scalars(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm"} <= tags
    assert [e.step for e in acc.Scalars("train/nanhunt/loss")] == [60, 124]
    ours = [(e.step, t) for t in tags if t.startswith("train/nanhunt/headroom/") for e in acc.Scalars(t)]
    assert sorted({s for s, _ in ours}) == [60, 124]
    assert [sum(s == step for s, _ in ours) for step in (60, 124)] == [6, 6]  # the 6 nearest their limit each time
    # AND the detection at the last step: its count, and its text
    assert [(e.step, e.value) for e in acc.Scalars("train/nanhunt/detections")] == [(STEPS - 1, 1.0)]
    (text,) = acc.Tensors("train/nanhunt/event/text_summary")
    assert text.step == STEPS - 1 and "non-finite" in text.tensor_proto.string_val[0].decode()
