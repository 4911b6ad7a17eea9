"""Speed and peak memory of the step, measured after the numbers."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..records import Speed
from ..step._run import _backward, _call_model, _loss_of
from ..step.step import Step


# ------------------------------------------------------------------ speed, after the numbers


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


_CLEAR_REFS = "/proc/self/clear_refs"
_trim: Any = None  # glibc's malloc_trim; False where there is none


def _status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_hwm() -> None:
    """Linux: "5" in clear_refs resets the peak resident set (VmHWM) to the current resident set."""
    with open(_CLEAR_REFS, "w", encoding="ascii") as f:
        f.write("5")


def _quiesce() -> None:
    """Free what can be freed before a peak is measured: garbage, and the allocator's free pages (glibc)."""
    global _trim
    gc.collect()
    if _trim is None:
        try:
            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


def _peak_meter(device_type: str) -> tuple[Callable[[Callable[[], None]], int] | None, str]:
    """A function measuring the peak memory one call adds, and how it measures (or why there is none).

    CUDA: the bytes allocated above the level before the call. CPU: the growth of the process's peak resident
    set (Linux VmHWM, reset through /proc/self/clear_refs) above its resident size before the call, after a
    garbage collection and malloc_trim: what the step costs in RAM, allocator slack included. tracemalloc
    would not see tensors (torch allocates outside Python's allocator)."""
    if device_type == "cuda":
        def cuda(run: Callable[[], None]) -> int:
            _quiesce()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            return max(0, int(torch.cuda.max_memory_allocated()) - base)

        return cuda, "cuda max_memory_allocated above the level before each batch"
    if device_type != "cpu":
        return None, f"not measured: nanhunt has no peak memory counter for device type {device_type!r}"
    try:
        _reset_hwm()
        _status_bytes("VmHWM")
    except (OSError, KeyError, ValueError):
        return None, (f"not measured: the peak resident set cannot be reset here ({_CLEAR_REFS} is not writable: "
                      "not Linux, or not allowed)")

    def cpu(run: Callable[[], None]) -> int:
        _quiesce()
        _reset_hwm()
        base = _status_bytes("VmRSS")
        run()
        return max(0, _status_bytes("VmHWM") - base)

    return cpu, "peak RSS growth (Linux VmHWM) above the resident size before each batch"


def _speed(step: Step, batches: Sequence[tuple[str, Any, Any, tuple[Any, Any]]], dt: torch.dtype | None, *,
           repeats: int, train: bool,
           runs: Callable[[bool], AbstractContextManager[None]] = lambda amp: contextlib.nullcontext()) -> Speed:
    """The plain step over the set, float32 and autocast interleaved (alternating which goes first), with no
    hook of nanhunt's installed: the median time per pass over the set, the median and quartiles of the
    autocast / float32 ratio per repetition; then one untimed pass of each to measure its peak memory (the
    largest batch's), so the measuring never slows a timed pass. ``dt`` None: the candidate runs with autocast
    off; ``runs(amp)`` is entered around each run of the candidate (True) or of float32 (False): a float8
    model's layers as each runs them."""
    model, device_type, loss_fn = step.model, step.device_type, step.loss_fn

    def plain(ins: Any, tgts: Any, amp: bool) -> None:
        with contextlib.ExitStack() as stack:
            if not train:
                stack.enter_context(torch.no_grad())
            stack.enter_context(runs(amp))
            with torch.autocast(device_type, dtype=dt or torch.float32, enabled=amp and dt is not None):
                loss = _loss_of(_call_model(model, ins), tgts, loss_fn)
            if train and loss.requires_grad:
                _backward(loss)

    def one_pass(amp: bool) -> float:
        total = 0.0
        for _, inputs, targets, ref_batch in batches:
            ins, tgts = (inputs, targets) if amp else ref_batch
            step.reset()
            _sync(device_type)
            t0 = time.perf_counter()
            plain(ins, tgts, amp)
            _sync(device_type)
            total += time.perf_counter() - t0
        return total

    one_pass(False)  # warm-up: first calls allocate, pick kernels, fill caches
    one_pass(True)
    ref_t: list[float] = []
    amp_t: list[float] = []
    for r in range(repeats):
        for amp in ((False, True) if r % 2 == 0 else (True, False)):
            (amp_t if amp else ref_t).append(one_pass(amp))
    meter, how = _peak_meter(device_type)
    peaks: dict[bool, int | None] = {False: None, True: None}
    if meter is not None:
        for amp in (False, True):
            for _, inputs, targets, ref_batch in batches:
                ins, tgts = (inputs, targets) if amp else ref_batch
                step.reset()
                used = meter(functools.partial(plain, ins, tgts, amp))
                peaks[amp] = max(peaks[amp] or 0, used)
    ratios = [a / r if r > 0 else math.inf for a, r in zip(amp_t, ref_t)]
    q1, q3 = (statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratios[0], ratios[0]))
    return Speed(mode="train" if train else "eval", repeats=repeats, ref_median_s=statistics.median(ref_t),
                 amp_median_s=statistics.median(amp_t), ratio_median=statistics.median(ratios), ratio_q1=q1,
                 ratio_q3=q3, ref_peak_bytes=peaks[False], amp_peak_bytes=peaks[True], peak_memory=how)
