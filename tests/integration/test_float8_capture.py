"""Captures rebuild what ran: torchao's float8 training conversion and QLoRA's NF4 weights are recorded by the Guard
(and the callbacks, which write through it) and rebuilt by the replay after the model is built, so a captured
float8 failure replays as float8 (CPU: float8 matmuls emulated).

The float8 model is the CLIP-style head of ``test_float8_bisect``, of a class that keeps its argument: one sample
with an outlier feature sets ``proj``'s tensorwise scale, every other sample's projection is 0 and ``z / z.norm()``
is 0/0. Before, its Guard capture held the weights of a plain model and replayed finite (``not-reproducible``, 3).
"""

from __future__ import annotations

import dataclasses
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.capture.capture import load_step
from nanhunt.cli import main as cli_main
from nanhunt.records import Report

float8 = pytest.importorskip("torchao.float8")
quantization = pytest.importorskip("torchao.quantization")

pytestmark = pytest.mark.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.integration.test_float8_capture:Clip8"


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


class Clip8(nn.Module):
    """Bias-free projections and L2 normalisation without eps, as CLIP's code has it."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(dim, 16, bias=False)
        self.text_proj = nn.Linear(dim, 16, bias=False)
        self.act = nn.Identity()

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        zi = self.proj(img)
        zi = zi / zi.norm(dim=-1, keepdim=True)
        zt = self.text_proj(txt)
        zt = zt / zt.norm(dim=-1, keepdim=True)
        return self.act(10 * zi @ zt.t())


def _config() -> Any:
    return float8.Float8LinearConfig(emulate=True)


def _float8_model(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float8.convert_to_float8_training(Clip8(), config=_config(), **kw)  # type: ignore[no-any-return]


def _batch(i: int, *, outlier: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(10 + i)
    img = torch.randn(16, 32, generator=g) * 0.01
    img[0, 3] = 3e4 if outlier else 0.05
    return (img, torch.randn(16, 32, generator=g)), torch.arange(16)


def _layers(model: nn.Module) -> dict[str, Any]:
    """Every float8 layer's name and config."""
    return {n: m.config for n, m in model.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)}


def _guarded_loop(dump: Path) -> nanhunt.GuardEvent:
    """A float8 training loop under the Guard whose step 2 holds the outlier sample."""
    model = _float8_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanhunt.Guard(model, opt, None, dump_dir=dump, loss_fn=F.cross_entropy)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(4):
            (img, txt), y = _batch(i, outlier=i == 2)
            with guard.step(((img, txt), y)):
                opt.zero_grad()
                loss = guard.loss(F.cross_entropy(model(img, txt), y))
                loss.backward()
                guard.check_grads()
                opt.step()
    return info.value.event


def _tensorwise_record() -> dict[str, Any]:
    cast = {"scaling_type": "DYNAMIC", "scaling_granularity": "TENSORWISE", "target_dtype": "float8_e4m3fn"}
    grad = {**cast, "target_dtype": "float8_e5m2"}
    return {
        "cast_config_input": cast, "cast_config_input_for_grad_weight": cast, "cast_config_weight": cast,
        "cast_config_weight_for_grad_input": cast, "cast_config_grad_output": grad,
        "cast_config_grad_output_for_grad_weight": grad, "gemm_config_output": {"use_fast_accum": True},
        "gemm_config_grad_input": {"use_fast_accum": False}, "gemm_config_grad_weight": {"use_fast_accum": False},
        "enable_fsdp_float8_all_gather": False, "pad_inner_dim": False, "emulate": True,
        "force_recompute_fp8_weight_in_bwd": False, "round_scales_to_power_of_2": False,
    }


