#!/usr/bin/env python3
"""Where the statistics' time goes: bytes read per traced step, and how fast any reduction can read them.

    ./.venv/bin/python scripts/bench_stats.py               # GPT workload, both levels (~1 min)
    ./.venv/bin/python scripts/bench_stats.py --workload convnet --reps 15

nanhunt takes one ``torch.aminmax`` per recorded tensor. Is that reduction the bottleneck (then a
faster kernel would pay) or the memory it reads (then only reading fewer bytes would)? This script
answers with three measurements of the same traced step (scripts/_bench_models.py workloads):

1. **bytes**: what the statistics read per step, by phase and op (the tracer's own ``PendingStats``);
2. **on cached data**: each reduction's throughput on one tensor read over and over (in cache);
3. **in the step**: the time spent inside the reduction, summed over a traced step, for
   - ``aminmax``: what nanhunt runs (exact min/max, NaN propagates);
   - ``int-view aminmax``: the same bytes read as integers (``x.view(int16)``), the fastest full read
     torch has here (2-3x ``aminmax`` on cached data). It gives no exact float min/max: it stands for
     what a perfect fused kernel could reach, which is why it is measured and never used;
   - ``none``: the tracer with the reduction replaced by a constant (its Python alone), for the
     step ratio only.

If the in-step time barely moves between ``aminmax`` and ``int-view aminmax`` while their cached
throughputs differ by 2-3x, the reads are memory-bound inside the step and no kernel will make
them much cheaper. Timings are medians over interleaved repetitions; the reduction time is summed
around each call (on the CPU a reduction is synchronous), so it is far less noisy than a step ratio.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_models as models  # noqa: E402

import nanhunt  # noqa: E402
from nanhunt.tracing import stats as nh_stats  # noqa: E402

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}
_ZERO = (torch.zeros(()), torch.zeros(()))
_REAL = torch.aminmax


def _int_view(x: torch.Tensor) -> Any:
    it = _INT_VIEW.get(x.dtype)
    return _REAL(x.view(it)) if it is not None and x.is_contiguous() else _REAL(x)


REDUCTIONS: dict[str, Callable[[torch.Tensor], Any]] = {
    "aminmax": _REAL,
    "int-view aminmax": _int_view,
    "none": lambda x: _ZERO,
}


class _Swap:
    """Replaces the reduction the statistics call, and sums the time spent in it."""

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.bytes = 0

    def __call__(self, x: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        out = self.fn(x)
        self.seconds += time.perf_counter() - t0
        self.bytes += x.numel() * x.element_size()
        return out

    def __enter__(self) -> _Swap:
        torch.aminmax = self  # type: ignore[assignment]  # the statistics call torch.aminmax
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.aminmax = _REAL


def byte_table(w: models.Workload, level: str, top: int) -> None:
    sizes: dict[int, int] = {}
    real_add = nh_stats.PendingStats.add

    def add(self: nh_stats.PendingStats, slot: int, t: torch.Tensor) -> None:
        sizes[slot] = t.numel() * t.element_size()
        real_add(self, slot, t)

    nh_stats.PendingStats.add = add  # type: ignore[method-assign]
    try:
        with nanhunt.trace(w.model, level=level) as tr:
            w.step()
    finally:
        nh_stats.PendingStats.add = real_add  # type: ignore[method-assign]
    by: collections.Counter[tuple[str, str, str]] = collections.Counter()
    n: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for r in tr.records:
        if r.index in sizes:
            key = (r.phase.value, r.op or r.role.value, str(r.dtype))
            by[key] += sizes[r.index]
            n[key] += 1
    total = sum(by.values())
    print(f"\nlevel={level}: {len(tr.records)} records, {sum(n.values())} read by the statistics, "
          f"{total / 1e6:.1f} MB per step")
    for key, b in by.most_common(top):
        print(f"  {b / 1e6:7.1f} MB  {n[key]:4} reads  {' / '.join(key)}")


def cached_throughput(w: models.Workload) -> None:
    print("\non cached data (one tensor, read 200 times; best of 5):")
    numel = w.x.numel() * 256  # about one activation of the workload
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(numel).to(dtype)
        row = []
        for name, fn in list(REDUCTIONS.items())[:2]:
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    fn(x)
                best = min(best, (time.perf_counter() - t0) / 200)
            row.append(f"{name} {x.numel() * x.element_size() / best / 1e9:5.1f} GB/s")
        print(f"  {str(dtype)[6:]:9} {numel:>9} elements: " + "   ".join(row))


def in_step(w: models.Workload, level: str, reps: int) -> None:
    def traced() -> None:
        with nanhunt.trace(w.model, level=level):
            w.step()

    plain: list[float] = []
    step: dict[str, list[float]] = {k: [] for k in REDUCTIONS}
    inside: dict[str, list[float]] = {k: [] for k in REDUCTIONS}
    moved = 0
    traced()
    for _ in range(reps):
        t0 = time.perf_counter()
        w.step()
        plain.append(time.perf_counter() - t0)
        for name, fn in REDUCTIONS.items():
            with _Swap(fn) as sw:
                t0 = time.perf_counter()
                traced()
                step[name].append(time.perf_counter() - t0)
            inside[name].append(sw.seconds)
            moved = sw.bytes
    p = statistics.median(plain)
    print(f"\nin the step, level={level} ({reps} interleaved reps; plain step median {p * 1e3:.1f} ms; "
          f"{moved / 1e6:.1f} MB reduced per step):")
    for name in REDUCTIONS:
        ratio = statistics.median(s / q for s, q in zip(step[name], plain))
        r_ms = statistics.median(inside[name]) * 1e3
        rate = f"{moved / 1e6 / r_ms:5.1f} GB/s" if name != "none" else "         "
        print(f"  {name:17} step {ratio:.3f}x plain   inside the reduction {r_ms:6.1f} ms "
              f"({r_ms / (p * 1e3) * 100:4.1f}% of the plain step) {rate}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("gpt", "convnet"), default="gpt")
    ap.add_argument("--levels", default="module,op")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--top", type=int, default=8, help="rows of the byte table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = models.make_gpt() if args.workload == "gpt" else models.make_convnet()
    print(f"{w.desc}; torch {torch.__version__}, {args.threads} threads")
    for _ in range(2):
        w.step()
    levels = args.levels.split(",")
    for level in levels:
        byte_table(w, level, args.top)
    cached_throughput(w)
    for level in levels:
        in_step(w, level, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
