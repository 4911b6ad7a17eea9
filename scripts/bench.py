#!/usr/bin/env python3
"""What nanhunt costs, side by side with what users turn on today.

    ./.venv/bin/python scripts/bench.py            # full run, about 12 min on a 2-core CPU
    ./.venv/bin/python scripts/bench.py --quick    # smoke run, < 2 min
    ./.venv/bin/python scripts/bench.py --only replay --threads 1   # the replay-at-scale section alone
    ./.venv/bin/python scripts/bench.py --only run --threads 1      # what `nanhunt run` costs a clean run
    ./.venv/bin/python scripts/bench.py --only warn --threads 1     # does the Guard warn before the NaN?
    ./.venv/bin/python scripts/bench.py --only guard --threads 1    # the Guard's clean step, small and ~13 ms
    ./.venv/bin/python scripts/bench.py --reps 60 --workloads gpt
    ./.venv/bin/python scripts/bench.py --profile nanhunt-op --workloads gpt   # cProfile one variant
    ./.venv/bin/python scripts/bench.py --threads 1 --clock thread --busy-cores 1.5   # busy machine

Workloads (scripts/_bench_models.py, plain torch, fixed seeds): a GPT-style
transformer and a ResNet-like conv net, each one training step: zero_grad,
forward and loss under ``torch.autocast`` (bfloat16), ``GradScaler``-scaled
backward. Every variant runs the same step with its instrumentation switched on
for that step only (hooks installed before and removed after, inside the timed
region). Variants are interleaved: each repetition runs every variant once, in
a shuffled (seeded) order, so drift and noise from other processes hit them
alike; ratios are paired (variant / plain of the same repetition), and the table
gives their median and spread (p25-p75 and p10-p90).

Other processes matter a lot on a small CPU box: with torch's OpenMP threads on
every core, a second busy process makes each parallel region wait for a time
slice, and variants that launch many small kernels (one reduction per tensor)
slow down 10-40x while the plain step barely moves. So the script reads
/proc/stat around every repetition, computes how many cores *other* processes
used, sets aside repetitions above --busy-cores (default 0.15), and runs more
(up to 3x --reps, within the time budget). If fewer than 3 quiet repetitions
remain it uses all of them and says so. On a machine that is never quiet,
``--threads 1 --clock thread --busy-cores 1.5`` times each step by the main
thread's CPU time, which preemption does not inflate (SMT siblings and shared
caches still do).

Variants:
  plain            the step alone
  nanhunt-module   nanhunt.trace(model, level="module")
  nanhunt-op       nanhunt.trace(model, level="op")
  detect_anomaly   torch.autograd.detect_anomaly(check_nan=True)
  naive-hooks      forward hooks on every module + Tensor.register_hook on their
                   outputs; per tensor isnan().any(), isinf().any(), abs().max(),
                   each read back with .item() (what hand-written answers do)
  hf-debug         transformers.debug_utils.DebugUnderflowOverflow (only when
                   transformers imports; never installed by this script)
  floor-module     the bandwidth floor for module-level tracing: one torch.aminmax
                   over every module output, every gradient w.r.t. a module output
                   and every parameter gradient, never read back
  dispatch-bare    a TorchDispatchMode that only runs each op: the Python-per-op
                   floor any op-level tracer pays before doing any work
  dispatch-aminmax that mode plus one aminmax per floating non-view op output
                   (no attribution, no read-back); the time spent inside those
                   aminmax calls is also summed, which gives
  floor-op*        (derived, not a run) plain + the aminmax time over every op
                   output: one extra read of every activation and gradient

Peak memory (CPU): the process's peak resident set size during one step, from
/proc/self/status VmHWM after resetting it (``echo 5 > /proc/self/clear_refs``),
minus the resident size just before the step (after gc and malloc_trim). The
"extra" column is that peak minus the plain step's; "% of step" divides it by
the plain step's whole footprint (peak RSS minus the RSS the process had after
importing torch, before any model existed: weights, grads, activations, allocator
slack). Without clear_refs (not Linux, or forbidden) it falls back to one
subprocess per variant reading ru_maxrss. CUDA: torch.cuda.max_memory_allocated.
RSS is what the user pays, allocator fragmentation included: keeping ~1000
0-dim result tensors alive through a step raises the CPU peak by ~50 MiB on the
GPT workload although they hold a few KiB.

Replay at scale (first, ``--only replay`` alone, ``--no-replay`` skips it): ``nanhunt.replay(...,
bisect=True)`` on a failing training step with one planted culprit (N = 128, 512, 2048 residual
blocks; a transformers GPT-2 from a tiny config; 8 x Linear(2048, 2048), the memory case), each case
in a subprocess: replays, wall time as a multiple of the plain step, dataflow-graph edges, peak RSS
against the plain step's; then the op-level trace cost on the tiny and a ~23 M-parameter GPT-2. A
case that does not fit in what is left of ``--scale-cap-s`` says "skipped: over cap". --quick runs
N = 128, the GPT-2 case and the tiny GPT-2's op-level cost only. See the section's comment.

Results: a table on stdout and ``bench-results.json`` (``--json PATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_models as models  # noqa: E402

import nanhunt  # noqa: E402
from nanhunt._util._tree import iter_tensors  # noqa: E402

try:  # optional, never installed by this script
    from transformers.debug_utils import DebugUnderflowOverflow  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001  (ImportError, or a broken install)
    DebugUnderflowOverflow = None

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

TARGETS = {"nanhunt-module": 1.10, "nanhunt-op": 1.40, "nanhunt-op-scoped": 1.15}  # issue 8, bf16 transformer

# ============================================================== machine info


def machine_info(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    have = set(line.split(":", 1)[1].split())
                    flags = sorted(have & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_flags": flags,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nanhunt": getattr(nanhunt, "__version__", "?"),
        "transformers": None,
        "device": device,
    }
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    if DebugUnderflowOverflow is not None:
        import transformers  # type: ignore[import-not-found]

        info["transformers"] = transformers.__version__
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ================================================================== helpers


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class _Hooks:
    """Handles of one step's instrumentation, removed on exit."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def __enter__(self) -> _Hooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


# ================================================================= variants
# A variant is ``run(w) -> dict``: one step of workload ``w`` with its
# instrumentation, everything it needs installed and removed inside the call.


def v_plain(w: models.Workload) -> dict[str, Any]:
    w.step()
    return {}


def _v_nanhunt(level: str) -> Callable[[models.Workload], dict[str, Any]]:
    def run(w: models.Workload) -> dict[str, Any]:
        with nanhunt.trace(w.model, level=level) as t:
            w.step()
        recs = t.records
        return {"records": len(recs), "first": None if t.first is None else str(t.first.op or t.first.module)}

    return run


# Issue 8 target: "an op-level pass restricted to one suspect module <= 1.15x". nanhunt.trace has no
# such parameter yet; the variant runs as soon as trace() takes one of these names (ADAPT if it is
# called differently), on a mid-depth module of each workload.
_SCOPE_PARAMS = ("only", "modules", "scope", "within", "restrict")
SUSPECT = {"gpt": "blocks.3", "convnet": "layers.3"}


