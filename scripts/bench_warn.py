#!/usr/bin/env python3
"""Does nanhunt.Guard warn before the NaN, naming the module that then overflows, and stay quiet otherwise?

    ./.venv/bin/python scripts/bench_warn.py --threads 1          # also: scripts/bench.py --only warn
    ./.venv/bin/python scripts/bench_warn.py --steps 400 --runs fail-mlp,healthy-fp16

Model: the GPT-style transformer of scripts/_bench_models.py (2 layers, d64, 4 heads, seq 32, batch 4, vocab
256), a fresh random batch every step (seeded), Adam, float16 autocast with a GradScaler (bfloat16 without one
where said), the Guard at its defaults (``headroom_every="auto"``: one step in 16 to 32, as the sampled steps
cost; ``warn_horizon=1000``) with ``on_fail="dump"``; ``--every N`` samples one step in N instead.
Runs, each at most ``--steps`` steps:

  fail-mlp      blocks.1.mlp.fc's weight scaled up 1.5% a step by the loop (standing in for a learning rate set
                too high on one layer): an MLP activation grows into float16's limit
  fail-attn     blocks.0.attn.qkv's weight scaled up 1.5% a step: the attention logits (q @ k, inside the
                attention module) grow into the limit
  fail-grad     the loss multiplied by 1.03 per step: the gradients grow until GradScaler's scale collapses
                (skipped steps in a row)
  fail-lr       Adam with lr 0.05, nothing else touched: a learning rate set too high (whatever it leads to)
  healthy-fp16  Adam lr 1e-3, float16 with a GradScaler
  healthy-bf16  Adam lr 1e-3, bfloat16, no GradScaler

Through the frameworks, their nanhunt callbacks at their defaults (a detection raises GuardError, ending the run):

  healthy-trainer    transformers.Trainer on GPT-2 built from a config (2 layers, d64, 4 heads, 32 positions, vocab
                     256, eager attention, dropout 0.1), batch 4, AdamW lr 1e-3 decaying linearly, gradients
                     clipped at 1, bfloat16: ``fp16=True`` on the CPU trains in float32 (accelerate enables float16
                     autocast and its GradScaler only on an accelerator)
  fail-trainer-mlp   the same, a TrainerCallback scaling transformer.h.1.mlp.c_fc's weight up 1.5% after each
                     optimizer step (fail-mlp's layer), at most 4 x --steps (bfloat16 takes thousands of steps
                     to overflow). Its "overflowed" module is found by the failing step run again (same state,
                     batch and dropout); a forward that stays finite names the first non-finite output gradient
  healthy-lightning  a LightningModule around the GPT above, Adam lr 1e-3, float16 autocast with a GradScaler
                     (Lightning turns ``precision="16-mixed"`` into bf16-mixed on the CPU; its
                     ``MixedPrecision("16-mixed", "cpu")`` plugin runs float16 as asked)

For a failing run: the step of the first detection (a non-finite loss or gradients, or too many skips), the
module whose output was the first non-finite one in that step (a forward with hooks on the state the step
began with, after the run), the first warning (step, steps ahead, condition) and the first module warning
(its module, whether it is that module or inside it, and its forecast). For a healthy run: its warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import nanhunt  # noqa: E402
import _bench_models as models  # noqa: E402

try:  # healthy-lightning's module is a module-level class (the capture names it)
    import lightning.pytorch as pl
except ImportError:  # the other runs need no Lightning
    pl = None

RUNS = ("fail-mlp", "fail-attn", "fail-grad", "fail-lr", "healthy-fp16", "healthy-bf16", "fail-trainer-mlp",
        "healthy-trainer", "healthy-lightning")
KW = {"vocab": 256, "d_model": 64, "n_heads": 4, "n_layers": 2, "seq": 32}
BATCH = 4


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _first_nonfinite(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> str | None:
    """The module whose output is the first non-finite one (in the order modules finish) in a forward of ``x``."""
    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(m: nn.Module, args: Any, out: Any) -> None:
        if not found and isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
            found.append(names[m] or "(model)")

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def run(name: str, steps: int, dump: str, every: int | str = "auto") -> dict[str, Any]:
    if name in FRAMEWORK_RUNS:
        return FRAMEWORK_RUNS[name](name, steps, dump, every)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = models.GPT(**KW).train()
    dtype = torch.bfloat16 if name == "healthy-bf16" else torch.float16
    opt = torch.optim.Adam(model.parameters(), lr=0.05 if name == "fail-lr" else 1e-3)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=os.path.join(dump, name), loss_fn=_loss, model_kwargs=KW,
                          on_fail="dump", headroom_every=every)  # type: ignore[arg-type]
    grow = {"fail-mlp": "blocks.1.mlp.fc", "fail-attn": "blocks.0.attn.qkv"}.get(name)
    bad: int | None = None
    bad_module: str | None = None
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(steps):
            x = torch.randint(0, KW["vocab"], (BATCH, KW["seq"]), generator=g)
            y = torch.randint(0, KW["vocab"], (BATCH, KW["seq"]), generator=g)
            before = {k: v.detach().clone() for k, v in model.state_dict().items()} if bad is None else None
            with guard.step((x, y)):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=dtype):
                    loss = _loss(model(x), y)
                if name == "fail-grad":
                    loss = loss * 1.03 ** i
                loss = guard.loss(loss)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                if scaler is not None:
                    scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                guard.check_grads(grad_norm=norm)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                elif guard.events and guard.events[-1].step == i and guard.events[-1].kind != "warning":
                    pass  # a detected step is not applied (the Guard's advice without a GradScaler)
                else:
                    opt.step()
            if grow is not None:
                with torch.no_grad():
                    model.get_submodule(grow).weight.mul_(1.015)
            if any(e.kind != "warning" for e in guard.events):
                bad = next(e.step for e in guard.events if e.kind != "warning")
                if before is not None:  # the state the failing step began with
                    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    model.load_state_dict(before)
                    bad_module = _first_nonfinite(model, x, dtype)
                    model.load_state_dict(live)
                break
    return _summary(name, i + 1, time.perf_counter() - t0, guard, bad, bad_module)


def _summary(name: str, steps: int, seconds: float, guard: nanhunt.Guard, bad: int | None,
             bad_module: str | None) -> dict[str, Any]:
    """A run's row: its first detection and the module that overflowed then, its warnings up to that step."""
    warned = [e for e in guard.events if e.kind == "warning" and (bad is None or e.step <= bad)]
    mods = [e for e in warned if e.module is not None and e.condition in ("output", "output gradient")]
    out: dict[str, Any] = {"run": name, "steps": steps, "seconds": round(seconds, 1), "first_bad": bad,
                           "stride": guard._watch.every,
                           "bad_kind": next((e.kind for e in guard.events if e.kind != "warning"), None),
                           "bad_module": bad_module, "warnings": len(warned),
                           "all": [(e.step, e.condition, e.module, e.forecast_step) for e in warned]}
    if warned:
        out |= {"first_warning": warned[0].step, "first_condition": warned[0].condition,
                "ahead": None if bad is None else bad - warned[0].step}
    if mods:
        m = mods[0]
        match = ("" if bad_module is None else "exact" if m.module == bad_module
                 else "inside" if bad_module == "(model)" or (m.module or "").startswith(bad_module + ".") else "no")
        out |= {"module_warning": m.step, "module": m.module, "module_ahead": None if bad is None else bad - m.step,
                "forecast": m.forecast_step, "match": match}
    return out


