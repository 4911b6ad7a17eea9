"""A PEFT model's capture is rebuilt from the base model's JSON config and the adapters' JSON configs alone.

The adapter's config class is the one peft maps its ``peft_type`` string to, limited to adapter types whose
construction reads nothing but the config (LoRA, LoHa, LoKr, IA3); every field is checked against the type the
class declares; entries naming a Hub model (``base_model_name_or_path``, ``revision``, ``auto_mapping``) are
ignored and unknown ones dropped, each with one note; nothing is imported from a name in the file, nothing is
downloaded (every socket connection is refused and counted here).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt._util._errors import InputError
from nanhunt.capture.capture import load_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TRAINABLE = ["base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight",
             "base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every connection attempt is refused and recorded: a test asserts none was made."""
    tried: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        tried.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


def _capture(tmp_path: Path, **lora: Any) -> tuple[str, str]:
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                n_positions=8))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, **lora))
    ids = torch.randint(0, 32, (2, 8))
    ck, bt = str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt")
    nanhunt.save_capture(ck, bt, model=model, batch={"input_ids": ids, "labels": ids}, dtype=torch.float32)
    return ck, bt


def _tampered(ck: str, **entries: Any) -> str:
    """The capture's adapter config with ``entries`` set (a value ``...`` removes the entry)."""
    data = torch.load(ck, weights_only=True)
    cfg = json.loads(data["hf_model"]["peft"]["peft_config"]["default"])
    cfg.update(entries)
    cfg = {k: v for k, v in cfg.items() if v is not ...}
    data["hf_model"]["peft"]["peft_config"]["default"] = json.dumps(cfg)
    torch.save(data, ck)
    return ck


def _refusal(ck: str, bt: str) -> str:
    with pytest.raises(InputError) as info:
        load_step(ck, bt)
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith("pass --model package.module:factory")
    return msg


def test_a_lora_capture_is_rebuilt_offline_with_no_note(tmp_path: Path, no_network: list[Any]) -> None:
    # GIVEN a LoRA capture saved as is
    ck, bt = _capture(tmp_path)
    # WHEN it is loaded with no --model
    step = load_step(ck, bt)
    # THEN the PEFT model is rebuilt, only its adapter trainable, with no note and no connection attempted
    assert type(step.model) is peft.PeftModel
    assert [n for n, p in step.model.named_parameters() if p.requires_grad] == TRAINABLE
    assert step.notes == () and no_network == []


@pytest.mark.parametrize("kind", ["EVIL", "os:system", "peft.tuners.lora:LoraConfig", "lora", 5, None])
def test_a_peft_type_peft_does_not_define_is_refused(tmp_path: Path, kind: Any) -> None:
    # GIVEN a capture whose adapter claims a peft_type that is not one of peft's (or an import path)
    ck, bt = _capture(tmp_path)
    _tampered(ck, peft_type=kind)
    # WHEN it is loaded  THEN it is refused in one line naming it, with the way out
    assert f"its peft_type {kind!r} is not an adapter type peft defines" in _refusal(ck, bt)


def test_a_peft_type_that_loads_something_by_name_is_refused(tmp_path: Path, no_network: list[Any]) -> None:
    # GIVEN a capture rewritten as prompt tuning, whose init loads a tokenizer named in the config
    ck, bt = _capture(tmp_path)
    _tampered(ck, peft_type="PROMPT_TUNING", prompt_tuning_init="TEXT", tokenizer_name_or_path="some-org/tok",
              prompt_tuning_init_text="hello", num_virtual_tokens=2, task_type="CAUSAL_LM")
    # WHEN it is loaded  THEN it is refused before peft sees it, and nothing was fetched
    assert "nanhunt rebuilds only LORA, LOHA, LOKR, IA3 adapters from a file, not PROMPT_TUNING" in _refusal(ck, bt)
    assert no_network == []


@pytest.mark.parametrize("value, said", [
    (5, "field 'target_modules' holds a number 5"),
    ({"c_attn": 1}, "field 'target_modules' holds an object"),
    ([1, 2], "field 'target_modules' holds a list [1, 2]"),
])
def test_a_target_modules_of_the_wrong_type_is_refused(tmp_path: Path, value: Any, said: str) -> None:
    # GIVEN a capture whose target_modules is not a module name, pattern or list of names
    ck, bt = _capture(tmp_path)
    _tampered(ck, target_modules=value)
    # WHEN it is loaded  THEN it is refused, naming the field, what it holds and what LoraConfig takes
    msg = _refusal(ck, bt)
    assert said in msg and "not what LoraConfig takes (list[str] | str | null)" in msg


@pytest.mark.parametrize("entry", [{"r": "8"}, {"r": True}, {"lora_dropout": "0.1"}, {"bias": "everything"},
                                   {"eva_config": {"rho": 2.0}},
                                   {"layers_to_transform": [0, "1"]}])
def test_other_fields_of_the_wrong_type_are_refused(tmp_path: Path, entry: dict[str, Any]) -> None:
    # GIVEN a capture with one field that is not of its declared type (a nested config class takes only null)
    ck, bt = _capture(tmp_path)
    _tampered(ck, **entry)
    # WHEN it is loaded  THEN it is refused, naming the field
    assert f"field {next(iter(entry))!r} holds" in _refusal(ck, bt)