def _scope_param() -> str | None:
    params = inspect.signature(nanhunt.trace).parameters
    return next((p for p in _SCOPE_PARAMS if p in params), None)


def v_nanhunt_scoped(w: models.Workload) -> dict[str, Any]:
    p = _scope_param()
    assert p is not None
    with nanhunt.trace(w.model, level="op", **{p: [SUSPECT[w.name]]}) as t:
        w.step()
    return {"records": len(t.records)}


def v_anomaly(w: models.Workload) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
        with torch.autograd.detect_anomaly(check_nan=True):
            w.step()
    return {}


def v_naive(w: models.Workload) -> dict[str, Any]:
    """What a hand-written NaN hunt looks like: three host reads per tensor."""
    seen: list[tuple[str, bool, bool, float]] = []

    def stats(name: str, t: torch.Tensor) -> None:
        t = t.detach()
        seen.append((name, bool(t.isnan().any().item()), bool(t.isinf().any().item()), float(t.abs().max().item())))

    def fwd(mod: nn.Module, inp: Any, out: Any) -> None:
        name = names[mod]
        for t in iter_tensors(out):
            if t.is_floating_point() and t.numel():
                stats(name, t)
                if t.requires_grad:
                    t.register_hook(lambda g, n=name: stats(n + ".grad", g))

    names = {m: n for n, m in w.model.named_modules()}
    with _Hooks() as hk:
        for m in w.model.modules():
            hk.handles.append(m.register_forward_hook(fwd))
        w.step()
    return {"stats": len(seen)}


def v_hf_debug(w: models.Workload) -> dict[str, Any]:
    """transformers' DebugUnderflowOverflow; it keeps no handles, so remove its hooks by key."""
    assert DebugUnderflowOverflow is not None
    mods = list(w.model.modules())
    before = [set(m._forward_hooks) for m in mods]
    try:
        with contextlib.redirect_stdout(open(os.devnull, "w")):  # it prints frames on detection
            DebugUnderflowOverflow(w.model)
            w.step()
    finally:
        for m, keys in zip(mods, before):
            for k in [k for k in m._forward_hooks if k not in keys]:
                del m._forward_hooks[k]
                m._forward_hooks_with_kwargs.pop(k, None)
                m._forward_hooks_always_called.pop(k, None)
    return {}


def v_floor_module(w: models.Workload) -> dict[str, Any]:
    """One aminmax per module output, output gradient and parameter gradient; no read-back."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    done: set[tuple[int, tuple[int, ...], torch.dtype, int]] = set()

    def once(t: torch.Tensor) -> bool:
        key = (t.data_ptr(), tuple(t.shape), t.dtype, t._version)
        if key in done:
            return False
        done.add(key)
        return True

    def grad_hook(g: torch.Tensor) -> None:  # registered once per distinct output, so no dedupe here
        kept.append(torch.aminmax(g.detach()))

    def fwd(mod: nn.Module, inp: Any, out: Any) -> None:
        for t in iter_tensors(out):
            if t.is_floating_point() and t.numel() and once(t):
                kept.append(torch.aminmax(t.detach()))
                if t.requires_grad:
                    t.register_hook(grad_hook)

    def pgrad(p: torch.Tensor) -> None:
        if p.grad is not None:
            kept.append(torch.aminmax(p.grad.detach()))

    with _Hooks() as hk:
        for m in w.model.modules():
            hk.handles.append(m.register_forward_hook(fwd))
        for p in w.model.parameters():
            if p.requires_grad:
                hk.handles.append(p.register_post_accumulate_grad_hook(pgrad))
        w.step()
    return {"stats": len(kept)}


class _BareMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._disable_dynamo wrapper per op (~2 us): the cheapest mode there is

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return func(*args, **(kwargs or {}))


_VIEW: dict[Any, bool] = {}


def _returns_alias(func: Any) -> bool:
    r = _VIEW.get(func)
    if r is None:
        rets = func._schema.returns
        r = _VIEW[func] = bool(rets) and all(x.alias_info is not None for x in rets)
    return r


_CLOCK: Callable[[], float] = time.perf_counter  # time.thread_time with --clock thread


class _AminmaxMode(_BareMode):
    """Runs each op, then one aminmax per floating, non-aliasing output; times those aminmax calls."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.extra_s = 0.0
        self.cuda = device.startswith("cuda")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _returns_alias(func):
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                t0 = _CLOCK()
                self.kept.append(torch.aminmax(o))
                self.extra_s += _CLOCK() - t0
        return out


def v_dispatch_bare(w: models.Workload) -> dict[str, Any]:
    with _BareMode():
        w.step()
    return {}


def v_dispatch_aminmax(w: models.Workload) -> dict[str, Any]:
    mode = _AminmaxMode(w.device)
    with mode:
        w.step()
    # On CUDA the kernels are asynchronous: the in-mode timer sees launches only.
    return {"stats": len(mode.kept), "aminmax_s": mode.extra_s}


VARIANTS: dict[str, Callable[[models.Workload], dict[str, Any]]] = {
    "plain": v_plain,
    "nanhunt-module": _v_nanhunt("module"),
    "nanhunt-op": _v_nanhunt("op"),
    "nanhunt-op-scoped": v_nanhunt_scoped,
    "detect_anomaly": v_anomaly,
    "naive-hooks": v_naive,
    "hf-debug": v_hf_debug,
    "floor-module": v_floor_module,
    "dispatch-bare": v_dispatch_bare,
    "dispatch-aminmax": v_dispatch_aminmax,
}


# ============================================================== measurement


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summary(xs: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(xs) if xs else math.nan,
        "p10": _quantile(xs, 0.10),
        "p25": _quantile(xs, 0.25),
        "p75": _quantile(xs, 0.75),
        "p90": _quantile(xs, 0.90),
        "n": len(xs),
    }


_libc: Any = None


def _malloc_trim() -> None:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kib("VmHWM")
        return True
    except (OSError, KeyError):
        return False


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_snapshot() -> tuple[float, float, float]:
    """(CPU-seconds busy on the whole machine, CPU-seconds of this process, wall clock)."""
    busy = math.nan
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(v) - v[3] - v[4]) / _HZ  # all but idle and iowait; steal counts as busy
    except (OSError, ValueError, IndexError):
        pass
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return busy, ru.ru_utime + ru.ru_stime, time.perf_counter()


def _foreign_cores(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """How many cores other processes kept busy between two snapshots (NaN where unknown: counted quiet)."""
    wall = b[2] - a[2]
    if wall <= 0 or math.isnan(a[0]):
        return 0.0
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / wall)


def _quiesce() -> None:
    gc.collect()
    _malloc_trim()