# ------------------------------------------------------------------ transformers.Trainer and Lightning
GPT2_KW = {"vocab_size": 256, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4}
GROWN_HF = "transformer.h.1.mlp.c_fc"  # fail-mlp's blocks.1.mlp.fc in GPT-2's names
# fail-trainer-mlp runs at most this many times --steps: bfloat16's range is float16's squared and more, so a
# weight growing 1.5% a step takes about 3,000 steps to overflow it where float16's took 615
BF16_BUDGET = 4


def _tokens(n: int) -> torch.Tensor:
    """``n`` sequences of random token ids (seed 0), one fresh batch for every step."""
    return torch.randint(0, KW["vocab"], (n, KW["seq"]), generator=torch.Generator().manual_seed(0))


def run_trainer(name: str, steps: int, dump: str, every: int | str = "auto") -> dict[str, Any]:
    """transformers.Trainer on a GPT-2 built from a config, in bfloat16 (``fp16=True`` on the CPU trains in
    float32: accelerate enables float16 autocast and a GradScaler only on an accelerator), the nanhunt callback
    at its defaults (a detection raises GuardError and ends the run). fail-trainer-mlp: a callback scales
    ``transformer.h.1.mlp.c_fc``'s weight up 1.5% after every optimizer step."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from nanhunt.integrations.transformers import NanhuntCallback

    hf_logging.set_verbosity_error()
    grow = name == "fail-trainer-mlp"
    if grow:
        steps *= BF16_BUDGET
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2_KW, bos_token_id=0, eos_token_id=0, attn_implementation="eager"))
    data = [{"input_ids": ids, "labels": ids} for ids in _tokens(steps * BATCH)]
    nh = NanhuntCallback(dump_dir=os.path.join(dump, name), headroom_every=every)

    class Watch(TrainerCallback):
        """Holds the callback's Guard (the callback lets go of it when the run ends), the batch and the state
        each step began with (to find the module that overflowed), and grows the weight after each step."""

        def __init__(self) -> None:
            self.guard: nanhunt.Guard | None = None
            self.before: dict[str, torch.Tensor] = {}
            self.batch: dict[str, torch.Tensor] = {}
            self.rng = torch.get_rng_state()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            assert nh.run is not None
            self.guard = nh.run.guard
            if grow:
                model.register_forward_pre_hook(self._batch, with_kwargs=True)

        def _batch(self, m: nn.Module, a: Any, kw: dict[str, Any]) -> None:
            if m.training:
                self.batch = {k: kw[k].detach().clone() for k in ("input_ids", "labels")}
                self.rng = torch.get_rng_state()  # the step's dropout masks

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if grow:
                self.before = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if grow:
                with torch.no_grad():
                    model.get_submodule(GROWN_HF).weight.mul_(1.015)

    watch = Watch()
    args = TrainingArguments(output_dir=os.path.join(dump, name + "-out"), max_steps=steps,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3, bf16=True, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[nh, watch])
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its metrics
                trainer.train()
        except nanhunt.GuardError:
            pass
    seconds = time.perf_counter() - t0
    assert watch.guard is not None
    bad = next((e.step for e in watch.guard.events if e.is_detection()), None)
    bad_module = bad_in = peak = None
    if bad is not None and watch.before:  # the failing step again, on the state and random state it began with
        model.load_state_dict(watch.before)
        torch.set_rng_state(watch.rng)
        bad_module, bad_in, peak = _first_nonfinite_hf(model.train(), watch.batch, torch.bfloat16)
    done = bad + 1 if bad is not None else int(trainer.state.global_step)
    return (_summary(name, done, seconds, watch.guard, bad, bad_module)
            | {"bad_in": bad_in, "bad_peak": peak, "grown_history": _history_of(watch.guard, GROWN_HF)})


def _history_of(guard: nanhunt.Guard, module: str) -> dict[str, Any] | None:
    """What the capture of the first detection holds of ``module``'s output history (its event file's headroom
    picture: the series nearest their limit): the last samples (log2 of the largest magnitude), the dtype's
    limit, the growth per 100 steps and the forecast step; None when it is not there."""
    ev = next((e for e in guard.events if e.is_detection() and e.checkpoint), None)
    if ev is None or ev.checkpoint is None:
        return None
    with open(ev.checkpoint.removesuffix("-checkpoint.pt") + "-event.json", encoding="utf-8") as fh:
        picture = json.load(fh).get("headroom") or {}
    series = next((s for s in picture.get("series", ()) if s.get("module") == module
                   and s.get("condition", "output") == "output"), None)
    return None if series is None else {"steps": series["steps"][-3:], "log2": series["log2max"][-3:],
                                        "limit": series.get("limit"), "growth": series.get("growth"),
                                        "forecast": series.get("forecast_step")}


def _first_nonfinite_hf(model: nn.Module, batch: dict[str, torch.Tensor],
                        dtype: torch.dtype) -> tuple[str | None, str | None, float | None]:
    """The module whose output is the first non-finite one in a forward of a transformers model's own loss on
    ``batch``, else the one whose output gradient is the first non-finite one in its backward (a forward that
    stays finite may overflow in the backward: the gradient of ``x ** 3`` squares ``x``); which of the two
    ("output" or "output gradient"); and the largest magnitude of that module's output in the forward."""
    forward: list[str] = []
    backward: list[str] = []
    peak: dict[str, float] = {}
    names = {m: n or "(model)" for n, m in model.named_modules()}

    def grad_seen(name: str, g: torch.Tensor) -> None:
        if not backward and not bool(torch.isfinite(g).all()):
            backward.append(name)

    def hook(m: nn.Module, args: Any, out: Any) -> None:
        for o in out if isinstance(out, tuple) else (out,):
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                peak[names[m]] = max(peak.get(names[m], 0.0), float(o.detach().abs().amax()))
                if not forward and not bool(torch.isfinite(o).all()):
                    forward.append(names[m])
                if o.requires_grad:
                    o.register_hook(functools.partial(grad_seen, names[m]))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(**batch).loss
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    if forward:
        return forward[0], "output", peak[forward[0]]
    return (backward[0], "output gradient", peak[backward[0]]) if backward else (None, None, None)


