"""``nanhunt.integrations.transformers.NanhuntCallback`` on real ``transformers.Trainer`` runs on the CPU.

A tiny GPT-2 (built from a config, nothing downloaded) is trained a few steps; a test callback turns one weight
``inf`` at a known optimizer step. Without nanhunt the Trainer hides it (``logging_nan_inf_filter``) and finishes;
with the callback the run stops at that step and leaves a capture that ``nanhunt replay CKPT BATCH`` replays with
no other argument (the model is rebuilt from the config the capture holds, the loss is the model's own).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt.capture.capture import load_step
from nanhunt.cli import main as cli_main
from nanhunt.records import Report
from tests._support.dist import torchrun
from tests._support.hf import tiny_gpt2, token_data

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from nanhunt.integrations.transformers import NanhuntCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
POISONED = "transformer.h.0.mlp.c_fc"
STEP = 3  # the optimizer step (Trainer's global_step as it begins) whose weights are poisoned


def _poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.get_submodule(POISONED).weight[0, 0] = float("inf")


class Poison(TrainerCallback):
    """Turns one weight inf as optimizer step ``at`` begins, or after its micro-batch ``after_micro``; with
    ``record``, records the ``input_ids`` of every training forward (to tell which micro-batch a capture holds)."""

    def __init__(self, at: int = STEP, after_micro: int | None = None, *, record: bool = False) -> None:
        self.at, self.after_micro, self.record = at, after_micro, record
        self.micro = 0
        self.seen: list[torch.Tensor] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.record:
            model.register_forward_pre_hook(
                lambda m, a, k: self.seen.append(k["input_ids"].detach().clone()) if m.training else None,
                with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.micro = 0
        if state.global_step == self.at and self.after_micro is None:
            _poison(model)

    def on_substep_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == self.at and self.micro == self.after_micro:
            _poison(model)
        self.micro += 1


def _trainer(tmp_path: Path, callbacks: list[Any], *, steps: int = 6, accumulate: int = 1,
             **precision: bool) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, **precision)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data(), callbacks=callbacks)


def _replayed(tmp_path: Path, event: nanhunt.GuardEvent) -> tuple[int, Report]:
    assert event.checkpoint is not None and event.batch is not None
    out = tmp_path / "report.json"
    rc = cli_main(["replay", event.checkpoint, event.batch, "--report", str(out)])
    return rc, Report.from_json(out.read_text())


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(d) for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks))


def test_without_the_callback_the_trainer_hides_the_inf(tmp_path: Path) -> None:
    # GIVEN the tiny GPT-2 in bfloat16 on the CPU, one weight turned inf as step 3 begins, no nanhunt
    tr = _trainer(tmp_path, [Poison()], bf16=True)
    # WHEN it trains 6 steps
    tr.train()
    # THEN (the premise) it finishes, logging loss 0 and grad_norm nan from step 4 on
    logs = [h for h in tr.state.log_history if "loss" in h and "grad_norm" in h]
    assert tr.state.global_step == 6
    assert logs[2]["loss"] > 0 and logs[3]["loss"] == 0 and math.isnan(logs[3]["grad_norm"])


@pytest.mark.slow
def test_bf16_run_stops_at_the_bad_step_and_its_capture_replays_with_no_argument(tmp_path: Path) -> None:
    # GIVEN the same run with the callback
    dump = tmp_path / "nan"
    tr = _trainer(tmp_path, [Poison(), NanhuntCallback(dump_dir=dump)], bf16=True)
    # WHEN it trains
    with pytest.raises(nanhunt.GuardError) as info:
        tr.train()
    # THEN it stops at step 3, before that step's update, saying where the capture is and how to replay it
    ev = info.value.event
    assert (ev.step, ev.captured_step, tr.state.global_step) == (STEP, STEP, STEP)
    assert ev.checkpoint == str(dump / "step000003-checkpoint.pt") and ev.batch == str(dump / "step000003-batch.pt")
    assert f"nanhunt replay {ev.checkpoint} {ev.batch}" in str(info.value)
    assert "transformers.Trainer" in "\n".join(getattr(info.value, "__notes__", []))
    assert _hooks(tr.model) == 0  # the run is over: nothing of nanhunt is left on the model
    # AND the capture rebuilds the GPT-2 from its config, in bfloat16 autocast, its loss the model's own
    step = load_step(ev.checkpoint, ev.batch)
    assert type(step.model) is GPT2LMHeadModel and step.loss_fn is None
    assert (step.dtype, step.scaler) == (torch.bfloat16, None)
    assert step.model.config.to_dict() == tr.model.config.to_dict()
    # AND `nanhunt replay CKPT BATCH` names the inf weight
    rc, rep = _replayed(tmp_path, ev)
    assert rc == 1 and rep.first is not None
    assert (rep.first.phase.value, rep.first.module) == ("weights", POISONED)


def test_gradient_accumulation_captures_the_micro_batch_that_went_bad(tmp_path: Path) -> None:
    # GIVEN 2 micro-batches per update; the weight turns inf after micro-batch 0 of update 2
    poison = Poison(at=2, after_micro=0, record=True)
    tr = _trainer(tmp_path, [poison, NanhuntCallback(dump_dir=tmp_path / "nan")], accumulate=2, bf16=True)
    # WHEN it trains
    with pytest.raises(nanhunt.GuardError) as info:
        tr.train()
    # THEN it stops at update 2, and the capture holds micro-batch 1 of that update: the one that went bad
    ev = info.value.event
    assert (ev.step, tr.state.global_step, len(poison.seen)) == (2, 2, 2 * 2 + 2)
    assert ev.checkpoint is not None and ev.batch is not None
    step = load_step(ev.checkpoint, ev.batch)
    assert torch.equal(step.inputs["input_ids"], poison.seen[-1])
    assert not torch.equal(step.inputs["input_ids"], poison.seen[-2])


def test_fp16_on_the_cpu_is_captured_as_what_ran(tmp_path: Path) -> None:
    # GIVEN fp16=True on the CPU: accelerate runs it in float32 (no autocast, no GradScaler there)
    tr = _trainer(tmp_path, [Poison(), NanhuntCallback(dump_dir=tmp_path / "nan")], fp16=True)
    # WHEN it trains
    with pytest.raises(nanhunt.GuardError) as info:
        tr.train()
    # THEN it stops at step 3, and the capture replays what really ran: float32, no scaler
    ev = info.value.event
    assert ev.step == STEP and ev.checkpoint is not None and ev.batch is not None
    step = load_step(ev.checkpoint, ev.batch)
    assert (step.dtype, step.scaler) == (torch.float32, None)


def test_a_clean_run_is_unchanged_by_the_callback(tmp_path: Path) -> None:
    # GIVEN the same clean bf16 run twice, with and without the callback
    runs = []
    for callbacks in ([], [NanhuntCallback(dump_dir=tmp_path / "nan")]):
        tr = _trainer(tmp_path, callbacks, steps=4, bf16=True)
        # WHEN each trains
        tr.train()
        losses = [h["loss"] for h in tr.state.log_history if "loss" in h and "grad_norm" in h]
        runs.append((losses, {k: v.clone() for k, v in tr.model.state_dict().items()}, _hooks(tr.model)))
    # THEN the losses and the weights are bit for bit the same, nothing was written, no hook is left
    (l0, w0, h0), (l1, w1, h1) = runs
    assert l0 == l1 and len(l0) == 4
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert h0 == h1 == 0
    assert not (tmp_path / "nan").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_stop_together_and_the_rank_that_saw_it_writes(tmp_path: Path) -> None:
    # GIVEN a 2-process run (torchrun, gloo on the CPU) where only rank 1's weight turns inf as step 3 begins
    # WHEN it trains (bounded: a rank left waiting in a collective would hang)
    proc = torchrun([str(Path(__file__).with_name("ddp_trainer_worker.py")), str(tmp_path)], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # THEN both ranks stop at step 3 (their update not run), both know rank 1 saw it, and only rank 1 writes
    for r, rr in enumerate(res):
        ev = rr["event"]
        assert (rr["world"], rr["result"], rr["global_step"]) == (2, "stopped", STEP)
        assert (ev["step"], ev["rank"], ev["ranks"]) == (STEP, r, [1])
    assert sorted(p.name for p in (tmp_path / "nan").iterdir()) == [
        "step000003-rank1-batch.pt", "step000003-rank1-checkpoint.pt", "step000003-rank1-event.json"]


def test_an_option_the_guard_does_not_take_fails_when_the_callback_is_made(tmp_path: Path) -> None:
    # GIVEN / WHEN a misspelt Guard option  THEN the callback refuses it at once, not when training starts
    with pytest.raises(TypeError, match="snapshot_evry"):
        NanhuntCallback(dump_dir=tmp_path, snapshot_evry=1)
    with pytest.raises(ValueError, match="on_fail"):
        NanhuntCallback(dump_dir=tmp_path, on_fail="stop")


@pytest.mark.subprocess
def test_importing_nanhunt_imports_no_framework() -> None:
    # GIVEN a fresh interpreter  WHEN nanhunt, its Guard, capture code and the integrations package are imported
    code = ("import sys, nanhunt, nanhunt.guard.guard, nanhunt.capture.capture, nanhunt.integrations; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate', 'peft') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # THEN none of the frameworks is imported
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