def measure_peak(run: Callable[[], Any], device: str) -> tuple[float, float]:
    """(peak during ``run`` above the level before it, absolute peak), MiB."""
    _quiesce()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return (peak - base) / 2**20, peak / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    run()
    peak = _status_kib("VmHWM")
    return (peak - base) / 1024, peak / 1024


def _mem_subprocess(workload: str, variant: str, device: str) -> tuple[float, float]:
    """Fallback without clear_refs: peak RSS of a fresh process, after a plain warm-up step."""
    code = (
        "import resource,sys;sys.argv=['bench'];"
        f"sys.path.insert(0,{os.path.dirname(os.path.abspath(__file__))!r});"
        "import bench;"
        f"w=bench.models.WORKLOADS[{workload!r}](device={device!r},dtype=bench.torch.{WORKLOAD_DTYPE[0]});"
        f"r=bench.VARIANTS[{variant!r}];r(w);"
        "a=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
        "r(w);b=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;print(a,b)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    a, b = (int(x) for x in out.stdout.split()[-2:])
    return (b - a) / 1024, b / 1024


def bench_workload(w: models.Workload, names: list[str], args: argparse.Namespace, deadline: float,
                   rss_floor_mib: float, hard_deadline: float = math.inf) -> dict[str, Any]:
    """``deadline``: no new repetition once past it (if --min-reps are done); ``hard_deadline``: none at all."""
    dev = w.device
    runs = {n: VARIANTS[n] for n in names}
    extra: dict[str, dict[str, Any]] = {n: {} for n in names}

    global _CLOCK
    clock = _CLOCK = time.thread_time if getattr(args, "clock", "wall") == "thread" else time.perf_counter

    def timed(n: str) -> float:
        _sync(dev)
        t0 = clock()
        info = runs[n](w)
        _sync(dev)
        dt = clock() - t0
        for k, v in info.items():
            extra[n].setdefault(k, []).append(v)
        return dt

    # Warm-up: every variant (first dispatch-mode use imports modules, kernels get picked, caches fill).
    t_warm = time.perf_counter()
    for _ in range(args.warmup):
        for n in names:
            timed(n)
    gc.collect()
    gc.freeze()  # everything alive now is long-lived: keep gc passes inside the timed steps cheap
    for n in names:
        extra[n].clear()
    warm_s = time.perf_counter() - t_warm

    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    foreign: list[float] = []  # other processes' CPU use during each repetition, in cores
    t_loop = time.perf_counter()
    reps = 0
    while True:
        order = list(names)
        random.Random(1000 + reps).shuffle(order)
        got: dict[str, float] = {}
        c0 = _cpu_snapshot()
        for n in order:
            gc.collect(0)
            got[n] = timed(n)
        foreign.append(_foreign_cores(c0, _cpu_snapshot()))
        for n in names:
            times[n].append(got[n])
            ratios[n].append(got[n] / got["plain"])
        reps += 1
        quiet_reps = sum(1 for f in foreign if f <= args.busy_cores)
        if quiet_reps >= args.reps or reps >= 3 * args.reps:
            break
        now = time.perf_counter()
        if (now > deadline and reps >= args.min_reps) or now > hard_deadline:
            break
    loop_s = time.perf_counter() - t_loop

    # Peak memory: a few more interleaved steps, each measured alone.
    mem: dict[str, list[float]] = {n: [] for n in names}
    mem_abs: dict[str, list[float]] = {n: [] for n in names}
    method = "cuda.max_memory_allocated" if dev.startswith("cuda") else "VmHWM reset (clear_refs)"
    use_sub = not dev.startswith("cuda") and not _can_reset_hwm()
    if use_sub:
        method = "ru_maxrss, one subprocess per variant"
    for rep in range(args.mem_reps):
        if rep and time.perf_counter() > hard_deadline:
            break
        order = list(names)
        random.Random(2000 + rep).shuffle(order)
        for n in order:
            if use_sub:
                if rep:
                    continue
                d, a = _mem_subprocess(w.name, n, dev)
            else:
                d, a = measure_peak(lambda n=n: runs[n](w), dev)
            mem[n].append(d)
            mem_abs[n].append(a)
    gc.unfreeze()

    quiet = [i for i, f in enumerate(foreign) if f <= args.busy_cores]
    use = quiet if len(quiet) >= 3 else list(range(reps))
    sel = lambda xs: [xs[i] for i in use]  # noqa: E731
    plain_med = statistics.median(sel(times["plain"]))
    plain_mem = statistics.median(mem["plain"]) if mem["plain"] else math.nan
    plain_abs = statistics.median(mem_abs["plain"]) if mem_abs["plain"] else math.nan
    footprint = plain_abs if dev.startswith("cuda") else plain_abs - rss_floor_mib
    rows: dict[str, Any] = {}
    for n in names:
        r: dict[str, Any] = {
            "time_s": _summary(sel(times[n])),
            "ratio": _summary(sel(ratios[n])),
            "time_s_all_reps": times[n],
        }
        if mem[n]:
            pk = statistics.median(mem[n])
            r["peak_mib"] = pk
            r["extra_peak_mib"] = pk - plain_mem
            r["extra_peak_pct_of_step"] = 100.0 * (pk - plain_mem) / footprint if footprint > 0 else math.nan
        for k, vs in extra[n].items():
            if k == "aminmax_s":
                r["aminmax_s"] = _summary(vs)
            elif k == "first":
                r["first"] = vs[-1] if vs else None
            elif vs:
                r[k] = vs[-1]
        rows[n] = r
    if "dispatch-aminmax" in rows and "aminmax_s" in rows["dispatch-aminmax"] and not dev.startswith("cuda"):
        am = rows["dispatch-aminmax"]["aminmax_s"]["median"]
        rows["floor-op*"] = {
            "derived": "plain median + median time inside the aminmax calls of dispatch-aminmax",
            "time_s": {"median": plain_med + am},
            "ratio": {"median": (plain_med + am) / plain_med},
            "stats": rows["dispatch-aminmax"].get("stats"),
        }
    return {
        "workload": w.name,
        "desc": w.desc,
        "params": sum(p.numel() for p in w.model.parameters()),
        "reps": reps,
        "reps_used": len(use),
        "reps_used_are": "quiet" if use is quiet else "all (too few quiet repetitions)",
        "foreign_cores_per_rep": foreign,
        "warmup": args.warmup,
        "warmup_s": warm_s,
        "loop_s": loop_s,
        "memory_method": method,
        "plain_footprint_mib": footprint,
        "variants": rows,
    }


# ========================================================= first use (cold)


def bench_cold(device: str) -> dict[str, Any]:
    """First nanhunt op-level trace in a fresh process: the one-off import of the dispatch machinery."""
    code = f"""
import json, sys, time
sys.argv = ['bench']
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
def rss():
    for l in open('/proc/self/status'):
        if l.startswith('VmRSS:'): return int(l.split()[1]) / 1024
t0 = time.perf_counter(); import torch, nanhunt; imp = time.perf_counter() - t0
import _bench_models as m
w = m.make_gpt(device={device!r}, dtype=torch.{WORKLOAD_DTYPE[0]}); w.step(); w.step()
r0 = rss(); t0 = time.perf_counter(); w.step(); plain = time.perf_counter() - t0
out = {{"import_s": imp}}
for lvl in ("module", "op"):
    r0 = rss(); t0 = time.perf_counter()
    with nanhunt.trace(w.model, level=lvl): w.step()
    first = time.perf_counter() - t0; r1 = rss(); t0 = time.perf_counter()
    with nanhunt.trace(w.model, level=lvl): w.step()
    second = time.perf_counter() - t0
    out[lvl] = {{"first_s": first, "second_s": second, "first_extra_s": first - second, "rss_growth_mib": r1 - r0}}
out["plain_s"] = plain
print(json.dumps(out))
"""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


# ===================================================== replay at scale (issue 20)
# One training step as a loop runs it (zero_grad, forward and loss under autocast, GradScaler-scaled
# backward, scaler.step(AdamW), scaler.update()) with one planted culprit, then nanhunt.replay(...,
# bisect=True) on it: two traced runs, the bisection's trials, the float32 control. Each case runs in a
# subprocess of its own (a clean RSS high-water mark, no state left from the previous case):
#   blocks N   N residual blocks (Linear 32x32, LayerNorm), N = 128, 512, 2048
#   gpt2-tiny  transformers GPT-2 from a tiny config, block 1's MLP input weight scaled
#   wide       8 x Linear(2048, 2048) with AdamW: weights and moments are the footprint (memory case)
# Per case: replays (bisection trials), wall time of the replay as a multiple of the plain step timed in
# the same process, dataflow-graph edges of one traced failing step (graph.nonfinite_graph), and the peak
# RSS of the replay against the plain step's (each measured alone after a VmHWM reset, above the RSS the
# process had before the model existed), and its peak anonymous memory (RssAnon, sampled every millisecond by a
# thread: the kernel keeps no high-water mark of it) against the plain step's. The wide case also replays with the
# snapshot on disk (StepState(snapshot="disk"): a mapped temporary file, whose resident pages count in RSS but are
# the page cache's, written back and dropped under memory pressure): both peaks, and whether the verdict is the
# same. float16 steps where this CPU runs them at most 2x slower than
# float32; else a float32 step with an overflow injected (gain 1e39): the table says which ran.
# The op-level trace cost (level="op" / plain, forward + backward, bfloat16 autocast) on the tiny and a
# ~23 M-parameter GPT-2 runs in this process, interleaved like the workloads above.

SCALE_NS = (128, 512, 2048)
HALF_SLOWDOWN_LIMIT = 2.0  # float16 step / float32 step above which the float32 fallback runs


def _make_case(kind: str, n: int, dtype: torch.dtype) -> models.TrainStep:
    if kind == "blocks":
        return models.make_blocks(n, dtype=dtype)
    if kind == "wide":
        return models.make_wide(dtype=dtype)
    return models.make_gpt2("tiny", dtype=dtype, culprit=True)


def _best_step_s(w: models.TrainStep, reps: int = 3) -> float:
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        w.step()
        best = min(best, time.perf_counter() - t0)
    return best


# The workloads' dtype: bfloat16 autocast, or float32 where this CPU has no fast bfloat16 (a matmul some 20x
# slower: the whole run would measure that); (name, what the tables say of it). Set by main().
WORKLOAD_DTYPE: list[str] = ["bfloat16", ""]


def _workload_dtype(device: str) -> tuple[str, str]:
    """bfloat16, unless this CPU multiplies bfloat16 matrices more than HALF_SLOWDOWN_LIMIT x slower than float32
    ones (a 256x256 matmul, timed a few times each): then float32, and the reason, said in each table's title."""
    if not device.startswith("cpu"):
        return "bfloat16", ""
    g = torch.Generator().manual_seed(0)
    best: dict[torch.dtype, float] = {}
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256, generator=g).to(dt)
        a @ a  # warm
        t = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            a @ a
            t = min(t, time.perf_counter() - t0)
        best[dt] = t
    ratio = best[torch.bfloat16] / best[torch.float32]
    if ratio <= HALF_SLOWDOWN_LIMIT:
        return "bfloat16", ""
    return "float32", f" (this CPU's bfloat16 matmul is {ratio:.0f}x slower than float32: float32 steps)"