@pytest.mark.slow
def test_guard_capture_of_a_float8_loop_replays_as_float8_and_names_proj(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a float8 loop the Guard stops at step 2 (the outlier batch)
    ev = _guarded_loop(tmp_path / "nan")
    assert (ev.step, ev.kind, ev.captured_step) == (2, "loss", 2)
    assert ev.checkpoint is not None and ev.batch is not None
    # THEN its capture says, as plain data, which layers ran in float8 and with which config; and how the model was
    # built (its float8 layers seen as the nn.Linear they were built as)
    ck = torch.load(ev.checkpoint, weights_only=True)
    assert ck["lowp"] == {"float8": [{"config": _tensorwise_record(), "modules": ["proj", "text_proj"]}],
                          "nf4": [], "torchao_version": __import__("torchao").__version__}
    assert ck["model_init"] is not None and ck["model_init"]["kwargs"] == {"dim": 32}
    # WHEN it is loaded: the same layers in float8 with the same config
    step = load_step(ev.checkpoint, ev.batch)
    assert _layers(step.model) == {"proj": _config(), "text_proj": _config()}
    assert any("float8 training rebuilt" in n for n in step.notes)
    # the same first non-finite op as a trace of the live model at that step
    live = _float8_model()
    (img, txt), y = _batch(2, outlier=True)
    with nanhunt.trace(live) as t:
        F.cross_entropy(live(img, txt), y).backward()
    assert t.first is not None
    # WHEN the printed command is run THEN exit 1: the NaN born at the div, proj the layer to take out of float8
    command = ev.replay_command()
    assert command is not None
    argv = shlex.split(command)
    assert argv[:2] == ["nanhunt", "replay"]
    out = tmp_path / "report.json"
    capsys.readouterr()
    assert cli_main([*argv[1:], "--report", str(out)]) == 1, capsys.readouterr().err
    report = Report.from_json(out.read_text())
    first = report.first
    assert first is not None and (first.phase, first.module, first.op) == (t.first.phase, t.first.module, t.first.op)
    assert (first.phase.value, first.module, first.op) == ("forward", "", "aten::div")
    v = report.verdict
    assert v is not None and (v.kind, v.culprits, v.confirmed, v.rowwise_fixes) == (
        "float8-induced", ("proj",), True, True)


def test_save_capture_of_a_float8_model_loads_back_the_same_step_bit_for_bit(tmp_path: Path) -> None:
    # GIVEN a float8 model with one layer converted with the rowwise recipe and the other tensorwise (two
    # conversions, as the bisection's fix writes them), saved on a clean step
    torch.manual_seed(0)
    model = Clip8()
    rowwise = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float8.convert_to_float8_training(model, config=rowwise, module_filter_fn=lambda m, fqn: fqn == "proj")
        float8.convert_to_float8_training(model, config=_config(), module_filter_fn=lambda m, fqn: fqn != "proj")
    b = _batch(0, outlier=False)
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=b, loss_fn=F.cross_entropy, model_factory=FACTORY,
                         dtype=torch.float32)
    saved = torch.load(ck, weights_only=True)["lowp"]["float8"]
    assert [g["modules"] for g in saved] == [["proj"], ["text_proj"]]
    assert saved[0]["config"]["cast_config_input"]["scaling_granularity"] == "AXISWISE"
    # WHEN it is loaded THEN each layer has its own config again, the weights are the same tensors' values
    step = load_step(str(ck), str(bt))
    assert _layers(step.model) == {"proj": rowwise, "text_proj": _config()}
    assert all(torch.equal(a, model.state_dict()[k]) for k, a in step.model.state_dict().items())
    # AND a plain forward and backward give the same loss and gradients, bit for bit
    (img, txt), y = b
    want = F.cross_entropy(model(img, txt), y)
    want.backward()
    (img2, txt2), y2 = step.inputs, step.targets
    got = F.cross_entropy(step.model(img2, txt2), y2)
    got.backward()
    assert want.item().hex() == got.item().hex()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), step.model.parameters()))