def run_lightning(name: str, steps: int, dump: str, every: int | str = "auto") -> dict[str, Any]:
    """A LightningModule around the plain runs' GPT, float16 autocast with a GradScaler (Lightning turns
    ``precision="16-mixed"`` into bf16-mixed on the CPU; its MixedPrecision("16-mixed") plugin runs it as asked),
    Adam lr 1e-3, the nanhunt callback at its defaults."""
    from lightning.pytorch.plugins import MixedPrecision

    from nanhunt.integrations.lightning import NanhuntCallback

    if pl is None:
        raise SystemExit(f"{name} needs Lightning: pip install lightning")
    # "GPU available: False", ... (Lightning's messages go to the logger of whichever of its packages was imported
    # last; the callback imports both where both are installed)
    for logger in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    torch.manual_seed(0)
    module = GPTModule(**KW)
    tokens = _tokens(2 * steps * BATCH).view(steps, 2, BATCH, KW["seq"])  # x and y of each step, as run() draws them
    x, y = tokens[:, 0].reshape(-1, KW["seq"]), tokens[:, 1].reshape(-1, KW["seq"])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    nh = NanhuntCallback(dump_dir=os.path.join(dump, name), headroom_every=every)
    held: list[nanhunt.Guard] = []

    class Hold(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            assert nh.run is not None
            held.append(nh.run.guard)  # the callback lets go of it when the run ends

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[MixedPrecision("16-mixed", "cpu")],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=os.path.join(dump, name + "-out"),
                         callbacks=[nh, Hold()])
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # Lightning prints tips
                trainer.fit(module, loader)
        except nanhunt.GuardError:
            pass
    seconds = time.perf_counter() - t0
    bad = next((e.step for e in held[0].events if e.is_detection()), None)
    done = bad + 1 if bad is not None else int(trainer.global_step)
    return _summary(name, done, seconds, held[0], bad, None)