# The Guard's ~13 ms step: fixtures.models.MLP 64 -> GUARD_WIDTH -> 8 on GUARD_BATCH rows, about 13 ms a step in
# float32 on one thread of a 2-core Xeon VM (the small step is bench_guard's MLP default, about 1 ms in float16).
GUARD_WIDTH, GUARD_BATCH = 3584, 256


def bench_guard_steps(args: argparse.Namespace) -> int:
    """``--only guard``: scripts/bench_guard.py on the MLP loop twice, each run ``--rounds`` times alternating the
    variants (median of the rounds): small steps in float16 with a GradScaler, and ~13 ms steps in the workloads'
    dtype (bfloat16, or float32 where this CPU's bfloat16 matmul is slow: the title says which) with a GradScaler
    too, so that the Guard does the same work on both. ``--threads 1`` times each step by the thread's CPU time."""
    import bench_guard

    common = ["--model", "mlp", "--device", args.device]
    if args.threads:
        common += ["--threads", str(args.threads)]
    if args.threads == 1 and args.device == "cpu":
        common += ["--clock", "thread"]
    rounds = ["--rounds", "2" if args.quick else "5"]
    print("small steps", flush=True)
    rc = bench_guard.main([*common, *rounds, "--dtype", "float16", "--steps", "100" if args.quick else "400"])
    dtype, why = _workload_dtype(args.device)
    print(f"\n~13 ms steps{why}", flush=True)
    return rc or bench_guard.main([*common, *rounds, "--dtype", dtype, "--scaler", "--width", str(GUARD_WIDTH),
                                   "--batch", str(GUARD_BATCH), "--steps", "20" if args.quick else "60",
                                   "--warmup", "5"])


def _pick_dtype(kind: str, n: int) -> tuple[torch.dtype, dict[str, Any]]:
    """float16 unless this CPU runs the case's float16 step more than HALF_SLOWDOWN_LIMIT x slower."""
    times: dict[str, float] = {}
    for dt in (torch.float16, torch.float32):
        w = _make_case(kind, n, dt)
        w.step()  # warm
        times[str(dt)[6:]] = _best_step_s(w, 2)
        del w
    ratio = times["float16"] / times["float32"]
    dtype = torch.float16 if ratio <= HALF_SLOWDOWN_LIMIT else torch.float32
    return dtype, {"float16_step_s": times["float16"], "float32_step_s": times["float32"], "float16_slowdown": ratio}