def test_hub_entries_are_ignored_with_one_note_and_nothing_is_downloaded(tmp_path: Path,
                                                                          no_network: list[Any]) -> None:
    # GIVEN a capture whose adapter names a Hub base model, a revision and an auto mapping
    ck, bt = _capture(tmp_path)
    _tampered(ck, base_model_name_or_path="evil-org/evil-model", revision="main",
              auto_mapping={"base_model_class": "EvilModel", "parent_library": "evil.lib"})
    # WHEN it is loaded
    step = load_step(ck, bt)
    # THEN the model is rebuilt from the capture's config, the entries are said in one note, nothing was fetched
    assert type(step.model) is peft.PeftModel
    assert step.model.peft_config["default"].base_model_name_or_path is None
    assert step.model.peft_config["default"].auto_mapping is None
    assert step.notes == (
        "adapter 'default': base_model_name_or_path='evil-org/evil-model'; revision='main'; auto_mapping="
        "{'base_model_class': 'EvilModel', 'parent_library': 'evil.lib'} ignored: nothing is downloaded, the base "
        "model is rebuilt from the capture's config",)
    assert no_network == [] and "evil" not in sys.modules and "evil.lib" not in sys.modules


def test_unknown_entries_are_dropped_with_a_note(tmp_path: Path) -> None:
    # GIVEN a capture whose adapter config has entries this peft does not know (a newer peft, or a forged file)
    ck, bt = _capture(tmp_path)
    _tampered(ck, future_option=1, __class__="os:system")
    # WHEN it is loaded  THEN they are dropped, said in one note
    step = load_step(ck, bt)
    assert step.notes == (f"adapter 'default': config entries this peft ({peft.__version__}) does not know were "
                          "dropped: __class__, future_option",)


def test_a_megatron_config_that_imports_a_named_module_is_refused(tmp_path: Path) -> None:
    # GIVEN a capture whose LoRA asks for Megatron layers from a module the file names
    ck, bt = _capture(tmp_path)
    _tampered(ck, megatron_config={"tensor_model_parallel_size": 1}, megatron_core="evil.core")
    # WHEN it is loaded  THEN it is refused, and the module was not imported
    assert "its megatron_config makes peft import the module megatron_core names" in _refusal(ck, bt)
    assert "evil" not in sys.modules


def test_a_data_driven_initialisation_is_not_run(tmp_path: Path) -> None:
    # GIVEN a capture whose LoRA says init_lora_weights="pissa" (computed from the base weights)
    ck, bt = _capture(tmp_path)
    _tampered(ck, init_lora_weights="pissa")
    saved = torch.load(ck, weights_only=True)["model"]
    # WHEN it is loaded
    step = load_step(ck, bt)
    # THEN the weights are the capture's, and a note says the initialisation was not run
    assert all(torch.equal(v, saved[k]) for k, v in step.model.state_dict().items())
    assert step.notes == ("adapter 'default': init_lora_weights='pissa' not run: the capture holds the weights it "
                          "made",)


@pytest.mark.parametrize("peft_entry", [
    "LORA",
    {"peft_config": {}, "active_adapter": "default", "trainable": []},
    {"peft_config": {"default": {"peft_type": "LORA"}}, "active_adapter": "default", "trainable": []},
    {"peft_config": {"default": "{}"}, "active_adapter": "other", "trainable": []},
    {"peft_config": {"default": "{}"}, "active_adapter": "default", "trainable": "all"},
])
def test_a_malformed_peft_entry_is_refused(tmp_path: Path, peft_entry: Any) -> None:
    # GIVEN a capture whose hf_model.peft is not adapter configs, the active adapter and trainable names
    ck, bt = _capture(tmp_path)
    data = torch.load(ck, weights_only=True)
    data["hf_model"]["peft"] = peft_entry
    torch.save(data, ck)
    # WHEN it is loaded  THEN it is refused in one line
    assert "field 'hf_model.peft' does not hold adapter configs" in _refusal(ck, bt)


def test_trainable_names_the_rebuilt_model_lacks_are_refused(tmp_path: Path) -> None:
    # GIVEN a capture whose trainable list names a parameter the model does not have
    ck, bt = _capture(tmp_path)
    data = torch.load(ck, weights_only=True)
    data["hf_model"]["peft"]["trainable"].append("base_model.model.evil.weight")
    torch.save(data, ck)
    # WHEN it is loaded  THEN it is refused, naming it
    with pytest.raises(InputError, match="trainable parameters base_model.model.evil.weight are not the rebuilt"):
        load_step(ck, bt)


def test_a_base_weight_unfrozen_in_training_stays_trainable(tmp_path: Path) -> None:
    # GIVEN a LoRA run that also trained a base weight (unfrozen by hand)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                n_positions=8))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    model.base_model.model.transformer.ln_f.weight.requires_grad_(True)
    ids = torch.randint(0, 32, (2, 8))
    ck, bt = str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt")
    nanhunt.save_capture(ck, bt, model=model, batch={"input_ids": ids, "labels": ids}, dtype=torch.float32)
    # WHEN it is loaded  THEN the same parameters require gradients
    step = load_step(ck, bt)
    assert [n for n, p in step.model.named_parameters() if p.requires_grad] == [
        *TRAINABLE, "base_model.model.transformer.ln_f.weight"]


