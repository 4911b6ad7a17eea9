"""``nanhunt inspect``: a checkpoint's weights, optimizer moments and scaler state, without running it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ._errors import CommandError
from .capture import load_file
from .records import Inspection, TensorSummary

__all__ = ["inspect_checkpoint"]

NEAR_OVERFLOW = 65504.0 / 16  # flag weights within 16x of the float16 max


def _summary(name: str, t: torch.Tensor) -> TensorSummary:
    x = t.detach()
    if x.numel() == 0:
        return TensorSummary(name, str(x.dtype).replace("torch.", ""), tuple(x.shape), 0, 0, 0.0)
    x = x.double()
    finite = torch.isfinite(x)
    nums = torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()]).tolist()
    absmax = float(torch.where(finite, x.abs(), torch.zeros_like(x)).max())
    return TensorSummary(name, str(t.dtype).replace("torch.", ""), tuple(t.shape), int(nums[0]), int(nums[1]), absmax)


def _walk(prefix: str, obj: Any, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield prefix, obj
    elif isinstance(obj, nn.Module):
        yield from _walk(prefix, obj.state_dict(), depth)
    elif depth < 8 and isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(f"{prefix}.{k}" if prefix else str(k), v, depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(f"{prefix}[{i}]", v, depth + 1)


def inspect_checkpoint(path: str, *, trust_pickle: bool = False) -> Inspection:
    ck = load_file(path, what="checkpoint", trust_pickle=trust_pickle)
    if isinstance(ck, Mapping) and "nanhunt_batch" in ck:
        raise CommandError(f"{path!r} is a nanhunt batch file, not a checkpoint; inspect the checkpoint.pt beside it")
    flagged: list[TensorSummary] = []
    n = 0
    scaler: dict[str, Any] = {}
    if isinstance(ck, Mapping):
        s = ck.get("scaler")
        if isinstance(s, Mapping):
            scaler = {k: s[k] for k in ("scale", "_growth_tracker", "growth_interval") if k in s}
    for name, t in _walk("", ck):
        n += 1
        s = _summary(name, t)
        if s.nan or s.inf or s.absmax > NEAR_OVERFLOW:
            flagged.append(s)
    flagged.sort(key=lambda s: (-(s.nan + s.inf), -s.absmax))
    return Inspection(path=path, n_tensors=n, flagged=tuple(flagged), scaler=scaler)