class _AnonPeak:
    """The peak RssAnon (MiB) while the block runs, sampled every ``every_s`` by a thread."""

    def __init__(self, every_s: float = 1e-3) -> None:
        import threading

        self.every_s, self.peak_mib = every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self) -> None:
        self.peak_mib = max(self.peak_mib, _status_kib("RssAnon") / 1024)

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> _AnonPeak:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _peaks(run: Callable[[], Any]) -> tuple[float, float, float]:
    """(peak RSS above the level before ``run``, absolute peak RSS, absolute peak RssAnon), MiB."""
    _quiesce()  # before the first sample: what the last run freed may sit in malloc's heap until trimmed
    with _AnonPeak() as anon:
        extra, peak = measure_peak(run, "cpu")
    return extra, peak, anon.peak_mib


def scale_case(kind: str, n: int) -> dict[str, Any]:
    """One case, in this (fresh) process: see the section comment."""
    from nanhunt.tracing.graph import nonfinite_graph
    from nanhunt.hunt.pipeline import hunt
    from nanhunt.step.step import Step

    hwm = _can_reset_hwm()
    dtype, pick = _pick_dtype(kind, n) if kind != "wide" else (torch.float32, {"note": "float32: the memory case"})
    # The floor: after steps of the same kind of model ran and were freed (imports, kernels and thread pools
    # initialised), before this model exists. The footprint above it: weights, moments, grads, activations.
    gc.collect()
    _malloc_trim()
    rss_floor = _status_kib("VmRSS") / 1024
    anon_floor = _status_kib("RssAnon") / 1024 if hwm else 0.0
    healthy: tuple[float, float] | None = None
    if hwm and kind == "wide":
        # The step a training run must fit is a healthy one: the failing step below skips AdamW's update (the
        # GradScaler found an Inf), whose temporaries a healthy step and the replay's finite trials allocate. The
        # same model, unplanted, alone in the process: its peaks above the same floors.
        h = _make_case(kind, n, dtype)
        h.plant = None
        h.prime().step()  # warm, and its .grad tensors as a user's step leaves them
        _, h_abs, h_anon = _peaks(h.step)
        healthy = (h_abs - rss_floor, h_anon - anon_floor)
        del h
        gc.collect()
        _malloc_trim()
    w = _make_case(kind, n, dtype).prime()
    out: dict[str, Any] = {"case": w.name, "desc": w.desc, "dtype": str(dtype)[6:], **pick,
                           "torch_threads": torch.get_num_threads(),
                           "params": sum(p.numel() for p in w.model.parameters()),
                           "modules": sum(1 for _ in w.model.modules()), "planted": w.culprit}
    w.step()  # warm; a failing step: GradScaler skips the update, the weights stay
    out["step_s"] = _best_step_s(w)
    replay = lambda: nanhunt.replay(w.model, w.batch, loss_fn=w.loss_fn, dtype=w.dtype,  # noqa: E731
                                    device_type=w.device_type, scaler=w.scaler, optimizer=w.optimizer, bisect=True)
    reports: list[Any] = []
    if hwm:
        plain_extra, plain_abs, plain_anon = _peaks(w.step)
        disk: dict[str, Any] = {}
        if kind == "wide":  # the memory case: the replay with its snapshot in a mapped temporary file, first (the
            # in-memory replay's freed heap would count in its anonymous peak otherwise)
            disk_reports: list[Any] = []
            t0 = time.perf_counter()
            _, disk_abs, disk_anon = _peaks(lambda: disk_reports.append(hunt(Step.of(
                w.model, w.batch, loss_fn=w.loss_fn, dtype=w.dtype, device_type=w.device_type, scaler=w.scaler,
                optimizer=w.optimizer, snapshot="disk"), prove=True)))
            disk = {"replay_s": time.perf_counter() - t0, "replay_footprint_mib": disk_abs - rss_floor,
                    "replay_over_plain": (disk_abs - rss_floor) / (plain_abs - rss_floor),
                    "replay_anon_mib": disk_anon - anon_floor,
                    "replay_anon_over_plain": (disk_anon - anon_floor) / (plain_anon - anon_floor),
                    # the step's .grad tensors: in the file too while the replay runs, their memory freed
                    "spilled_grads_mib": sum(p.grad.nbytes for p in w.model.parameters() if p.grad is not None) / 2**20,
                    "verdict": disk_reports[0].verdict}
            if healthy is not None:
                disk["replay_over_healthy"] = (disk_abs - rss_floor) / healthy[0]
                disk["replay_anon_over_healthy"] = (disk_anon - anon_floor) / healthy[1]
        t0 = time.perf_counter()
        rep_extra, rep_abs, rep_anon = _peaks(lambda: reports.append(replay()))
        out["replay_s"] = time.perf_counter() - t0
        out["memory"] = {"method": "VmHWM reset (clear_refs), RSS; RssAnon sampled every 1 ms", "rss_floor_mib": rss_floor,
                         "plain_peak_mib": plain_abs, "replay_peak_mib": rep_abs,
                         "plain_extra_mib": plain_extra, "replay_extra_mib": rep_extra,
                         "plain_footprint_mib": plain_abs - rss_floor, "replay_footprint_mib": rep_abs - rss_floor,
                         "replay_over_plain": (rep_abs - rss_floor) / (plain_abs - rss_floor),
                         "anon_floor_mib": anon_floor, "plain_anon_mib": plain_anon - anon_floor,
                         "replay_anon_mib": rep_anon - anon_floor,
                         "replay_anon_over_plain": (rep_anon - anon_floor) / (plain_anon - anon_floor)}
        if healthy is not None:
            out["memory"].update(healthy_footprint_mib=healthy[0], healthy_anon_mib=healthy[1],
                                 replay_over_healthy=(rep_abs - rss_floor) / healthy[0],
                                 replay_anon_over_healthy=(rep_anon - anon_floor) / healthy[1])
        if disk:
            dv, mv = disk.pop("verdict"), reports[0].verdict
            disk["same_verdict"] = (dv is None) == (mv is None) and (
                dv is None or (dv.kind, dv.culprits) == (mv.kind, mv.culprits))
            out["memory"]["disk"] = disk
    else:
        t0 = time.perf_counter()
        reports.append(replay())
        out["replay_s"] = time.perf_counter() - t0
        out["memory"] = {"method": "none: /proc/self/clear_refs unavailable"}
    rep = reports[0]
    v = rep.verdict
    out.update(replay_over_step=out["replay_s"] / out["step_s"], replays=None if v is None else v.replays,
               verdict=None if v is None else v.kind, culprits=None if v is None else list(v.culprits),
               first=None if rep.first is None else f"{rep.first.module} {rep.first.op}", records=rep.n_records)
    with nanhunt.trace(w.model) as t:
        w.step()
    t0 = time.perf_counter()
    g = nonfinite_graph(t.records)
    out["graph"] = {"edges": g.number_of_edges(), "nodes": g.number_of_nodes(), "records": len(t.records),
                    "build_s": time.perf_counter() - t0}
    return out


