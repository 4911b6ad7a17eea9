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

For a failing run: the step of the first detection (a non-finite loss or gradients, or too many skips), the
module whose output was the first non-finite one in that step (a forward with hooks on the state the step
began with, after the run), the first warning (step, steps ahead, condition) and the first module warning
(its module, whether it is that module or inside it, and its forecast). For a healthy run: its warnings.
"""

from __future__ import annotations

import argparse
import json
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

RUNS = ("fail-mlp", "fail-attn", "fail-grad", "fail-lr", "healthy-fp16", "healthy-bf16")
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
    seconds = time.perf_counter() - t0
    warned = [e for e in guard.events if e.kind == "warning" and (bad is None or e.step <= bad)]
    mods = [e for e in warned if e.module is not None and e.condition in ("output", "output gradient")]
    out: dict[str, Any] = {"run": name, "steps": i + 1, "seconds": round(seconds, 1), "first_bad": bad,
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
    print(f"{'run':<14} {'steps':>5} {'first bad':>9} {'overflowed':<20} {'1st warning':>11} {'ahead':>5} "
          f"{'module warned':<20} {'at':>4} {'ahead':>5} {'forecast':>8} {'match':<6} {'warnings':>8} {'stride':>6}")
    for r in rows:
        def f(k: str) -> str:
            v = r.get(k)
            return "-" if v is None else str(v)
        first = f"{f('first_warning')} {r.get('first_condition') or ''}".strip()
        print(f"{r['run']:<14} {r['steps']:>5} {f('first_bad'):>9} {f('bad_module'):<20} {first:>11} "
              f"{f('ahead'):>5} {f('module'):<20} {f('module_warning'):>4} {f('module_ahead'):>5} "
              f"{f('forecast'):>8} {f('match'):<6} {r['warnings']:>8} {f('stride'):>6}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"steps": args.steps, "model": KW, "batch": BATCH, "runs": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