def test_without_peft_installed_the_replay_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a LoRA capture, replayed where peft cannot be imported
    ck, bt = _capture(tmp_path)
    monkeypatch.setitem(sys.modules, "peft", None)
    # WHEN it is loaded  THEN one line says to install it or pass --model
    msg = _refusal(ck, bt)
    assert "holds a PEFT adapter, and peft is not installed here; install it (pip install nanhunt[transformers])" in msg


REGEX = r"([\w.]+)+Z"  # matching it against a module name of 30 characters backtracks for minutes


@pytest.mark.parametrize("entry, said", [
    ({"target_modules": REGEX}, "its target_modules \"([\\\\w.]+)+Z\" is a pattern, not a module name"),
    ({"modules_to_save": ["lm_head", REGEX]}, "its modules_to_save \"([\\\\w.]+)+Z\" is a pattern, not a module name"),
    ({"exclude_modules": "(a|aa)+b"}, "its exclude_modules \"(a|aa)+b\" is a pattern, not a module name"),
    ({"layers_pattern": [REGEX]}, "its layers_pattern \"([\\\\w.]+)+Z\" is a pattern, not a module name"),
    ({"rank_pattern": {REGEX: 2}}, "its rank_pattern names \"([\\\\w.]+)+Z\", which is a pattern, not a module name"),
], ids=["target_modules", "modules_to_save", "exclude_modules", "layers_pattern", "rank_pattern"])
def test_a_pattern_naming_modules_is_refused_unmatched(tmp_path: Path, entry: dict[str, Any], said: str) -> None:
    # GIVEN a capture whose adapter names its modules with a regular expression (peft matches it against every
    # module name: this one takes minutes)
    ck, bt = _capture(tmp_path)
    _tampered(ck, **entry)
    # WHEN it is loaded  THEN one line refuses it before any name is matched, saying how to build it instead
    assert f"{said}: nanhunt matches no pattern read from a file (one can run for hours); build the adapter in " \
           "your own factory; pass --model package.module:factory" in _refusal(ck, bt)


def test_module_names_and_suffixes_are_not_patterns(tmp_path: Path) -> None:
    # GIVEN a capture whose adapter names its modules by a dotted suffix and keeps lm_head trainable
    ck, bt = _capture(tmp_path)
    _tampered(ck, target_modules=["attn.c_attn"], modules_to_save=None, rank_pattern={"h.0.attn.c_attn": 2})
    # WHEN it is loaded  THEN it is rebuilt as saved
    assert [n for n, p in load_step(ck, bt).model.named_parameters() if p.requires_grad] == TRAINABLE


@pytest.mark.subprocess
def test_a_rank_of_four_million_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    from tests._support.peak import run_nanhunt

    # GIVEN a capture whose LoRA rank is 4,000,000 on a layer of 16 x 48 (built, it took 4.4 GB)
    ck, bt = _capture(tmp_path)
    _tampered(ck, r=4_000_000)
    # WHEN it is replayed in a child process
    code, err, peak = run_nanhunt(["replay", ck, bt], tmp_path)
    # THEN one line refuses it, and the child's peak memory stayed under 1 GiB
    assert (code, err.strip().splitlines()[-1]) == (
        2, "nanhunt: error: refusing to rebuild PEFT adapter 'default' from the capture: its rank 4000000 is larger "
           "than the smallest dimension (16) of 'transformer.h.0.attn.c_attn', which it adapts: a rank beyond it adds "
           "nothing an adapter can learn; pass --model package.module:factory")
    assert peak < 1 << 30


@pytest.mark.parametrize("entry, said", [
    ({"rank_pattern": {"c_attn": 100_000}}, "its rank 100000 is larger than the smallest dimension (16) of "
                                            "'transformer.h.0.attn.c_attn'"),
    ({"rank_pattern": {"c_attn": "8"}}, "its rank_pattern gives \"c_attn\" a string \"8\", not a rank"),
    ({"trainable_token_indices": list(range(1000))}, "its trainable_token_indices name a token twice or one beyond "
                                                     "the embedding's 32 rows"),
    ({"trainable_token_indices": [3, 3]}, "its trainable_token_indices name a token twice"),
    ({"layer_replication": [[0, 1]] * 1000}, "its layer_replication makes copies of base layers, as many as the file "
                                             "says"),
], ids=["rank_pattern", "rank_text", "tokens-beyond", "tokens-twice", "layer_replication"])
def test_sizes_beyond_the_model_are_refused_before_anything_is_allocated(tmp_path: Path, entry: dict[str, Any],
                                                                         said: str) -> None:
    # GIVEN a capture whose adapter asks for more than the base model's layers hold
    ck, bt = _capture(tmp_path)
    _tampered(ck, **entry)
    # WHEN it is loaded  THEN one line refuses it
    assert said in _refusal(ck, bt)