def _run_case(kind: str, n: int, timeout_s: float, threads: int | None) -> dict[str, Any]:
    # one torch thread unless --threads says otherwise: these steps are small, and on a shared CPU an OpenMP
    # team waiting for a busy core made a 128-block case 4x slower (50 s against 12 s)
    cmd = [sys.executable, os.path.abspath(__file__), "--scale-case", f"{kind}:{n}", "--threads", str(threads or 1)]
    c0, k0 = _cpu_snapshot(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        return {"case": f"{kind}{n if kind == 'blocks' else ''}", "skipped": f"skipped: over cap ({timeout_s:.0f} s)"}
    c1, k1 = _cpu_snapshot(), resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (k1.ru_utime + k1.ru_stime) - (k0.ru_utime + k0.ru_stime)
    # other processes' CPU use while the case ran, in cores (the case's own process excluded)
    foreign = _foreign_cores(c0, (c1[0] - child, c1[1], c1[2]))
    try:
        out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"case": f"{kind}{n}", "error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    out["foreign_cores"] = foreign
    return out


class _OpCost:
    """A GPT-2 forward + backward as a benchmark workload (what bench_workload times)."""

    def __init__(self, w: models.TrainStep) -> None:
        self.name, self.desc, self.model, self.device = w.name, w.desc + ", autocast bfloat16", w.model, w.device
        self.step = w.forward_backward


def bench_scale(args: argparse.Namespace, t_start: float, rss_floor: float) -> dict[str, Any]:
    """The section: the cases in subprocesses (a case past the time left of ``args.scale_cap_s`` is
    skipped), then the op-level cost on the GPT-2s."""
    out: dict[str, Any] = {"cases": [], "op_cost": []}
    cap = args.scale_cap_s
    t0 = time.perf_counter()
    ns = SCALE_NS[:1] if args.quick else SCALE_NS
    plan = [("blocks", n) for n in ns] + [("gpt2", 0)] + ([] if args.quick else [("wide", 0)])
    for kind, n in plan:
        left = cap - (time.perf_counter() - t0)
        print(f"[{time.perf_counter() - t_start:6.1f}s] replay at scale: {kind} {n or ''} ({left:.0f} s left of the cap)",
              file=sys.stderr, flush=True)
        if left < 5:
            out["cases"].append({"case": f"{kind}{n or ''}", "skipped": f"skipped: over cap ({cap:.0f} s)"})
            continue
        out["cases"].append(_run_case(kind, n, left, args.threads))
    sizes = ("tiny",) if args.quick else ("tiny", "23M")
    for size in sizes:
        w = _OpCost(models.make_gpt2(size, dtype=torch.bfloat16))
        print(f"[{time.perf_counter() - t_start:6.1f}s] op-level cost: {w.name}", file=sys.stderr, flush=True)
        share = 8.0 if args.quick else (40.0 if size == "tiny" else 60.0)
        now = time.perf_counter()
        variants = ["plain", "nanhunt-op"] + ([] if args.quick else ["dispatch-bare", "dispatch-aminmax"])  # the floors
        res = bench_workload(w, variants, args, now + share, rss_floor, now + 1.5 * share)  # type: ignore[arg-type]
        out["op_cost"].append(res)
    return out


def print_scale(sc: dict[str, Any]) -> None:
    print("\nreplay at scale (nanhunt.replay(..., bisect=True) on a failing step: zero_grad, autocast forward and loss, "
          "GradScaler backward, scaler.step(AdamW), update; each case in its own process, torch threads "
          f"{sorted({c['torch_threads'] for c in sc['cases'] if 'torch_threads' in c}) or '?'})")
    hdr = (f"{'case':<14}{'dtype':>8}{'params':>9}{'plain ms':>10}{'replay s':>10}{'x step':>8}{'replays':>9}"
           f"{'edges':>8}{'records':>9}{'RSS MiB plain/replay':>22}  verdict")
    print(hdr)
    print("-" * len(hdr))
    for c in sc["cases"]:
        if "skipped" in c or "error" in c:
            print(f"{c['case']:<14}  {c.get('skipped') or 'error: ' + c['error']}")
            continue
        mem = c["memory"]
        pk = (f"{mem['plain_footprint_mib']:.0f}/{mem['replay_footprint_mib']:.0f} ({mem['replay_over_plain']:.2f}x)"
              if "replay_over_plain" in mem else "n/a")
        print(f"{c['case']:<14}{c['dtype']:>8}{c['params'] / 1e6:>8.2f}M{c['step_s'] * 1e3:>10.1f}{c['replay_s']:>10.2f}"
              f"{c['replay_over_step']:>7.0f}x{c['replays']!s:>9}{c['graph']['edges']:>8}{c['graph']['records']:>9}"
              f"{pk:>22}  {c['verdict']} {','.join(c['culprits'] or []) or 'first: ' + str(c['first'])} "
              f"(planted {c['planted']})")
    for c in sc["cases"]:
        if "skipped" in c or "error" in c:
            continue
        mem = c["memory"]
        why = (f"float16 step {c['float16_step_s'] * 1e3:.1f} ms vs float32 {c['float32_step_s'] * 1e3:.1f} ms "
               f"({c['float16_slowdown']:.1f}x)" if "float16_slowdown" in c else c.get("note", ""))
        fallback = " -> float32 with an injected overflow" if c["dtype"] == "float32" and "float16_slowdown" in c else ""
        line = f"  {c['case']}: {c['desc']}; {why}{fallback}"
        if "plain_footprint_mib" in mem:
            line += (f"; RSS footprint (above the {mem['rss_floor_mib']:.0f} MiB before the model): plain step "
                     f"{mem['plain_footprint_mib']:.0f} MiB, replay + bisection {mem['replay_footprint_mib']:.0f} MiB")
        if "replay_anon_over_plain" in mem:
            line += (f"; anonymous (RssAnon): plain {mem['plain_anon_mib']:.0f} MiB, replay {mem['replay_anon_mib']:.0f} "
                     f"MiB ({mem['replay_anon_over_plain']:.2f}x)")
        print(line + f"; graph built in {c['graph']['build_s'] * 1e3:.0f} ms; other processes' load "
              f"{c.get('foreign_cores', math.nan):.2f} cores")
        if "disk" in mem:
            d = mem["disk"]
            print(f"  {c['case']} with the snapshot on disk (snapshot=\"disk\"), against the same plain step: RSS "
                  f"{d['replay_footprint_mib']:.0f} MiB ({d['replay_over_plain']:.2f}x; the mapped file's pages "
                  f"included, the page cache's), anonymous {d['replay_anon_mib']:.0f} MiB ({d['replay_anon_over_plain']:.2f}x; "
                  f"target <= 1.10x); in memory: RSS {mem['replay_over_plain']:.2f}x, anonymous "
                  f"{mem['replay_anon_over_plain']:.2f}x; the step's .grad tensors ({d['spilled_grads_mib']:.0f} MiB) "
                  f"wait in the file too; replay {d['replay_s']:.1f} s vs {c['replay_s']:.1f} s; "
                  f"{'same verdict' if d['same_verdict'] else 'VERDICT DIFFERS'}")
            if "replay_over_healthy" in d:
                print(f"  {c['case']} against a healthy step of the same model (AdamW's update runs; the failing step "
                      f"skips it, the replay's finite trials run it): healthy step RSS {mem['healthy_footprint_mib']:.0f} "
                      f"MiB, anonymous {mem['healthy_anon_mib']:.0f} MiB; replay with the disk snapshot: RSS "
                      f"{d['replay_over_healthy']:.2f}x, anonymous {d['replay_anon_over_healthy']:.2f}x (target <= "
                      f"1.10x); in memory: RSS {mem['replay_over_healthy']:.2f}x, anonymous "
                      f"{mem['replay_anon_over_healthy']:.2f}x")
    blocks = {c["case"]: c for c in sc["cases"] if c["case"].startswith("blocks") and "replay_over_step" in c}
    if "blocks128" in blocks and "blocks512" in blocks:
        print(f"  N=128 -> 512: replay / plain step grows {blocks['blocks512']['replay_over_step'] / blocks['blocks128']['replay_over_step']:.2f}x "
              f"(target <= 1.3x); graph edges {blocks['blocks512']['graph']['edges'] / max(blocks['blocks128']['graph']['edges'], 1):.2f}x "
              f"for {blocks['blocks512']['graph']['records'] / blocks['blocks128']['graph']['records']:.2f}x the records")
    for wr in sc["op_cost"]:
        r = wr["variants"]["nanhunt-op"]
        fc = sorted(wr["foreign_cores_per_rep"])
        print(f"op-level cost, {wr['workload']} ({wr['desc']}): {r['ratio']['median']:.2f}x the plain step "
              f"(p25-p75 {r['ratio']['p25']:.2f}-{r['ratio']['p75']:.2f}; plain {wr['variants']['plain']['time_s']['median'] * 1e3:.1f} ms, "
              f"{r.get('records', '?')} records; {wr['reps_used']} of {wr['reps']} reps used ({wr['reps_used_are']}), other "
              f"processes' load median {statistics.median(fc):.2f} cores, max {fc[-1]:.2f})")
        floors = [f"{n} {wr['variants'][n]['ratio']['median']:.2f}x" for n in ("dispatch-bare", "dispatch-aminmax")
                  if n in wr["variants"]]
        if floors:
            print(f"  floors in the same run: {', '.join(floors)} (a dispatch mode that only runs each op; that mode "
                  f"plus one aminmax per floating op output, no attribution)")


# ================================================================= profile


def profile_variant(w: models.Workload, name: str, steps: int, top: int) -> None:
    import cProfile
    import pstats

    run = VARIANTS[name]
    for _ in range(2):
        run(w)
    gc.collect()
    gc.freeze()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        run(w)
    pr.disable()
    dt = time.perf_counter() - t0
    print(f"\ncProfile of {name} on {w.name}: {steps} steps, {dt / steps * 1e3:.1f} ms/step under the profiler")
    st = pstats.Stats(pr).strip_dirs()
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)


