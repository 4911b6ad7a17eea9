"""A PEFT (LoRA) model under ``transformers.Trainer`` with ``NanhuntCallback``: the capture replays with no argument.

``peft.get_peft_model(base, LoraConfig(...))`` wraps a tiny GPT-2 (built from a config, nothing downloaded) in a
``PeftModel``; only the LoRA weights train. One weight turns ``inf`` as optimizer step 3 begins: a trainable
``lora_B`` weight, or a frozen base weight. The run stops at that step, and ``nanhunt replay CKPT BATCH`` rebuilds
the base model from its JSON config, the adapter from its JSON ``LoraConfig``, loads the weights (only the adapter
trainable, as in training) and names the poisoned module, with no ``--model`` and no ``--loss``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt.capture.capture import load_step
from nanhunt.cli import main as cli_main
from nanhunt.records import Report
from tests._support.hf import tiny_gpt2, token_data

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from nanhunt.integrations.transformers import NanhuntCallback  # noqa: E402

STEP = 3  # the optimizer step (Trainer's global_step as it begins) whose weights are poisoned
LORA_B = "base_model.model.transformer.h.0.attn.c_attn.lora_B.default"
BASE = "base_model.model.transformer.h.1.mlp.c_fc"  # frozen
TRAINABLE = [f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{ab}.default.weight"
             for i in (0, 1) for ab in "AB"]


def _model(task_type: str | None = None) -> Any:
    base = tiny_gpt2()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
                          task_type=task_type)
    return peft.get_peft_model(base, cfg)


class Poison(TrainerCallback):
    """Turns one weight of module ``name`` inf as optimizer step ``STEP`` begins."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == STEP:
            with torch.no_grad():
                model.get_submodule(self.name).weight[0, 0] = float("inf")


def _trainer(tmp_path: Path, model: Any, callbacks: list[Any]) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, bf16=True)
    return Trainer(model=model, args=args, train_dataset=token_data(), callbacks=callbacks)


def _stopped(tmp_path: Path, model: Any, poisoned: str) -> tuple[Trainer, nanhunt.GuardEvent]:
    tr = _trainer(tmp_path, model, [Poison(poisoned), NanhuntCallback(dump_dir=tmp_path / "nan")])
    with pytest.raises(nanhunt.GuardError) as info:
        tr.train()
    ev = info.value.event
    assert ev.checkpoint is not None and ev.batch is not None
    # the replay command it prints is the two files alone: no --model, no --loss
    assert f"nanhunt replay {ev.checkpoint} {ev.batch}\n" in str(info.value) + "\n"
    return tr, ev


def _replayed(tmp_path: Path, event: nanhunt.GuardEvent) -> tuple[int, Report]:
    assert event.checkpoint is not None and event.batch is not None
    out = tmp_path / "report.json"
    rc = cli_main(["replay", event.checkpoint, event.batch, "--report", str(out)])
    return rc, Report.from_json(out.read_text())


def test_a_lora_run_stops_and_its_capture_rebuilds_the_adapter_with_no_argument(tmp_path: Path) -> None:
    # GIVEN a LoRA GPT-2 in bfloat16 under the callback, a trainable lora_B weight turned inf as step 3 begins
    tr, ev = _stopped(tmp_path, _model(), LORA_B)
    # THEN the run stops at step 3, and the capture names the base model (JSON config) and the adapter (JSON)
    assert (ev.step, tr.state.global_step) == (STEP, STEP)
    ck = torch.load(ev.checkpoint, weights_only=True)
    hf = ck["hf_model"]
    assert hf["class"] == "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"
    saved = json.loads(hf["peft"]["peft_config"]["default"])
    assert (saved["peft_type"], saved["r"], saved["lora_alpha"], saved["target_modules"]) == ("LORA", 4, 8, ["c_attn"])
    assert (hf["peft"]["active_adapter"], hf["peft"]["trainable"]) == ("default", TRAINABLE)
    # WHEN it is loaded with no --model
    step = load_step(ev.checkpoint, ev.batch)
    # THEN it is the same PEFT model: base rebuilt from its config, the adapter from its config, weights loaded,
    # only the adapter trainable, bfloat16 autocast (what ran), the model's own loss
    m = step.model
    assert type(m) is peft.PeftModel and type(m.get_base_model()) is GPT2LMHeadModel
    assert m.peft_config["default"].r == 4 and m.peft_config["default"].target_modules == {"c_attn"}
    assert [n for n, p in m.named_parameters() if p.requires_grad] == TRAINABLE
    assert (step.dtype, step.scaler, step.loss_fn) == (torch.bfloat16, None, None)
    live = tr.model.state_dict()
    assert list(m.state_dict()) == list(live)
    assert all(torch.equal(v, ck["model"][k]) for k, v in m.state_dict().items())
    assert torch.isinf(m.get_submodule(LORA_B).weight[0, 0])
    # AND the optimizer holds the trainable (adapter) parameters only, with their saved Adam state
    assert step.optimizer is not None
    names = {id(p): n for n, p in m.named_parameters()}
    held = [names[id(p)] for g in step.optimizer.param_groups for p in g["params"]]
    assert held == TRAINABLE
    assert [int(s["step"]) for s in step.optimizer.state.values()] == [STEP] * 4
    # AND `nanhunt replay CKPT BATCH` names the inf lora_B weight, phase weights
    rc, rep = _replayed(tmp_path, ev)
    assert rc == 1 and rep.first is not None
    assert (rep.first.phase.value, rep.first.module) == ("weights", LORA_B)


def test_a_frozen_base_weight_of_a_causal_lm_adapter_is_named(tmp_path: Path) -> None:
    # GIVEN a LoRA with task_type CAUSAL_LM (PeftModelForCausalLM), a frozen base weight turned inf at step 3
    tr, ev = _stopped(tmp_path, _model("CAUSAL_LM"), BASE)
    assert ev.step == STEP
    # WHEN it is loaded and replayed with no argument
    step = load_step(ev.checkpoint, ev.batch)
    rc, rep = _replayed(tmp_path, ev)
    # THEN the same wrapper class is rebuilt, the base weight is loaded frozen, and the replay names it
    assert type(step.model) is peft.PeftModelForCausalLM
    assert not step.model.get_submodule(BASE).weight.requires_grad
    assert rc == 1 and rep.first is not None
    assert (rep.first.phase.value, rep.first.module) == ("weights", BASE)

