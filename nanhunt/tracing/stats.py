"""On-device tensor statistics with one batched read-back.

The cheap statistic is one ``torch.aminmax`` per tensor: min and max propagate
NaN, and an Inf shows up in one of them, so it gives the finite flag, the range
and the largest magnitude in a single pass. Results stay on the device until
:meth:`PendingStats.read` stacks them per (device, dtype) and reads each group
back once, the way GradScaler reads its found-inf flag once per step.

Autocast never touches them: ``aminmax`` is on none of its lists, and the stacking
(``stack``/``cat`` are on its "promote" list, which refuses float16 under a bfloat16
autocast and bfloat16 under a float16 one) runs with autocast off. Complex tensors
are measured on their real view (a NaN/Inf in either part shows), float8 in float32. A tensor subclass
(a DTensor, a float8 or NF4 tensor) is measured on the plain values it stands for (``_subclass``), or not at
all when they cannot be read: its slot is in :attr:`PendingStats.unmeasured`.
"""

from __future__ import annotations

import math

import torch

from .._util._dispatch import no_autocast, plain_values
from ..records import FullStats

__all__ = ["PendingStats", "full_stats", "FP16_MAX", "BF16_MAX", "dtype_max", "dtype_tiny"]

FP16_MAX = float(torch.finfo(torch.float16).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def dtype_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def dtype_tiny(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


_DTYPES = [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
_COMPLEX = frozenset(d for d in _DTYPES if d.is_complex)
_TENSOR = torch.Tensor
_BYTE_FLOATS = frozenset(d for d in _DTYPES if d.is_floating_point and d.itemsize == 1)


class PendingStats:
    """Collects ``aminmax`` results on the device; reads them back in bulk."""

    # Live 0-d results fragment the allocator: hundreds of them kept through a step raised the CPU
    # peak by 13-50 MiB (a small convnet, a small GPT). Every CHUNK results of a group are stacked
    # into one tensor, still on the device (32: no measurable extra peak; 128 still showed +20 MiB).
    CHUNK = 32

    def __init__(self) -> None:
        # (device, dtype) -> [slots, pending mins, pending maxs, stacked (2, n) chunks]
        self._groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor], list[torch.Tensor],
                                                                   list[torch.Tensor]]] = {}
        self.values: dict[int, tuple[float, float]] = {}

    def add(self, slot: int, t: torch.Tensor) -> bool:
        """Queue the statistics of ``t`` under ``slot``; no host synchronisation. A DTensor is
        measured on this rank's shard (no collective). False: ``t``'s values cannot be read (a
        tensor subclass that offers no way to them); the slot reads (0, 0), judged finite."""
        x = t
        if x.__class__ is not _TENSOR:  # a subclass (a Parameter, a DTensor, a float8 tensor)
            got = plain_values(x)
            if got is None:
                self.values[slot] = (0.0, 0.0)
                return False
            x = got
        # The stats must never join an autograd graph (inside the dispatch mode tensors are
        # below autograd already; detach costs ~20 us, so only when needed).
        if x.requires_grad:
            x = x.detach()
        if not x.numel():
            self.values[slot] = (0.0, 0.0)
            return True
        dtype = x.dtype
        if dtype in _COMPLEX:  # NaN/Inf in either part: the real view holds both
            x = torch.view_as_real(x)
        elif dtype in _BYTE_FLOATS:  # float8 formats: no aminmax kernel; exact in float32
            x = x.float()
        lo, hi = torch.aminmax(x)
        key = (x.device, dtype)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = ([], [], [], [])
        group[0].append(slot)
        mins, maxs = group[1], group[2]
        mins.append(lo)
        maxs.append(hi)
        if len(mins) >= self.CHUNK:
            with no_autocast():  # once per CHUNK results, not per tensor
                group[3].append(torch.stack([torch.stack(mins), torch.stack(maxs)]))
            mins.clear()
            maxs.clear()
        return True

    def __len__(self) -> int:
        return sum(len(g[0]) for g in self._groups.values())

    def read(self) -> dict[int, tuple[float, float]]:
        """Read every queued statistic back to the host: one copy per group."""
        with no_autocast():
            for slots, mins, maxs, chunks in self._groups.values():
                parts = list(chunks)
                if mins:
                    parts.append(torch.stack([torch.stack(mins), torch.stack(maxs)]))
                both = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                # float64 holds every float16/bfloat16/float32 value exactly.
                host = both.to(device="cpu", dtype=torch.float64).tolist()
                for slot, lo, hi in zip(slots, host[0], host[1]):
                    self.values[slot] = (lo, hi)
        self._groups.clear()
        return self.values


def full_stats(t: torch.Tensor) -> FullStats | None:
    """All counts for one tensor (a DTensor: this rank's shard; a subclass: the values it stands for; None
    when they cannot be read). About 100x the cost of ``aminmax``: use sparingly."""
    x = plain_values(t)
    if x is None:
        return None
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    n = x.numel()
    if n == 0:
        return FullStats(0, 0, 0, 0, 0, None, 0, 0, 0)
    x = x.reshape(-1)
    xf = x.double() if x.dtype != torch.float64 else x
    nan = torch.isnan(xf)
    posinf = torch.isposinf(xf)
    neginf = torch.isneginf(xf)
    finite = torch.isfinite(xf)
    a = xf.abs()
    zero = xf == 0
    nonzero_finite = finite & ~zero
    tiny = dtype_tiny(x.dtype) if x.dtype.is_floating_point else 0.0
    big = torch.tensor(math.inf, dtype=torch.float64, device=xf.device)
    counts = torch.stack(
        [
            nan.sum(),
            posinf.sum(),
            neginf.sum(),
            zero.sum(),
            (finite & (a > FP16_MAX)).sum(),
            (finite & (a > BF16_MAX)).sum(),
            (nonzero_finite & (a < tiny)).sum(),
        ]
    ).tolist()
    mn = torch.where(nonzero_finite, a, big).min().item()
    return FullStats(
        nan=int(counts[0]),
        posinf=int(counts[1]),
        neginf=int(counts[2]),
        zeros=int(counts[3]),
        numel=n,
        min_nonzero_abs=None if math.isinf(mn) else float(mn),
        over_fp16=int(counts[4]),
        over_bf16=int(counts[5]),
        subnormal=int(counts[6]),
    )