# =================================================================== report


def _fmt_ratio(r: dict[str, Any]) -> tuple[str, str, str]:
    q = r["ratio"]
    med = f"{q['median']:.3f}x"
    if "p25" not in q:
        return med, "", ""
    return med, f"{q['p25']:.2f}-{q['p75']:.2f}", f"{q['p10']:.2f}-{q['p90']:.2f}"


def print_table(res: dict[str, Any]) -> None:
    m = res["machine"]
    print(f"\nnanhunt benchmark: {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}, "
          f"{m['torch_threads']} threads, device {m['device']}, clock {res['args']['clock']}" + (f" ({m['gpu']})" if m.get("gpu") else ""))
    for wr in res["workloads"]:
        fc = sorted(wr["foreign_cores_per_rep"])
        print(f"\n{wr['workload']}: {wr['desc']}  [{wr['params'] / 1e6:.2f} M params; {wr['reps_used']} of "
              f"{wr['reps']} interleaved reps used: {wr['reps_used_are']}; other processes' CPU load median "
              f"{statistics.median(fc):.2f} cores, max {fc[-1]:.2f}]")
        hdr = f"{'variant':<17}{'median ms':>10}{'ratio':>9}{'p25-p75':>12}{'p10-p90':>12}{'peak MiB':>10}{'extra MiB':>10}{'% step':>8}{'records':>9}  target"
        print(hdr)
        print("-" * len(hdr))
        for n, r in wr["variants"].items():
            med, iqr, p1090 = _fmt_ratio(r)
            ms = r["time_s"]["median"] * 1e3
            pk = f"{r['peak_mib']:.1f}" if "peak_mib" in r else ""
            ex = f"{r['extra_peak_mib']:+.1f}" if "extra_peak_mib" in r and n != "plain" else ""
            pct = f"{r['extra_peak_pct_of_step']:+.1f}" if "extra_peak_pct_of_step" in r and n != "plain" else ""
            recs = r.get("records", r.get("stats", ""))
            tgt = ""
            if n in TARGETS and wr["workload"] == "gpt":
                ok = r["ratio"]["median"] <= TARGETS[n]
                tgt = f"<= {TARGETS[n]:.2f}x {'met' if ok else 'MISSED'}"
            print(f"{n:<17}{ms:>10.1f}{med:>9}{iqr:>12}{p1090:>12}{pk:>10}{ex:>10}{pct:>8}{recs!s:>9}  {tgt}")
        pt = wr["variants"]["plain"]["time_s"]
        print(f"  plain step p10-p90 {pt['p10'] * 1e3:.1f}-{pt['p90'] * 1e3:.1f} ms. memory: {wr['memory_method']}; "
              f"plain step footprint {wr['plain_footprint_mib']:.0f} MiB. records: nanhunt records; "
              "stats: tensors the other tracers looked at.")
        if pt["p90"] > 1.3 * pt["p10"]:
            print("  NOTE: the plain step varied by more than 30% between repetitions: the machine was busy. "
                  "Medians of paired ratios resist that, but re-run on an idle machine before quoting the figures.")
    for n, why in res.get("skipped", {}).items():
        print(f"skipped {n}: {why}")
    c = res.get("cold")
    if c and "error" not in c:
        print(f"\nfirst use in a fresh process (gpt): import torch+nanhunt {c['import_s']:.2f} s; first module trace "
              f"{c['module']['first_extra_s'] * 1e3:+.0f} ms; first op trace {c['op']['first_extra_s'] * 1e3:+.0f} ms, "
              f"RSS {c['op']['rss_growth_mib']:+.0f} MiB")
    elif c:
        print(f"\nfirst use: {c['error']}")
    if res.get("scale") is not None:
        print_scale(res["scale"])


