"""A ``transformers`` model's capture is rebuilt from the class and JSON config it names, and from nothing else.

The class must resolve (vetted as every name read from a file) to a ``PreTrainedModel`` subclass of the
transformers package; its config class is the class's own ``config_class``; the config is plain JSON that asks to
fetch nothing (remote code, a pretrained backbone); the attention kernel is one of torch's (transformers would
download and run a Hub kernel named there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt._util._errors import InputError
from nanhunt.capture.capture import load_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def _capture(tmp_path: Path) -> tuple[str, str]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (2, 8))
    ck, bt = str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt")
    nanhunt.save_capture(ck, bt, model=model, batch={"input_ids": ids, "labels": ids}, dtype=torch.float32)
    return ck, bt


def _tampered(ck: str, **hf: Any) -> str:
    data = torch.load(ck, weights_only=True)
    data["hf_model"].update(hf)
    torch.save(data, ck)
    return ck


def test_a_saved_transformers_model_replays_with_no_model_flag(tmp_path: Path) -> None:
    # GIVEN a capture of a GPT-2 built with eager attention, saved under its own class name
    ck, bt = _capture(tmp_path)
    # WHEN it is loaded with no --model
    step = load_step(ck, bt)
    # THEN the model is rebuilt from the saved config, with the attention kernel the run used; its loss is its own
    assert type(step.model) is transformers.GPT2LMHeadModel
    assert step.model.config._attn_implementation == "eager" and step.loss_fn is None


@pytest.mark.parametrize("name", [
    "torch.nn:Linear",  # an nn.Module, not a transformers model
    "os:system",
    "transformers:Trainer",  # of transformers, not a model
    "transformers.models.gpt2.modeling_gpt2:GPT2Config",
    "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel.__init__",
    "transformers.models.gpt2.modeling_gpt2:torch.nn.Linear",  # through another module
    "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel.config_class",
])
def test_a_class_that_is_no_transformers_model_is_refused(tmp_path: Path, name: str) -> None:
    # GIVEN a capture whose hf_model names something else
    ck, bt = _capture(tmp_path)
    _tampered(ck, **{"class": name})
    # WHEN it is loaded  THEN it is refused, with the way out
    with pytest.raises(InputError, match="--model"):
        load_step(ck, bt)


@pytest.mark.parametrize("entry", [
    {"auto_map": {"AutoModel": "evil.modeling:Model"}},
    {"trust_remote_code": True},
    {"use_pretrained_backbone": True},
    {"backbone": "some-org/some-backbone"},
    {"text_config": {"auto_map": {"AutoModel": "evil.modeling:Model"}}},
    {"deep": json.loads("[" * 100 + "]" * 100)},  # too deep to check
])
def test_a_config_that_asks_to_fetch_something_is_refused(tmp_path: Path, entry: dict[str, Any]) -> None:
    # GIVEN a capture whose config asks for remote code or a pretrained backbone
    ck, bt = _capture(tmp_path)
    config = json.loads(torch.load(ck, weights_only=True)["hf_model"]["config"])
    _tampered(ck, config=json.dumps({**config, **entry}))
    # WHEN it is loaded  THEN it is refused before anything is built
    with pytest.raises(InputError, match="fetch"):
        load_step(ck, bt)


def test_an_attention_kernel_from_the_hub_is_refused(tmp_path: Path) -> None:
    # GIVEN a capture naming a Hub kernel as its attention implementation
    ck, bt = _capture(tmp_path)
    _tampered(ck, attn_implementation="kernels-community/flash-attn")
    # WHEN it is loaded  THEN it is refused
    with pytest.raises(InputError, match="attention kernel"):
        load_step(ck, bt)


def test_the_config_cannot_choose_the_attention_kernel(tmp_path: Path) -> None:
    # GIVEN a capture whose JSON config itself names a Hub kernel (both spellings transformers reads)
    ck, bt = _capture(tmp_path)
    config = json.loads(torch.load(ck, weights_only=True)["hf_model"]["config"])
    _tampered(ck, config=json.dumps({**config, "attn_implementation": "kernels-community/x",
                                     "_attn_implementation": "kernels-community/y"}))
    # WHEN it is loaded  THEN the model uses the kernel the run recorded, not the config's
    step = load_step(ck, bt)
    assert step.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("config", ["[1, 2]", "not json", "null"])
def test_a_config_that_is_no_json_object_is_refused(tmp_path: Path, config: str) -> None:
    ck, bt = _capture(tmp_path)
    _tampered(ck, config=config)
    with pytest.raises(InputError, match="JSON object"):
        load_step(ck, bt)


@pytest.mark.parametrize(("change", "said"), [
    ({"n_layer": 1_000_000}, "names 1,000,000 layers (n_layer), more than the"),
    ({"n_embd": 16_384, "n_head": 2}, "holds 3,222,126,592 values, far more than its weights' 4,464"),
], ids=["a-million-layers", "a-huge-width"])
def test_a_config_bigger_than_the_captures_weights_is_refused_before_it_is_built(
        tmp_path: Path, change: dict[str, int], said: str) -> None:
    # GIVEN a capture whose hf_model config names far more model than its weights hold
    ck, bt = _capture(tmp_path)
    data = torch.load(ck, weights_only=True)
    config = json.loads(data["hf_model"]["config"])
    config.update(change)
    _tampered(ck, config=json.dumps(config))
    # WHEN it is loaded  THEN it is refused in one line, nothing built (no memory for it, no minutes of layers)
    with pytest.raises(InputError, match="the config does not belong to them: pass --model") as info:
        load_step(ck, bt)
    assert said in str(info.value) and "\n" not in str(info.value)