def test_a_gpu_capture_replayed_on_the_cpu_is_emulated(tmp_path: Path) -> None:
    # GIVEN a capture whose float8 config does not emulate (a GPU run with float8 matmuls)
    model = _float8_model()
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=_batch(0, outlier=False), loss_fn=F.cross_entropy,
                         model_factory=FACTORY, dtype=torch.float32)
    data = torch.load(ck, weights_only=True)
    data["lowp"]["float8"][0]["config"]["emulate"] = False
    torch.save(data, ck)
    # WHEN it is loaded on the CPU THEN the layers are emulated, and the replay says so
    step = load_step(str(ck), str(bt))
    assert _layers(step.model) == {"proj": _config(), "text_proj": _config()}
    assert any("emulated on the cpu" in n for n in step.notes)


def test_guard_on_a_float8_sequential_captures_its_layers_and_replays_as_float8(tmp_path: Path) -> None:
    # GIVEN torch.nn's own Sequential converted to float8: before, the Guard refused it when made (its layers were
    # not torch.nn's classes)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = float8.convert_to_float8_training(
            nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)), config=_config())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nanhunt.Guard(model, opt, None, dump_dir=tmp_path, loss_fn=F.mse_loss)
    x = torch.randn(16, 32)
    x[0, 0] = float("inf")
    with pytest.raises(nanhunt.GuardError) as info:
        with guard.step((x, torch.zeros(16, 16))):
            guard.loss(F.mse_loss(model(x), torch.zeros(16, 16)))
    ev = info.value.event
    assert ev.checkpoint is not None and ev.batch is not None
    # WHEN its capture is loaded with no --model THEN torch.nn's layers are rebuilt, then converted
    step = load_step(ev.checkpoint, ev.batch)
    assert isinstance(step.model, nn.Sequential) and set(_layers(step.model)) == {"0", "2"}


# ------------------------------------------------------------------ QLoRA's NF4 weights
class QLoRA(nn.Module):
    """A frozen base projection (made NF4 after building, as QLoRA recipes do) and a bfloat16 LoRA adapter."""

    def __init__(self, dim: int = 256, rank: int = 8) -> None:
        super().__init__()
        self.dim, self.rank = dim, rank
        self.base = nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)
        self.lora_a = nn.Linear(dim, rank, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(rank, dim, bias=False, dtype=torch.bfloat16)
        self.head = nn.Linear(dim, 4, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + self.lora_b(self.lora_a(x))))


def _qlora() -> QLoRA:
    torch.manual_seed(0)
    m = QLoRA()
    with torch.no_grad():
        m.base.weight.normal_(std=0.02)  # as a pretrained weight's (GPT-2's initialisation)
    m.base.weight = nn.Parameter(quantization.to_nf4(m.base.weight.detach()), requires_grad=False)
    return m


def _qbatch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 256, generator=g).bfloat16(), torch.randn(8, 4, generator=g).bfloat16()


def _parts(t: Any) -> dict[str, torch.Tensor]:
    return {n: getattr(t, n) for n in t.__tensor_flatten__()[0]}


def test_nf4_weights_are_saved_plain_beside_their_parts_and_rebuilt_exactly(tmp_path: Path) -> None:
    model = _qlora()
    nf4 = model.base.weight
    # quantizing the dequantized weight again is not the same NF4 weight (a block's absolute maximum moved, and
    # its quantized scaler with it): why the capture keeps the parts
    again = quantization.to_nf4(nf4.get_original_weight(), nf4.block_size, nf4.scaler_block_size)
    assert not torch.equal(again.get_original_weight(), nf4.get_original_weight())
    # GIVEN a capture of a clean QLoRA step
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=_qbatch(0), loss_fn=F.mse_loss,
                         model_factory="tests.integration.test_float8_capture:QLoRA", dtype=torch.float32)
    # THEN it loads without torchao's classes: the base weight dequantized, its parts plain tensors beside
    data = torch.load(ck, weights_only=True)
    assert type(data["model"]["base.weight"]) is torch.Tensor
    assert torch.equal(data["model"]["base.weight"], nf4.get_original_weight())
    assert data["lowp"]["nf4"] == [{"weight": "base.weight", "block_size": 64, "scaler_block_size": 256,
                                    "requires_grad": False}]
    assert all(torch.equal(data["nf4_parts"]["base.weight"][k], v) for k, v in _parts(nf4).items())
    # WHEN it is loaded THEN the base weight is an NF4Tensor again with the same parts, frozen
    step = load_step(str(ck), str(bt))
    w = step.model.base.weight
    assert isinstance(w, quantization.NF4Tensor) and not w.requires_grad
    assert (w.block_size, w.scaler_block_size) == (64, 256)
    assert all(torch.equal(_parts(w)[k], v) for k, v in _parts(nf4).items())
    # AND the step's loss is the same bit for bit
    x, y = _qbatch(0)
    assert F.mse_loss(model(x), y).item().hex() == F.mse_loss(step.model(step.inputs), step.targets).item().hex()