if pl is not None:
    class GPTModule(pl.LightningModule):
        """The plain runs' GPT as a LightningModule (at module level: the capture names its class)."""

        def __init__(self, **kw: int) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.gpt = models.GPT(**kw)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return _loss(self.gpt(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)


FRAMEWORK_RUNS = {"healthy-trainer": run_trainer, "fail-trainer-mlp": run_trainer, "healthy-lightning": run_lightning}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma list of: " + ",".join(RUNS))
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--every", default="auto", help="the Guard's headroom_every: auto (default) or a number")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as dump:
        for name in args.runs.split(","):
            r = run(name, args.steps, dump, args.every if args.every == "auto" else int(args.every))
            rows.append(r)
            print(json.dumps(r), flush=True)
    print()
    print(f"{'run':<17} {'steps':>5} {'first bad':>9} {'overflowed':<31} {'1st warning':>11} {'ahead':>5} "
          f"{'module warned':<26} {'at':>4} {'ahead':>5} {'forecast':>8} {'match':<6} {'warnings':>8} {'stride':>6}")
    for r in rows:
        def f(k: str) -> str:
            v = r.get(k)
            return "-" if v is None else str(v)
        first = f"{f('first_warning')} {r.get('first_condition') or ''}".strip()
        grad = " (grad)" if r.get("bad_in") == "output gradient" else ""  # its output gradient overflowed
        print(f"{r['run']:<17} {r['steps']:>5} {f('first_bad'):>9} {f('bad_module') + grad:<31} {first:>11} "
              f"{f('ahead'):>5} {f('module'):<26} {f('module_warning'):>4} {f('module_ahead'):>5} "
              f"{f('forecast'):>8} {f('match'):<6} {r['warnings']:>8} {f('stride'):>6}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"steps": args.steps, "model": KW, "batch": BATCH, "runs": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
