"""The headroom history's reductions on a sampled step, cheap: each output's and gradient's extremes in one pass,
kept as one small stack per step, and made the window's largest magnitudes together when the window is read.

On the CPU the inf-norm (``vector_norm(t, inf)``) of a small tensor costs some 25 us where ``aminmax`` costs 3 us,
and each op after a step's work has left the caches cold some 10 us more: on a model of small layers a sampled
step paid a third of a step in per-tensor norms and per-step ops. Both reductions are one pass on any device; the
magnitude (the larger of -min and max), the conversion to float32 and the write into the window's buffer are done
once per window, over every sampled step's extremes at once.
"""

from __future__ import annotations

import math

import torch

__all__ = ["extremes", "Samples"]

_MINMAX = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})  # aminmax's dtypes everywhere

_Group = tuple[torch.device, torch.dtype]


def extremes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s (min, max) on its device, no host read (NaN propagates). A dtype ``aminmax`` lacks: its inf-norm in
    float32, as both."""
    if t.dtype in _MINMAX:
        low, high = torch.aminmax(t)
        return low, high
    norm = torch.linalg.vector_norm(t, math.inf, dtype=torch.float32)
    return norm, norm


class Samples:
    """The sampled steps' extremes not yet in the window's buffer: per step, one stack per (device, dtype) of its
    (min, max) pairs and the buffer column of each pair."""

    def __init__(self) -> None:
        self._steps: list[list[tuple[torch.Tensor, tuple[int, ...]]]] = []
        self._index: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last fill's flat positions

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, pairs: list[torch.Tensor], columns: list[int]) -> None:
        """One sampled step: ``pairs`` holds (min0, max0, min1, max1, ...), the extremes of the tensor written to
        column ``columns[k]``."""
        groups: dict[_Group, list[int]] = {}
        for k in range(len(columns)):
            v = pairs[2 * k]
            groups.setdefault((v.device, v.dtype), []).append(k)
        self._steps.append([(torch.stack([pairs[2 * k + h] for k in ks for h in (0, 1)]),
                             tuple(columns[k] for k in ks)) for ks in groups.values()])

    def fill(self, buf: torch.Tensor, start: int) -> None:
        """Write the steps added since the last fill into ``buf``'s rows ``start``, ``start + 1``, ...: each
        tensor's largest magnitude in float32 (past float32's range: inf, as a float32 inf-norm read it; NaN stays
        NaN), a module's largest over its calls, 0 where it had none. Then none is pending."""
        if not self._steps:
            return
        dev, width = buf.device, buf.shape[1]
        by: dict[_Group, tuple[list[torch.Tensor], list[int]]] = {}
        for r, groups in enumerate(self._steps):
            for stacked, columns in groups:
                ts, at = by.setdefault((stacked.device, stacked.dtype), ([], []))
                ts.append(stacked)
                at.extend((start + r) * width + c for c in columns)
        parts: list[torch.Tensor] = []
        flat: list[int] = []
        for ts, at in by.values():
            parts.append((ts[0] if len(ts) == 1 else torch.cat(ts)).to(dev, torch.float32))
            flat += at
        found = (parts[0] if len(parts) == 1 else torch.cat(parts)).abs().view(-1, 2).amax(1)
        key = tuple(flat)
        if self._index is None or self._index[0] != key or self._index[1].device != dev:
            # a host-to-device copy (pageable memory: it may wait for the device), so made once for the pattern of
            # calls, which is the same window after window
            self._index = (key, torch.tensor(key, device=dev))
        buf[start:start + len(self._steps)].zero_()
        # a module called twice has two entries: the max over its calls (magnitudes are >= 0)
        buf.view(-1).scatter_reduce_(0, self._index[1], found, "amax")
        self._steps = []