@pytest.mark.slow
def test_guard_snapshots_a_qlora_loop_and_its_capture_names_the_adapters_matmul(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a QLoRA loop under a Guard taking a snapshot every step (before, the snapshot's copy of the NF4 weight
    # raised inside the training loop), whose adapter diverged before step 2 (lora_a's weight 1, lora_b's 1e38:
    # lora_b's product is past bfloat16's maximum)
    model = _qlora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = nanhunt.Guard(model, opt, None, dump_dir=tmp_path, loss_fn=F.mse_loss, snapshot_every=1)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(4):
            x, y = _qbatch(i)
            if i == 2:
                with torch.no_grad():
                    model.lora_a.weight.fill_(1.0)
                    model.lora_b.weight.fill_(1e38)
            with guard.step((x, y)):
                opt.zero_grad()
                loss = guard.loss(F.mse_loss(model(x), y))
                loss.backward()
                guard.check_grads()
                opt.step()
    ev = info.value.event
    assert (ev.step, ev.captured_step) == (2, 2)
    assert ev.checkpoint is not None and ev.batch is not None
    # WHEN its capture is replayed THEN the base weight is NF4 again, and the first Inf is the adapter's matmul
    out = tmp_path / "report.json"
    capsys.readouterr()
    assert cli_main(["replay", ev.checkpoint, ev.batch, "--no-bisect", "--report", str(out)]) == 1, \
        capsys.readouterr().err
    first = Report.from_json(out.read_text()).first
    assert first is not None and (first.phase.value, first.module, first.op) == ("forward", "lora_b", "aten::mm")
    step = load_step(ev.checkpoint, ev.batch)
    assert isinstance(step.model.base.weight, quantization.NF4Tensor)
    assert all(torch.equal(_parts(step.model.base.weight)[k], v) for k, v in _parts(model.base.weight).items())


# ------------------------------------------------------------------ the Lightning callback
pl = None
try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover
    pass

if pl is not None:
    class Clip8Module(pl.LightningModule):
        def __init__(self, dim: int = 32) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = Clip8(dim)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            img, txt, y = batch
            return F.cross_entropy(self.net(img, txt), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(pl is None, reason="lightning is not installed")
def test_lightning_callback_records_the_float8_conversion(tmp_path: Path) -> None:
    from nanhunt.integrations.lightning import NanhuntCallback

    assert pl is not None
    torch.manual_seed(0)
    module = Clip8Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float8.convert_to_float8_training(module, config=_config())
    rows = [_batch(i, outlier=i == 2) for i in range(4)]
    data = [(img, txt, y) for (img, txt), y in rows]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, precision="32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[NanhuntCallback(dump_dir=tmp_path / "nan")])
    with pytest.raises(nanhunt.GuardError) as info:
        trainer.fit(module, loader)
    ev = info.value.event
    assert ev.step == 2 and ev.checkpoint is not None and ev.batch is not None
    ck = torch.load(ev.checkpoint, weights_only=True)
    assert ck["lowp"]["float8"] == [{"config": _tensorwise_record(), "modules": ["net.proj", "net.text_proj"]}]
    step = load_step(ev.checkpoint, ev.batch, model_factory="tests.integration.test_float8_capture:Clip8Module")
    assert _layers(step.model) == {"net.proj": _config(), "net.text_proj": _config()}
