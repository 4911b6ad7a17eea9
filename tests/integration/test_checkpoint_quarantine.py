"""The callbacks' checkpoint quarantine: after a non-finite step a run that goes on (``on_fail="dump"``) saves no
checkpoint until a clean step, so the last good one is never rotated out, and the event names it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from nanhunt.integrations.lightning import NanhuntCallback as LightningCallback  # noqa: E402
from nanhunt.integrations.transformers import NanhuntCallback as TrainerNanhunt  # noqa: E402

BAD = 3  # the optimizer step (global_step as it begins) that goes non-finite


class _InfWeight(TrainerCallback):
    """One weight of the first MLP turned inf as step BAD begins: every step after it is non-finite too."""

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == BAD:
            with torch.no_grad():
                model.get_submodule("transformer.h.0.mlp.c_fc").weight[0, 0] = float("inf")


def test_trainer_saves_nothing_after_a_nonfinite_step_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    # GIVEN a Trainer saving every step and keeping one checkpoint, whose weights go non-finite at step 3, and
    # nanhunt's callback letting the run go on
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids.clone()} for _ in range(32)]
    out = tmp_path / "out"
    args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_strategy="steps",
                             save_steps=1, save_total_limit=1, report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, bf16=True)
    dump = tmp_path / "nan"
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[_InfWeight(), TrainerNanhunt(dump_dir=dump, on_fail="dump")])
    # WHEN it trains its 6 steps
    trainer.train()
    # THEN the checkpoint of step 3, the last good one, is still there: no non-finite checkpoint rotated it out
    assert trainer.state.global_step == 6
    assert sorted(os.listdir(out)) == ["checkpoint-3"]
    # AND the detection's event names it
    event = json.loads((dump / f"step{BAD:06d}-event.json").read_text())
    assert event["last_checkpoint"] == str(out / "checkpoint-3")
    assert event["describe"].endswith(f"; checkpoints are not saved until a clean step, the last good one: "
                                      f"{out / 'checkpoint-3'}")


class QuarantineModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _HugeBatch(pl.Callback):
    """The batch of step BAD scaled to overflow float16: its loss is inf, GradScaler skips its update, and the
    steps after it are clean again."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == BAD:
            batch[0].mul_(1e6)


def test_lightning_model_checkpoint_pauses_at_a_nonfinite_step_and_resumes_at_a_clean_one(tmp_path: Path) -> None:
    # GIVEN a 16-mixed Lightning run (GradScaler) with a ModelCheckpoint every step, one overflowing batch at
    # step 3, and nanhunt's callback letting the run go on
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)),
        batch_size=4)
    ckpt = tmp_path / "ckpt"
    saver = pl.callbacks.ModelCheckpoint(dirpath=ckpt, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    dump = tmp_path / "nan"
    nanhunt_cb = LightningCallback(dump_dir=dump, on_fail="dump")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, plugins=[pl.plugins.MixedPrecision("16-mixed",
                         "cpu")], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[_HugeBatch(), nanhunt_cb, saver])
    # WHEN it trains its 6 steps
    trainer.fit(QuarantineModule(), loader)
    # THEN the step that went non-finite left no checkpoint; the clean steps before and after it did
    assert sorted(os.listdir(ckpt)) == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt", "step=5.ckpt", "step=6.ckpt"]
    # AND the detection's event names the last good checkpoint
    event = json.loads((dump / f"step{BAD:06d}-event.json").read_text())
    assert (event["kind"], event["last_checkpoint"]) == ("loss", str(ckpt / "step=3.ckpt"))
