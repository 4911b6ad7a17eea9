#!/usr/bin/env python3
"""What nanhunt.Guard costs on the clean path of a training loop.

    ./.venv/bin/python scripts/bench_guard.py                 # bundled TinyTransformer, float16 + GradScaler
    ./.venv/bin/python scripts/bench_guard.py --dtype bfloat16 --steps 400
    ./.venv/bin/python scripts/bench_guard.py --d 128 --seq 64 --batch 16   # a larger step
    ./.venv/bin/python scripts/bench_guard.py --device cuda
    ./.venv/bin/python scripts/bench_guard.py --model mlp --threads 1 --clock thread --rounds 5   # the MLP loop
    ./.venv/bin/python scripts/bench.py --only guard --threads 1      # the MLP loop small and at ~13 ms a step

Workload: ``fixtures.models.TinyTransformer`` + ``LMLoss`` (``--model mlp``:
``fixtures.models.MLP``, 64 -> ``--width`` -> 8, ``mse_loss``), Adam, a
``GradScaler`` (float16; bfloat16 and float32 run without one unless ``--scaler``),
one training step per iteration: zero_grad, forward and loss under autocast
(float32: none), scaled backward, unscale_, clip_grad_norm_, step, update. Each
variant trains its own copy of the same model (same initial weights, same
batches). Variants:

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
for cores, step-to-step noise (p25-p75 of +-50%) hides a 1-3% effect; on a machine
other processes share, ``--clock thread`` times each step by the main thread's CPU
time (preemption does not count) and ``--rounds N`` repeats the whole run N times
(fresh models each round) and gives the median of the rounds' ratios.
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
from fixtures.models import MLP, LMLoss, TinyTransformer  # noqa: E402


Batch = tuple[torch.Tensor, torch.Tensor]


def _make(args: argparse.Namespace, dump: str, guard: str | None) -> Callable[[Batch], None]:
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model: torch.nn.Module
    loss_fn: Any
    if args.model == "mlp":
        kwargs: dict[str, Any] = {"d_in": 64, "d_hidden": args.width, "d_out": 8}
        model, loss_fn = MLP(**kwargs).to(dev), torch.nn.functional.mse_loss
    else:
        kwargs = {"vocab": args.vocab, "d": args.d, "heads": 4, "d_ff": 4 * args.d, "n_blocks": args.blocks}
        model, loss_fn = TinyTransformer(**kwargs).to(dev), LMLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    dtype = getattr(torch, args.dtype)
    use_scaler = args.scaler if args.scaler is not None else dtype == torch.float16
    scaler = torch.amp.GradScaler(dev.type, init_scale=1024.0, enabled=use_scaler)
    g = None
    if guard is not None:
        g = nanhunt.Guard(model, opt, scaler, dump_dir=dump, loss_fn=loss_fn, model_kwargs=kwargs,
                          check_params=guard == "guard-params",
                          headroom_every={"guard-nohistory": None, "guard-every": 1}.get(guard, "auto"))

    def body(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            out = model(inputs)
            loss = loss_fn(out.float() if args.model == "mlp" else out, targets)
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


def _batches(args: argparse.Namespace) -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    dev = torch.device(args.device)
    if args.model == "mlp":
        return [(torch.randn(args.batch, 64, generator=gen).to(dev), torch.randn(args.batch, 8, generator=gen).to(dev))
                for _ in range(16)]
    return [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev)) for _ in range(16)]


def _round(args: argparse.Namespace, names: list[str], seed: int) -> dict[str, list[float]]:
    """One run: every variant built afresh, ``args.warmup + args.steps`` repetitions, each running every variant
    once in a shuffled order; the timed steps' seconds per variant."""
    dev = torch.device(args.device)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as dump:
        steps = {n: _make(args, dump, None if n == "plain" else n) for n in names}
        batches = _batches(args)
        times: dict[str, list[float]] = {n: [] for n in names}
        order = list(names)
        rnd = random.Random(seed)
        for i in range(args.warmup + args.steps):
            rnd.shuffle(order)
            batch = batches[i % len(batches)]
            for n in order:
                sync()
                t0 = clock()
                steps[n](batch)
                sync()
                dt = clock() - t0
                if i >= args.warmup:
                    times[n].append(dt)
        if os.listdir(dump):
            print(f"warning: the guard wrote {os.listdir(dump)} on a clean run", file=sys.stderr)
    return times


def _ratios(times: dict[str, list[float]], n: str) -> dict[str, float]:
    plain = times["plain"]
    ratios = sorted(t / b for t, b in zip(times[n], plain))
    q = statistics.quantiles(ratios, n=4)
    med = statistics.median(times[n])
    return {"median_ms": med * 1e3, "ratio_paired_median": statistics.median(ratios), "ratio_p25": q[0],
            "ratio_p75": q[2], "ratio_of_medians": med / statistics.median(plain),
            "ratio_of_means": statistics.fmean(times[n]) / statistics.fmean(plain)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="timed repetitions (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="whole runs, fresh models each; the table gives the median "
                   "of the rounds' figures")
    p.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                   help="the autocast dtype (float32: no autocast)")
    p.add_argument("--scaler", action=argparse.BooleanOptionalAction, default=None,
                   help="use a GradScaler (default: with float16 only)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d", type=int, default=32, help="transformer width (fixture default 32)")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: transformer 2, MLP 32)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: each step timed by the main thread's CPU time (needs --threads 1, CPU)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 32 if args.model == "mlp" else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and (torch.get_num_threads() != 1 or args.device != "cpu"):
        p.error("--clock thread needs --threads 1 on the CPU (other threads' work would not be counted)")

    names = ["plain", "guard", "guard-nohistory", "guard-every", "guard-params"]
    per_round = []
    for r in range(args.rounds):
        times = _round(args, names, seed=r)
        per_round.append({n: _ratios(times, n) for n in names})
        if args.rounds > 1:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {per_round[-1][n]['ratio_paired_median']:.3f}" for n in names[1:]), file=sys.stderr, flush=True)
    rows: dict[str, Any] = {n: {k: statistics.median(rd[n][k] for rd in per_round) for k in per_round[0][n]}
                            for n in names}
    what = (f"MLP(64-{args.width}-8) batch {args.batch}" if args.model == "mlp" else
            f"TinyTransformer(d={args.d}, blocks={args.blocks}) batch {args.batch}x{args.seq}")
    scaler = args.scaler if args.scaler is not None else args.dtype == "float16"
    print(f"{what}, {args.dtype}{' + GradScaler' if scaler else ''}, device {args.device}, "
          f"threads {torch.get_num_threads()}, {args.clock} clock, {args.steps} interleaved steps"
          + (f" x {args.rounds} rounds (median of rounds)" if args.rounds > 1 else ""))
    print(f"{'variant':<16} {'median ms':>10} {'ratio (paired median)':>22} {'p25-p75':>14} {'ratio of medians':>17} "
          f"{'ratio of means':>15}")
    for n in names:
        r = rows[n]
        print(f"{n:<16} {r['median_ms']:>10.3f} {r['ratio_paired_median']:>22.4f} "
              f"{r['ratio_p25']:>6.3f}-{r['ratio_p75']:<7.3f} {r['ratio_of_medians']:>17.4f} {r['ratio_of_means']:>15.4f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "torch": torch.__version__, "results": rows, "rounds": per_round}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
