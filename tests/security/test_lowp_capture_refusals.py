"""A capture's float8 and NF4 record is a suggestion: only fields torchao's Float8LinearConfig declares, of their
declared types (enum members and dtypes by name), module names the built model holds as nn.Linear layers, NF4 parts
of the shapes torchao's own quantization gives. Anything else is one line, exit 2, before the step runs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.cli import main as cli_main

float8 = pytest.importorskip("torchao.float8")
quantization = pytest.importorskip("torchao.quantization")

from tests.integration.test_float8_capture import Clip8, _qbatch, _qlora  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _float8_capture(tmp_path: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = float8.convert_to_float8_training(Clip8(), config=float8.Float8LinearConfig(emulate=True))
    g = torch.Generator().manual_seed(0)
    batch = ((torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)), torch.arange(16))
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=model, batch=batch, loss_fn=F.cross_entropy,
                         model_factory="tests.integration.test_float8_capture:Clip8", dtype=torch.float32)
    return ck, bt


def _nf4_capture(tmp_path: Path) -> tuple[Path, Path]:
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=_qlora(), batch=_qbatch(0), loss_fn=F.mse_loss,
                         model_factory="tests.integration.test_float8_capture:QLoRA", dtype=torch.float32)
    return ck, bt


def _config(ck: dict[str, Any]) -> dict[str, Any]:
    return ck["lowp"]["float8"][0]["config"]  # type: ignore[no-any-return]


FLOAT8_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown field", lambda ck: _config(ck).update(fancy_new_option=True),
     "its float8 config has field(s) fancy_new_option that torchao's Float8LinearConfig does not declare"),
    ("wrong type", lambda ck: _config(ck).update(emulate="yes"),
     "its float8 config field 'emulate' is 'yes', expected true or false"),
    ("enum member", lambda ck: _config(ck)["cast_config_input"].update(scaling_type="__class__"),
     "field 'cast_config_input.scaling_type' is '__class__', expected one of DYNAMIC, DISABLED"),
    ("dtype", lambda ck: _config(ck)["cast_config_weight"].update(target_dtype="int8"),
     "field 'cast_config_weight.target_dtype' is 'int8', expected a floating dtype's name"),
    ("nested config", lambda ck: _config(ck).update(gemm_config_output=[1]),
     "field 'gemm_config_output' is a list, expected the fields of Float8GemmConfig"),
    ("torchao's own check", lambda ck: _config(ck)["cast_config_input"].update(scaling_type="DISABLED"),
     "its float8 config: torchao refuses it (AssertionError: incompatible operand precision for output)"),
    ("module not in the model", lambda ck: ck["lowp"]["float8"][0].update(modules=["proj", "evil\x1b[2J"]),
     "ran module(s) evil\\x1b[2J in float8, which the model does not have"),
    ("module not a Linear", lambda ck: ck["lowp"]["float8"][0].update(modules=["act"]),
     "ran module(s) act in float8, which are not nn.Linear layers in the model"),
    ("module twice", lambda ck: ck["lowp"]["float8"][0].update(modules=["proj", "proj"]),
     "its float8 record names module 'proj' twice"),
    ("not a record", lambda ck: ck.update(lowp="float8"),
     "field 'lowp' is not a record of float8 layers and NF4 weights"),
]


@pytest.mark.parametrize(("case", "change", "said"), FLOAT8_CASES, ids=[c[0] for c in FLOAT8_CASES])
def test_a_bad_float8_record_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                                    change: Callable[[dict[str, Any]], None], said: str) -> None:
    ck, bt = _float8_capture(tmp_path)
    data = torch.load(ck, weights_only=True)
    change(data)
    torch.save(data, ck)
    before = ck.read_bytes()
    capsys.readouterr()
    code = cli_main(["replay", str(ck), str(bt), "--no-bisect"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("nanhunt: error:"), (case, err)
    assert said in lines[0] and "Traceback" not in err, (case, err)
    assert ck.read_bytes() == before


NF4_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("part of another shape",
     lambda ck: ck["nf4_parts"]["base.weight"].update(quantized_data=torch.zeros(10, dtype=torch.uint8)),
     "the NF4 part 'quantized_data' of 'base.weight' is uint8 (10,), expected uint8 (32768,)"),
    ("part of another dtype",
     lambda ck: ck["nf4_parts"]["base.weight"].update(nf4=torch.zeros(16, dtype=torch.float64)),
     "the NF4 part 'nf4' of 'base.weight' is float64 (16,), expected bfloat16 (16,)"),
    ("parts missing one", lambda ck: ck["nf4_parts"]["base.weight"].pop("scaler_mean"),
     "the NF4 parts of 'base.weight' are not torchao's"),
    ("block size that does not divide", lambda ck: ck["lowp"]["nf4"][0].update(block_size=7),
     "NF4 weight 'base.weight' cannot be quantized with block sizes 7 and 256"),
    ("block size not a count", lambda ck: ck["lowp"]["nf4"][0].update(block_size=0),
     "its NF4 record's entry 0 is not a weight name, two block sizes and a requires_grad flag"),
    ("weight not in the model", lambda ck: ck["lowp"]["nf4"][0].update(weight="base.bias"),
     "holds weight 'base.bias' as NF4, a parameter the model does not have"),
]


@pytest.mark.parametrize(("case", "change", "said"), NF4_CASES, ids=[c[0] for c in NF4_CASES])
def test_a_bad_nf4_record_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                                 change: Callable[[dict[str, Any]], None], said: str) -> None:
    ck, bt = _nf4_capture(tmp_path)
    data = torch.load(ck, weights_only=True)
    change(data)
    torch.save(data, ck)
    capsys.readouterr()
    code = cli_main(["replay", str(ck), str(bt), "--no-bisect"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("nanhunt: error:"), (case, err)
    assert said in lines[0] and "Traceback" not in err, (case, err)


def test_a_capture_without_a_record_never_imports_torchao() -> None:
    # a plain model's capture: the record is None and nothing of torchao is needed to read it
    from nanhunt.capture._lowp import read_plan

    assert read_plan({"lowp": None}, "checkpoint 'x'") is None
    model = nn.Linear(4, 4)
    from nanhunt.capture._lowp import captured

    state, record, parts = captured(model, model.state_dict())
    assert record is None and parts is None and state.keys() == {"weight", "bias"}
