#!/usr/bin/env python3
"""What nanhunt.Guard costs on the clean path of a training loop.

    ./.venv/bin/python scripts/bench_guard.py                 # bundled TinyTransformer, float16 + GradScaler
    ./.venv/bin/python scripts/bench_guard.py --dtype bfloat16 --steps 400
    ./.venv/bin/python scripts/bench_guard.py --d 128 --seq 64 --batch 16   # a larger step
    ./.venv/bin/python scripts/bench_guard.py --device cuda

Workload: ``fixtures.models.TinyTransformer`` + ``LMLoss``, Adam, a
``GradScaler`` (float16; bfloat16 runs without one unless ``--scaler``), one
training step per iteration: zero_grad, forward and loss under autocast, scaled
backward, unscale_, clip_grad_norm_, step, update. Each variant trains its own
copy of the same model (same initial weights, same batches). Variants:

  plain            the step alone
  guard            the step inside ``guard.step(batch)``, with ``guard.loss(loss)`` and
                   ``guard.check_grads()``, default settings: one host read per step
                   (the GradScaler's found_inf, the loss flag and the scale)
  guard-params     the same with ``check_params=True``: a fused check of every parameter
                   after the update and a second host read at the end of the step
  guard-nohistory  the guard with ``headroom_every=None``: no module headroom history
  guard-every      the guard with ``headroom_every=1``: every module's headroom on every step

The default guard samples the headroom history (``headroom_every="auto"``): one step in 16 to 32 is
dearer, which a median hides; the ratio of means counts it.

Variants are interleaved: each repetition runs every variant once in a shuffled
(seeded) order, so drift and noise from other processes hit them alike. The
ratio is paired (variant / plain of the same repetition); the table gives its
median and p25-p75, plus the ratio of medians. Warm-up steps are not timed. On a
shared or small CPU machine pass ``--threads 1``: with intra-op threads competing
for cores, step-to-step noise (p25-p75 of +-50%) hides a 1-3% effect.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import nanhunt  # noqa: E402
from fixtures.models import LMLoss, TinyTransformer  # noqa: E402


Batch = tuple[torch.Tensor, torch.Tensor]


def _make(args: argparse.Namespace, dump: str, guard: str | None) -> Callable[[Batch], None]:
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = TinyTransformer(vocab=args.vocab, d=args.d, heads=4, d_ff=4 * args.d, n_blocks=args.blocks).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    dtype = getattr(torch, args.dtype)
    use_scaler = args.scaler if args.scaler is not None else dtype == torch.float16
    scaler = torch.amp.GradScaler(dev.type, init_scale=1024.0, enabled=use_scaler)
    loss_fn = LMLoss()
    g = None
    if guard is not None:
        g = nanhunt.Guard(model, opt, scaler, dump_dir=dump, loss_fn=loss_fn,
                          model_kwargs={"vocab": args.vocab, "d": args.d, "heads": 4, "d_ff": 4 * args.d,
                                        "n_blocks": args.blocks},
                          check_params=guard == "guard-params",
                          headroom_every={"guard-nohistory": None, "guard-every": 1}.get(guard, "auto"))

    def body(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        tokens, targets = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype):
            loss = loss_fn(model(tokens), targets)
        if g is not None:
            loss = g.loss(loss)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if g is not None:
            g.check_grads()
        scaler.step(opt)
        scaler.update()

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if g is None:
            body(batch)
        else:
            with g.step(batch):
                body(batch)

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="timed repetitions (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    p.add_argument("--scaler", action=argparse.BooleanOptionalAction, default=None,
                   help="use a GradScaler (default: with float16 only)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d", type=int, default=32, help="model width (fixture default 32)")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()


    names = ["plain", "guard", "guard-nohistory", "guard-every", "guard-params"]
    with tempfile.TemporaryDirectory() as dump:
        steps = {n: _make(args, dump, None if n == "plain" else n) for n in names}
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev),
                    torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev)) for _ in range(16)]
        times: dict[str, list[float]] = {n: [] for n in names}
        order = list(names)
        rnd = random.Random(0)
        for i in range(args.warmup + args.steps):
            rnd.shuffle(order)
            batch = batches[i % len(batches)]
            for n in order:
                sync()
                t0 = time.perf_counter()
                steps[n](batch)
                sync()
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[n].append(dt)
        if os.listdir(dump):
            print(f"warning: the guard wrote {os.listdir(dump)} on a clean run", file=sys.stderr)

    plain = times["plain"]
    rows: dict[str, Any] = {}
    print(f"TinyTransformer(d={args.d}, blocks={args.blocks}) batch {args.batch}x{args.seq}, {args.dtype}, "
          f"device {args.device}, threads {torch.get_num_threads()}, {args.steps} interleaved steps")
    print(f"{'variant':<16} {'median ms':>10} {'ratio (paired median)':>22} {'p25-p75':>14} {'ratio of medians':>17} "
          f"{'ratio of means':>15}")
    for n in names:
        ratios = sorted(t / b for t, b in zip(times[n], plain))
        q = statistics.quantiles(ratios, n=4)
        med = statistics.median(times[n])
        rows[n] = {"median_ms": med * 1e3, "ratio_paired_median": statistics.median(ratios),
                   "ratio_p25": q[0], "ratio_p75": q[2], "ratio_of_medians": med / statistics.median(plain),
                   "ratio_of_means": statistics.fmean(times[n]) / statistics.fmean(plain)}
        r = rows[n]
        print(f"{n:<16} {r['median_ms']:>10.3f} {r['ratio_paired_median']:>22.4f} "
              f"{r['ratio_p25']:>6.3f}-{r['ratio_p75']:<7.3f} {r['ratio_of_medians']:>17.4f} {r['ratio_of_means']:>15.4f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "torch": torch.__version__, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
