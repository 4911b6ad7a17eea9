#!/usr/bin/env python3
"""Instructions per training step, counted by valgrind: what the tracer's Python costs, free of
the machine's timing noise.

    ./.venv/bin/python scripts/bench_instr.py                  # tiny GPT, default variants (~4 min)
    ./.venv/bin/python scripts/bench_instr.py --variants plain,nanhunt-op --steps 5

On a 2-core VM whose plain step varies by 30% between repetitions, a wall-clock ratio cannot
show a 2% change; an instruction count can (the same total twice, whatever else the machine is
doing). Each variant runs in its own process under ``valgrind --tool=callgrind`` with collection
off, except inside ``functools.reduce``, which the child uses to run the measured steps after
its warm-up: the import of torch and the warm-up are not counted. The workload is the
benchmark's GPT at a tiny size (batch 2, seq 16, d_model 32, 6 layers; ~1,000 aten ops per
step), one thread, so that the count is dominated by per-op and per-module work, which is what
a GPU user pays too. Instructions are not time (a cache miss costs more than an add): use this
to compare versions of the tracer, and scripts/bench.py for what a step costs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import re
import shutil
import subprocess
import sys

DEFAULT_VARIANTS = ("plain", "dispatch-bare", "nanhunt-module", "nanhunt-op", "nanhunt-op-scoped")


def child(variant: str, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bench_models as models
    import bench

    w = models.make_gpt(batch=2, seq=16, vocab=64, d_model=32, n_heads=2, n_layers=6)
    run = bench.VARIANTS[variant]
    for _ in range(2):  # warm-up: first-use imports and caches, not counted
        run(w)
    functools.reduce(lambda acc, _: run(w), range(steps), None)  # counted: callgrind's toggle


def count(variant: str, steps: int) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", "--collect-atstart=no",
           "--toggle-collect=functools_reduce", sys.executable, os.path.abspath(__file__),
           "--child", variant, "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"{variant}: valgrind run failed (exit {p.returncode}): {p.stderr[-800:]}")
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list (names of scripts/bench.py)")
    ap.add_argument("--steps", type=int, default=3, help="counted steps per variant (default 3)")
    ap.add_argument("--jobs", type=int, default=2, help="variants run at once (default 2)")
    ap.add_argument("--json", default=None, help="also write the counts here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps)
        return 0
    if shutil.which("valgrind") is None:
        print("bench_instr: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    names = [v for v in args.variants.split(",") if v]
    if "plain" not in names:
        names.insert(0, "plain")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        counts = dict(zip(names, ex.map(lambda v: count(v, args.steps), names)))
    per_step = {v: c / args.steps for v, c in counts.items()}
    base = per_step["plain"]
    print(f"tiny GPT step (1 thread), instructions per step, {args.steps} counted steps per variant")
    print(f"{'variant':20s} {'instructions':>14s} {'extra':>14s} {'ratio':>7s}")
    for v in names:
        print(f"{v:20s} {per_step[v]:14,.0f} {per_step[v] - base:+14,.0f} {per_step[v] / base:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "per_step": per_step}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
