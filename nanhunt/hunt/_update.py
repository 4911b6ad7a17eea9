"""What the optimizer was doing before the step: its hyper-parameters and the size of the update it last made.

A NaN that float32 does not fix is often no precision bug at all but a learning rate far too high: the weights
grow by orders of magnitude in a few steps until the forward overflows in any format. A replay holds the
optimizer's state as the captured step began, which is the state right after the last update, and for two
families that state says exactly how large that update was:

- ``Adam`` / ``AdamW``: the update of step ``t`` is ``lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)``
  with ``m``, ``v`` (``max_exp_avg_sq`` under amsgrad) and ``t`` the state's ``exp_avg``, ``exp_avg_sq`` and
  ``step`` after it: the very tensors the update read. AdamW's decoupled weight decay is left out (it shrinks
  the weights by ``lr * weight_decay`` of themselves, said beside the number).
- ``SGD`` with momentum and without Nesterov: the update is ``lr * momentum_buffer``.

Each parameter's ratio is ``||update|| / ||weight||``, the weight as that update found it (the weight now plus
the update, which the update subtracted: a weight now made of little but the update would give 1); the norms are computed on
the parameters' device and read back once. Other optimizers' last update cannot be told from their state: the
hyper-parameters are reported alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..records import LastUpdate, OptimizerSettings

__all__ = ["optimizer_settings", "last_update"]

_HYPER = ("lr", "weight_decay", "momentum", "betas", "eps", "dampening", "nesterov", "amsgrad")


def _plain(v: Any) -> Any:
    """A hyper-parameter as plain data (a tensor lr as its float); None for what is not a number or a pair."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.detach().cpu())
    if isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(float(v))):
        return v
    if isinstance(v, (tuple, list)) and len(v) <= 4 and all(_plain(x) is not None for x in v):
        return [_plain(x) for x in v]
    return None


def optimizer_settings(optimizer: torch.optim.Optimizer | None) -> OptimizerSettings | None:
    """The first parameter group's hyper-parameters (``lr``, ``weight_decay``, ``momentum``, ``betas``, ``eps``...)
    and how many groups there are; a value the groups disagree on is given as the list of each group's."""
    if optimizer is None or not optimizer.param_groups:
        return None
    groups = optimizer.param_groups
    settings: OptimizerSettings = {"optimizer": type(optimizer).__name__, "groups": len(groups)}
    hyper: dict[str, Any] = {}
    for key in _HYPER:
        values = [_plain(g.get(key)) for g in groups if key in g]
        if not values or any(v is None for v in values):
            continue
        hyper[key] = values[0] if all(v == values[0] for v in values) else values
    settings["hyper"] = hyper
    return settings


def _kind(optimizer: torch.optim.Optimizer) -> str | None:
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return None


def _updates(optimizer: torch.optim.Optimizer, kind: str) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(parameter, the update it last took, its state's step) for each parameter whose state tells it."""
    for g in optimizer.param_groups:
        lr = _plain(g.get("lr"))
        if not isinstance(lr, (int, float)) or isinstance(lr, bool):
            continue
        for p in g["params"]:
            st = optimizer.state.get(p)
            if not st or type(p.data) is not torch.Tensor:  # a tensor subclass: measured by what it stands for elsewhere
                continue
            if kind == "adam":
                m, v, t = st.get("exp_avg"), st.get("max_exp_avg_sq") if g.get("amsgrad") else st.get("exp_avg_sq"), \
                    st.get("step")
                betas, eps = g.get("betas"), g.get("eps")
                if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and t is not None
                        and isinstance(betas, (tuple, list)) and isinstance(eps, (int, float))):
                    continue
                n = int(float(t)) if not isinstance(t, torch.Tensor) else int(t.item())
                b1, b2 = (float(b) for b in betas)
                if n < 1:
                    continue
                bc1, bc2 = 1 - b1 ** n, 1 - b2 ** n
                denom = (v.detach().float() / bc2).sqrt_().add_(float(eps))
                yield p, m.detach().float() / denom * (lr / bc1), n
            else:
                buf = st.get("momentum_buffer")
                if isinstance(buf, torch.Tensor) and not g.get("nesterov"):
                    yield p, buf.detach().float() * lr, -1


def last_update(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> LastUpdate | None:
    """The ratio ``||update|| / ||weight||`` of the optimizer's last update, its largest over the parameters
    (with the parameter's name) and its median; None where the optimizer's state does not tell it."""
    kind = _kind(optimizer) if optimizer is not None else None
    if optimizer is None or kind is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    # per parameter, the two norms in float64 on its device (no update kept beyond its own), read back once per device
    rows: list[tuple[str, int, torch.device]] = []
    on: dict[torch.device, list[torch.Tensor]] = {}
    for p, u, n in _updates(optimizer, kind):
        rows.append((names.get(id(p), "(a parameter outside the model)"), n, u.device))
        # the weight the update was applied to: p = before - u, so before = p + u (AdamW's decay left out)
        on.setdefault(u.device, []).append(torch.stack([torch.linalg.vector_norm(u, dtype=torch.float64),
                                                        torch.linalg.vector_norm(p.detach() + u, dtype=torch.float64)]))
    if not rows:
        return None
    read = {d: iter(torch.stack(ts).tolist()) for d, ts in on.items()}
    pairs = [next(read[d]) for _, _, d in rows]
    # a non-finite moment (the state already broken) counts as an infinite ratio: JSON holds no NaN
    ratios = [math.inf if not math.isfinite(u) else u / w if w > 0 else math.inf if u > 0 else 0.0 for u, w in pairs]
    top = max(range(len(ratios)), key=lambda i: ratios[i])
    ordered = sorted(ratios)
    step = rows[top][1]
    how = (f"Adam's moments after its step {step}" if kind == "adam" else "SGD's momentum buffer")
    if isinstance(optimizer, torch.optim.AdamW):
        how += " (decoupled weight decay left out)"
    return {"ratio": ratios[top], "at": rows[top][0],
            "median": ordered[len(ordered) // 2], "params": len(ratios), "how": how}