def _jsonable(x: Any) -> Any:
    """NaN/inf -> null, so the file is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short smoke run (< 1 min)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions per workload (default 40, quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up rounds over all variants (default 2, quick 1)")
    ap.add_argument("--mem-reps", type=int, default=None, help="peak-memory measurements per variant (default 3, quick 1)")
    ap.add_argument("--min-reps", type=int, default=None, help="repetitions run even past the time budget (default 5, quick 3)")
    ap.add_argument("--busy-cores", type=float, default=0.15,
                    help="a repetition during which other processes used more CPU cores than this is set aside "
                         "(the run adds repetitions, up to 3x --reps, within the budget)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds from the start after which no repetition starts once --min-reps are done (each workload "
                         "gets an equal share, and may overrun it by 25%% to reach --min-reps) (default 220, quick 35)")
    ap.add_argument("--workloads", default="gpt,convnet", help="comma list of: " + ",".join(models.WORKLOADS))
    ap.add_argument("--variants", default=None, help="comma list (plain is always run); default all available")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: time each step by the CPU time of the main thread (needs --threads 1; "
                         "robust on a busy machine, since time spent preempted does not count)")
    ap.add_argument("--no-replay", action="store_true", help="skip the replay-at-scale section")
    ap.add_argument("--only", choices=("replay", "run", "warn", "guard"), default=None,
                    help="replay: run only the replay-at-scale section (replay + bisection on N blocks and GPT-2, "
                         "memory, op-level cost on GPT-2); run: what `nanhunt run` costs a clean run (a plain "
                         "loop, a transformers.Trainer, a Lightning Trainer: scripts/bench_callbacks.py --via run); "
                         "warn: the Guard's warnings before the NaN on failing and healthy runs "
                         "(scripts/bench_warn.py); guard: what nanhunt.Guard costs a clean step of an MLP loop, "
                         "small and at ~13 ms a step (scripts/bench_guard.py)")
    ap.add_argument("--scale-cap-s", type=float, default=None,
                    help="seconds for the replay-at-scale cases; a case that does not fit is skipped and says so "
                         "(default 420, quick 60)")
    ap.add_argument("--scale-case", default=None, help=argparse.SUPPRESS)  # KIND:N, one case (a subprocess)
    ap.add_argument("--no-cold", action="store_true", help="skip the first-use measurement (a subprocess)")
    ap.add_argument("--json", default="bench-results.json", help="where to write the results")
    ap.add_argument("--profile", metavar="VARIANT", help="cProfile VARIANT on the first workload instead of benchmarking")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--profile-top", type=int, default=30)
    args = ap.parse_args(argv)
    if args.only == "run":
        import bench_callbacks

        return bench_callbacks.main(["--via", "run", *(["--threads", str(args.threads)] if args.threads else []),
                                     *(["--rounds", "3"] if args.quick else [])])
    if args.only == "guard":
        return bench_guard_steps(args)
    if args.only == "warn":
        import bench_warn

        return bench_warn.main([*(["--threads", str(args.threads)] if args.threads else []),
                                *(["--steps", "300"] if args.quick else [])])
    if args.scale_case:
        if args.threads:
            torch.set_num_threads(args.threads)
        kind, n = args.scale_case.split(":")
        print(json.dumps(_jsonable(scale_case(kind, int(n)))))
        return 0
    args.scale_cap_s = args.scale_cap_s if args.scale_cap_s is not None else (60.0 if args.quick else 420.0)
    args.reps = args.reps if args.reps is not None else (5 if args.quick else 40)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.mem_reps = args.mem_reps if args.mem_reps is not None else (1 if args.quick else 3)
    args.min_reps = args.min_reps if args.min_reps is not None else (3 if args.quick else 5)
    args.budget_s = args.budget_s if args.budget_s is not None else (35.0 if args.quick else 220.0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and (torch.get_num_threads() != 1 or args.device != "cpu"):
        ap.error("--clock thread needs --threads 1 on the CPU (other threads' work would not be counted)")
    t_start = time.perf_counter()
    rss_floor = _status_kib("VmRSS") / 1024 if os.path.exists("/proc/self/status") else 0.0

    wl_names = [s for s in args.workloads.split(",") if s]
    if args.profile:
        WORKLOAD_DTYPE[:] = _workload_dtype(args.device)
        profile_variant(models.WORKLOADS[wl_names[0]](device=args.device, dtype=getattr(torch, WORKLOAD_DTYPE[0])),
                        args.profile, args.profile_steps, args.profile_top)
        return 0

    names = list(VARIANTS) if args.variants is None else ["plain"] + [v for v in args.variants.split(",") if v and v != "plain"]
    skipped: dict[str, str] = {}
    if DebugUnderflowOverflow is None and "hf-debug" in names:
        names.remove("hf-debug")
        skipped["hf-debug"] = "transformers is not installed"
    if _scope_param() is None and "nanhunt-op-scoped" in names:
        names.remove("nanhunt-op-scoped")
        skipped["nanhunt-op-scoped"] = f"nanhunt.trace takes none of {_SCOPE_PARAMS} (no op pass restricted to a module yet)"
    for n in names:
        if n not in VARIANTS:
            ap.error(f"unknown variant {n!r}; choose from {', '.join(VARIANTS)}")

    res: dict[str, Any] = {"machine": machine_info(args.device), "args": vars(args), "skipped": skipped,
                           "targets": TARGETS, "workloads": []}
    # Fixed-cost sections first; the repetitions then get the budget (--budget-s counts from their start).
    if not args.no_replay:
        if args.device != "cpu":
            res["scale"] = None
            skipped["replay at scale"] = "CPU only (it measures RSS); run it without --device"
        else:
            res["scale"] = bench_scale(args, t_start, rss_floor)
    WORKLOAD_DTYPE[:] = _workload_dtype(args.device)
    if args.only == "replay":
        wl_names = []
    elif not args.quick and not args.no_cold and not args.device.startswith("cuda"):
        print(f"[{time.perf_counter() - t_start:6.1f}s] first use (subprocess)", file=sys.stderr, flush=True)
        res["cold"] = bench_cold(args.device)
    t_budget = time.perf_counter()
    for i, wn in enumerate(wl_names):
        now = time.perf_counter() - t_budget
        share = (args.budget_s - now) / (len(wl_names) - i)
        deadline = time.perf_counter() + max(share, 0.0)
        w = models.WORKLOADS[wn](device=args.device, dtype=getattr(torch, WORKLOAD_DTYPE[0]))
        w.desc += WORKLOAD_DTYPE[1]
        print(f"[{time.perf_counter() - t_start:6.1f}s] {wn}: {', '.join(names)}", file=sys.stderr, flush=True)
        hard = deadline + 0.25 * max(share, 0.0)
        res["workloads"].append(bench_workload(w, names, args, deadline, rss_floor, hard))
        del w
        gc.collect()
    res["total_s"] = time.perf_counter() - t_start
    print_table(res)
    print(f"\ntotal {res['total_s']:.0f} s; results in {args.json}")
    with open(args.json, "w") as f:
        json.dump(_jsonable(res), f, indent=1, default=str, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
