"""Ground truth for bisection tests, computed by hand (not by nanhunt's code): is a step finite?"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import nanhunt
from nanhunt.records import Report, Verdict

LOSS = "<loss>"


def step_finite(model: nn.Module, x: Any, y: Any, loss_fn: Callable[..., torch.Tensor], *,
                fp32: Iterable[str] = (), dtype: torch.dtype = torch.float16, scale: float | None = None,
                train: bool | None = None) -> bool:
    """Ground truth, by hand, on a copy: forward + loss under autocast (``fp32`` modules and ``<loss>``
    with autocast off), backward of ``loss * scale`` (as GradScaler multiplies: a float32 tensor);
    True when the loss and every gradient are finite."""
    m = copy.deepcopy(model)
    if train is not None:
        m.train(train)
    fp32 = set(fp32)
    with nanhunt.keep_fp32(m, [n for n in fp32 if n != LOSS]):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = m(x)
            if LOSS in fp32:
                with torch.autocast("cpu", enabled=False):
                    loss = loss_fn(out.float(), y)
            else:
                loss = loss_fn(out, y)
    scaled = loss if scale is None else loss * torch.full((1,), scale, dtype=torch.float32)
    scaled.sum().backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    return bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads)


def verdict_of(rep: Report) -> Verdict:
    assert rep.verdict is not None
    return rep.verdict
