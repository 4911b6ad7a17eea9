"""``nanhunt.integrations.lightning.NanhuntCallback`` on real Lightning runs on the CPU.

A small LightningModule is trained a few steps; a test callback turns one weight ``inf`` at a known optimizer
step. Without nanhunt Lightning logs ``inf``/``nan`` and carries on; with the callback the run stops at that step
and leaves a capture that ``nanhunt replay CKPT BATCH --model pkg.mod:Module`` replays through the module's own
``training_step`` (no ``--loss``), in the dtype and with the GradScaler the precision plugin trained with.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.capture.capture import callable_path, load_step
from nanhunt.cli import main as cli_main
from nanhunt.records import Report

pl = pytest.importorskip("lightning.pytorch")

from nanhunt.integrations.lightning import NanhuntCallback  # noqa: E402

STEP = 3  # the optimizer step (trainer.global_step) whose weights are poisoned
D_IN = 8


class TinyModule(pl.LightningModule):
    """What a user writes: hyper-parameters saved, the loss computed (and logged) in training_step."""

    def __init__(self, d_in: int = D_IN, hidden: int = 16, lr: float = 1e-2, eps: float = 1e-8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y.float())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, eps=self.hparams.eps)


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, D_IN, generator=g), torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Poison(pl.Callback):
    """Turns fc1's bias inf as micro-batch ``micro`` of optimizer step ``at`` begins; records every batch. (The
    bias, not a weight entry: ``inf * x`` is ``-inf`` for a negative input, which ReLU makes 0 again.)"""

    def __init__(self, at: int = STEP, micro: int = 0) -> None:
        self.at, self.micro = at, micro
        self.seen: list[torch.Tensor] = []
        self._step, self._micro = -1, 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch[0].detach().clone())
        self._micro = self._micro + 1 if trainer.global_step == self._step else 0
        self._step = trainer.global_step
        if (self._step, self._micro) == (self.at, self.micro):
            with torch.no_grad():
                pl_module.fc1.bias[0] = float("inf")


try:
    import pytorch_lightning as ptl
except ImportError:  # pragma: no cover - lightning alone is enough for the other tests
    ptl = None
else:
    class PTLModule(ptl.LightningModule):
        """The same module for a pytorch_lightning Trainer (it takes only its own LightningModule)."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(D_IN, 16), nn.Linear(16, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.fc2(torch.relu(self.fc1(batch[0]))).float(), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    class PTLPoison(Poison, ptl.Callback):
        pass


def _fit(tmp_path: Path, callbacks: list[Any], *, precision: str = "bf16-mixed", steps: int = 6,
         accumulate: int = 1, lightning: Any = pl, module: Callable[[], Any] = TinyModule) -> Any:
    torch.manual_seed(0)
    model = module()
    plugin: dict[str, Any] = {"precision": precision}
    if precision == "16-mixed":  # Lightning turns precision="16-mixed" into bf16-mixed on the CPU; its plugin runs it
        plugin = {"plugins": [lightning.plugins.MixedPrecision("16-mixed", "cpu")]}
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate, **plugin,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=callbacks)
    trainer.fit(model, _loader())
    return trainer, model


def _stopped(tmp_path: Path, **kw: Any) -> tuple[Any, Any, nanhunt.GuardEvent]:
    dump = tmp_path / "nan"
    with pytest.raises(nanhunt.GuardError) as info:
        _fit(tmp_path, [Poison(), NanhuntCallback(dump_dir=dump)], **kw)
    ev = info.value.event
    assert f"nanhunt replay {ev.checkpoint} {ev.batch}" in str(info.value)
    return info, dump, ev


def test_bf16_mixed_run_stops_at_the_bad_step_and_replays_through_training_step(tmp_path: Path) -> None:
    # GIVEN the module in bf16-mixed with fc1's bias turned inf as step 3 begins, and the callback
    # WHEN it trains
    info, dump, ev = _stopped(tmp_path)
    # THEN it stops at step 3 with the capture written, saying how to replay it
    assert (ev.step, ev.captured_step) == (STEP, STEP)
    assert ev.checkpoint == str(dump / "step000003-checkpoint.pt")
    factory = callable_path(TinyModule)
    assert factory is not None
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "Lightning" in note and f"--model {factory}" in note
    # AND the capture rebuilds the module from its saved hyper-parameters, replays its training_step as the loss
    # in bfloat16 autocast, without a scaler
    assert ev.checkpoint is not None and ev.batch is not None
    step = load_step(ev.checkpoint, ev.batch, model_factory=factory)
    assert isinstance(step.model, TinyModule) and step.loss_fn is None
    assert (step.dtype, step.scaler) == (torch.bfloat16, None)
    # AND `nanhunt replay CKPT BATCH --model pkg.mod:TinyModule` names the inf bias's module
    out = tmp_path / "report.json"
    assert cli_main(["replay", ev.checkpoint, ev.batch, "--model", factory, "--report", str(out)]) == 1
    first = Report.from_json(out.read_text()).first
    assert first is not None and (first.phase.value, first.module) == ("weights", "fc1")


@pytest.mark.parametrize(("precision", "dtype", "scaled", "weights"), [
    ("16-mixed", torch.float16, True, torch.float32),
    ("16-true", torch.float32, False, torch.float16),
    ("bf16-true", torch.float32, False, torch.bfloat16),
])
def test_precision_plugins_map_to_the_replay_dtype_and_scaler(tmp_path: Path, precision: str, dtype: torch.dtype,
                                                              scaled: bool, weights: torch.dtype) -> None:
    # GIVEN the poisoned module trained with another precision plugin (Adam's eps=1e-8 is 0 in float16: a
    # float16 model's first updates would be 0/0, which the guard rightly stops at)
    # WHEN it trains
    _, _, ev = _stopped(tmp_path, precision=precision, module=lambda: TinyModule(eps=1e-4))
    # THEN it stops at step 3, and the capture replays with the autocast dtype (float32: none), the GradScaler
    # and the weights' dtype that plugin trained with
    assert ev.step == STEP and ev.checkpoint is not None and ev.batch is not None
    factory = callable_path(TinyModule)
    assert factory is not None
    step = load_step(ev.checkpoint, ev.batch, model_factory=factory)
    assert (step.dtype, step.scaler is not None, step.model.fc1.weight.dtype) == (dtype, scaled, weights)


def test_gradient_accumulation_stops_at_the_update_and_holds_its_micro_batch(tmp_path: Path) -> None:
    # GIVEN 2 micro-batches per update, the weight inf from update 3's second micro-batch on
    poison = Poison(micro=1)
    with pytest.raises(nanhunt.GuardError) as info:
        _fit(tmp_path, [poison, NanhuntCallback(dump_dir=tmp_path / "nan")], accumulate=2)
    # THEN it stops at update 3, and the capture holds that micro-batch
    ev = info.value.event
    assert ev.step == STEP and len(poison.seen) == 2 * STEP + 2
    assert ev.checkpoint is not None and ev.batch is not None
    factory = callable_path(TinyModule)
    assert factory is not None
    step = load_step(ev.checkpoint, ev.batch, model_factory=factory)
    assert torch.equal(step.inputs[0][0], poison.seen[-1])


def test_a_clean_run_is_unchanged_by_the_callback(tmp_path: Path) -> None:
    # GIVEN the same clean bf16-mixed run twice, with and without the callback
    runs = []
    for callbacks in ([], [NanhuntCallback(dump_dir=tmp_path / "nan")]):
        # WHEN each trains
        _, model = _fit(tmp_path, callbacks, steps=4)
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    # THEN the weights are bit for bit the same and nothing was written
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not (tmp_path / "nan").exists()


@pytest.mark.skipif(ptl is None, reason="pytorch_lightning is not installed")
def test_pytorch_lightning_trainer_takes_the_same_callback(tmp_path: Path) -> None:
    # GIVEN a pytorch_lightning Trainer and module, poisoned at step 3
    # WHEN it trains with the same callback class
    with pytest.raises(nanhunt.GuardError) as info:
        _fit(tmp_path, [PTLPoison(), NanhuntCallback(dump_dir=tmp_path / "nan")], lightning=ptl, module=PTLModule)
    # THEN it stops there too, and the capture replays through that module's training_step
    ev = info.value.event
    assert ev.step == STEP and ev.checkpoint is not None and ev.batch is not None
    factory = callable_path(PTLModule)
    assert factory is not None
    out = tmp_path / "report.json"
    assert cli_main(["replay", ev.checkpoint, ev.batch, "--model", factory, "--no-bisect", "--report", str(out)]) == 1
    first = Report.from_json(out.read_text()).first
    assert first is not None and (first.phase.value, first.module) == ("weights", "fc1")


class Gained(TinyModule):
    """TinyModule's output times ``gain``: a plain attribute (no parameter, no buffer), which no checkpoint holds."""

    def __init__(self, **hparams: Any) -> None:
        super().__init__(**hparams)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


class SetGain(pl.Callback):
    """Sets the module's ``gain`` to inf for optimizer step ``at`` (1.0 otherwise)."""

    def __init__(self, at: int = STEP) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pl_module.gain = float("inf") if trainer.global_step == self.at else 1.0


def test_a_step_that_fails_only_by_state_no_capture_holds_replays_not_reproducible(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a run stopped at step 3 with a non-finite loss, caused by a module attribute a callback set
    with pytest.raises(nanhunt.GuardError) as info:
        _fit(tmp_path, [SetGain(), NanhuntCallback(dump_dir=tmp_path / "nan")], module=Gained)
    ev = info.value.event
    assert (ev.step, ev.kind) == (STEP, "loss") and ev.checkpoint is not None and ev.batch is not None
    factory = callable_path(Gained)
    assert factory is not None
    capsys.readouterr()
    # WHEN its capture is replayed (the module rebuilt: gain 1.0)
    out = tmp_path / "report.json"
    code = cli_main(["replay", ev.checkpoint, ev.batch, "--model", factory, "--report", str(out)])
    # THEN it is not called clean: exit 3, the verdict not-reproducible, the Guard's event beside it
    said = capsys.readouterr()
    assert code == 3, said.err
    rep = Report.from_json(out.read_text())
    assert rep.status == "not-reproducible" and rep.verdict is not None and rep.verdict.kind == "not-reproducible"
    assert rep.guard_event is not None and rep.guard_event.step == STEP
    assert said.out.startswith(f"Not reproducible: the Guard saw step {STEP} fail (non-finite loss)")
