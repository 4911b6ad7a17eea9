"""``nanhunt inspect``: a checkpoint's weights, optimizer moments and scaler state, without running it.

Every floating tensor is measured once, on its own device and in its own precision (float16 and bfloat16 in
float32, which holds their values exactly): NaN and Inf counts, the largest finite and the smallest non-zero
magnitude, how many non-zero values sit below float16's smallest normal, and for an optimizer's second moment
how many sit below its eps squared. A few scalars per tensor come back to the host; inspect is no hot path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from .._util._errors import InputError
from .._util._text import dtype_name, escaped
from .capture import load_file
from ..records import DTYPE_MAX, FP16_SMALLEST_NORMAL, Inspection, TensorSummary

__all__ = ["inspect_checkpoint", "scaler_meaning", "NEAR_OVERFLOW", "FP16_MAX", "FP16_TINY", "SECOND_MOMENTS"]

FP16_MAX = DTYPE_MAX["float16"]
FP16_TINY = FP16_SMALLEST_NORMAL  # (6.1e-05); below it values lose precision, below 2**-24 vanish
FP16_SUBNORMAL = 2.0 ** -24  # float16's smallest subnormal (6.0e-08): anything smaller rounds to 0
NEAR_OVERFLOW = FP16_MAX / 16  # flag weights within 16x of the float16 max
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg")  # Adam / AdamW (amsgrad), RMSprop
_SHOWN = 10  # tensors per list
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_DEFAULT_SCALE = 2.0 ** 16  # GradScaler's init_scale


class _Found(NamedTuple):
    name: str
    tensor: torch.Tensor
    eps: float | None  # a second moment's parameter-group eps
    state: bool  # inside an optimizer's state


def _summary(found: _Found) -> TensorSummary:
    """One tensor's statistics: reductions on its device, one read-back of a few scalars."""
    name, t, eps, _ = found
    dtype = dtype_name(t.dtype)
    x = t.detach()
    if x.numel() == 0:
        return TensorSummary(name, dtype, tuple(x.shape), 0, 0, 0.0, numel=0, eps=eps)
    x = x.reshape(-1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # float16 / bfloat16 / float8 values are exact in float32
    a = x.abs()
    finite = torch.isfinite(x)
    nonzero = finite & (a != 0)
    stats = [torch.isnan(x).sum(), (~finite).sum(), torch.where(finite, a, torch.zeros_like(a)).max(),
             torch.where(nonzero, a, torch.full_like(a, math.inf)).min(), (nonzero & (a < FP16_TINY)).sum()]
    if eps is not None:  # sqrt(v) < eps <=> v < eps**2 (v >= 0): eps, not the moment, sets the update there
        stats.append((finite & (x < eps * eps)).sum())
    got = torch.stack([s.double() for s in stats]).tolist()  # float64 holds the counts and the values exactly
    nan = int(got[0])
    return TensorSummary(
        name, dtype, tuple(t.shape), nan=nan, inf=int(got[1]) - nan, absmax=got[2],
        min_nonzero=None if math.isinf(got[3]) else got[3], below_fp16_normal=int(got[4]), numel=x.numel(),
        eps=eps, below_eps=int(got[5]) if eps is not None else 0,
    )


def _optimizer_eps(d: Mapping[Any, Any]) -> dict[Any, float] | None:
    """``{parameter id: eps}`` of an optimizer's state_dict (``state`` and ``param_groups``); None if it is not one."""
    groups = d.get("param_groups")
    if not isinstance(d.get("state"), Mapping) or not isinstance(groups, (list, tuple)):
        return None
    out: dict[Any, float] = {}
    for g in groups:
        if isinstance(g, Mapping) and isinstance(g.get("eps"), (int, float)) and isinstance(g.get("params"), list):
            out.update({p: float(g["eps"]) for p in g["params"]})
    return out


def _param_names(d: Mapping[Any, Any], group_names: Any) -> dict[Any, str]:
    """``{parameter id: its name}`` of an optimizer's state_dict: from its groups' ``param_names`` (torch keeps
    them for an optimizer given ``named_parameters()``), else from ``group_names``, a nanhunt capture's
    ``optimizer_params`` (each group's names, in order); ids it cannot name are left out."""
    groups = d.get("param_groups")
    out: dict[Any, str] = {}
    if not isinstance(groups, (list, tuple)):
        return out
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping):
            continue
        ids, names = g.get("params"), g.get("param_names")
        if not isinstance(names, (list, tuple)) and isinstance(group_names, (list, tuple)) and i < len(group_names):
            names = group_names[i]
        if isinstance(ids, (list, tuple)) and isinstance(names, (list, tuple)) and len(ids) == len(names):
            out.update((pid, n) for pid, n in zip(ids, names) if isinstance(n, str) and n)
    return out


def _walk(prefix: str, obj: Any, depth: int = 0, *, eps: float | None = None, state: bool = False,
          group_names: Any = None) -> Iterator[_Found]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            moment = prefix.rpartition(".")[2] in SECOND_MOMENTS
            yield _Found(prefix, obj, eps if moment else None, state)
    elif isinstance(obj, nn.Module):
        yield from _walk(prefix, obj.state_dict(), depth)
    elif depth < 8 and isinstance(obj, Mapping):
        epsilons = _optimizer_eps(obj)
        names = _param_names(obj, group_names) if epsilons is not None else {}
        for k, v in obj.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            if epsilons is not None and k == "state":
                for pid, st in v.items():
                    # a parameter's state by its name where the checkpoint has it: the index means nothing to a reader
                    where = f"{name}[{names[pid]}]" if pid in names else f"{name}.{pid}"
                    yield from _walk(where, st, depth + 2, eps=epsilons.get(pid), state=True)
            else:
                # a nanhunt capture names each optimizer group's parameters beside the optimizer's state_dict
                yield from _walk(name, v, depth + 1, eps=eps, state=state or epsilons is not None,
                                 group_names=obj.get("optimizer_params") if k == "optimizer" else None)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(f"{prefix}[{i}]", v, depth + 1, eps=eps, state=state)


def _not_a_checkpoint(path: str, ck: Any) -> str | None:
    """Why ``ck`` is no checkpoint (a batch), or None."""
    if isinstance(ck, Mapping) and "nanhunt_batch" in ck:
        return f"{path!r} is a nanhunt batch file, not a checkpoint; inspect the checkpoint.pt beside it"
    if isinstance(ck, torch.Tensor):
        return (f"{path!r} holds one tensor {list(ck.shape)}, not a checkpoint: it looks like a batch; give the "
                "checkpoint (a state_dict, {'model': ...}, a nanhunt capture or Lightning's .ckpt)")
    if isinstance(ck, (list, tuple)):
        return (f"{path!r} holds a {type(ck).__name__} of {len(ck)} items, not a checkpoint: it looks like a batch "
                "(inputs, targets); give the checkpoint (a state_dict, {'model': ...}, a nanhunt capture or "
                "Lightning's .ckpt)")
    return None


_HYPER = ("lr", "momentum", "betas", "eps", "weight_decay")


def _optimizer_settings(ck: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """One note per optimizer state_dict the checkpoint holds (found within two levels): its groups'
    hyper-parameters as saved, the learning rate first (a learning rate far too high is the commonest NaN that
    no precision fixes)."""
    if not isinstance(ck, Mapping) or depth > 2:
        return []
    groups = ck.get("param_groups")
    if isinstance(ck.get("state"), Mapping) and isinstance(groups, (list, tuple)):
        said: list[str] = []
        for key in _HYPER:
            values = [_plain(g.get(key)) for g in groups if isinstance(g, Mapping) and key in g]
            if values and all(v is not None for v in values):
                shown = values[0] if all(v == values[0] for v in values) else \
                    "per group " + ", ".join(str(v) for v in values)
                said.append(f"{key} {shown}")
        where = f" ({escaped(prefix)})" if prefix and prefix != "optimizer" else ""
        n = len(groups)
        return [f"optimizer{where}: {n} parameter group{'s' if n != 1 else ''}, "
                + (", ".join(said) if said else "no hyper-parameter nanhunt reads")]
    out: list[str] = []
    for k, v in list(ck.items())[:64]:
        out += _optimizer_settings(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    return out


def _plain(v: Any) -> str | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return f"{v:g}"
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        return f"{float(v):g}"
    if isinstance(v, (list, tuple)) and 0 < len(v) <= 4:
        parts = [_plain(x) for x in v]
        return None if any(p is None for p in parts) else "(" + ", ".join(p for p in parts if p) + ")"
    return None


def scaler_meaning(scaler: Mapping[str, Any]) -> list[str]:
    """What a saved GradScaler state means for the next steps, one sentence each.

    A float16 gradient overflows once |gradient| x scale > 65504, so the scale sets the largest unscaled
    gradient the next backward can hold; every ``growth_interval`` steps without inf/NaN gradients multiplies
    it by ``growth_factor``, every skipped step by ``backoff_factor``."""
    s = scaler.get("scale")
    if not isinstance(s, (int, float)) or isinstance(s, bool):
        return []
    if not math.isfinite(s):
        return [f"the scale is {s}: every loss it scales is non-finite and every step is skipped; restore the "
                "scaler from an earlier checkpoint or a fresh GradScaler"]
    if s <= 0:
        return [f"the scale is {s:g}: a scaled loss of 0 has zero gradients; restore the scaler state"]
    out = [f"with this scale a float16 gradient overflows once its unscaled magnitude exceeds {FP16_MAX / s:.4g} "
           f"(65504 / {s:g})"]
    growth, interval, tracker = (scaler.get("growth_factor"), scaler.get("growth_interval"),
                                 scaler.get("_growth_tracker"))
    if isinstance(growth, (int, float)) and isinstance(interval, int) and isinstance(tracker, int) and growth > 1:
        grown = s * growth
        left = max(interval - tracker, 0)
        text = (f"after {left} more step{'s' if left != 1 else ''} without inf/NaN gradients (tracker {tracker} of "
                f"{interval}) the scale grows x{growth:g} to {grown:g}, and that limit drops to {FP16_MAX / grown:.4g}")
        if grown > FP16_MAX:
            text += ("; that scale is above float16's max (65504), so any float16 gradient of magnitude "
                     f"{FP16_MAX / grown:.4g} or more overflows, and GradScaler skips that step and backs off")
        out.append(text)
    if s < 1:
        halvings = math.log2(_DEFAULT_SCALE / s)
        out.append(f"the scale is below 1 ({halvings:.3g} halvings below GradScaler's default start of 65536): "
                   "steps kept producing inf/NaN gradients, and a shrinking scale fixes none of them; "
                   "nanhunt replay names the op")
    return out


def inspect_checkpoint(path: str, *, trust_pickle: bool = False) -> Inspection:
    """Non-finite and near-overflow tensors of a checkpoint; for the rest, those closest to float16's and
    bfloat16's limits, the optimizer's second moments against their eps, and the GradScaler's state."""
    ck = load_file(path, what="checkpoint", trust_pickle=trust_pickle)
    why = _not_a_checkpoint(path, ck)
    if why is not None:
        raise InputError(why)
    scaler: dict[str, Any] = {}
    if isinstance(ck, Mapping):
        s = ck.get("scaler")
        if isinstance(s, Mapping):
            scaler = {k: s[k] for k in _SCALER_KEYS if k in s}
    found = list(_walk("", ck))
    if not found:
        raise InputError(f"{path!r} holds no floating tensor, so no weights: is it a batch? give the checkpoint "
                           "(a state_dict, {'model': ...}, a nanhunt capture or Lightning's .ckpt)")
    summaries = [_summary(f) for f in found]
    flagged = sorted((s for s in summaries if s.nan or s.inf or s.absmax > NEAR_OVERFLOW),
                     key=lambda s: (-(s.nan + s.inf), -s.absmax))
    named = {s.name for s in flagged}
    rest = [(s, f) for s, f in zip(summaries, found) if s.name not in named]
    moments = [s for s, f in rest if f.eps is not None or s.name.rpartition(".")[2] in SECOND_MOMENTS]
    moment_names = {s.name for s in moments}
    # an optimizer's step counter is a count, not a value any autocast op computes with
    others = [s for s, f in rest if s.name not in moment_names and not (f.state and s.name.endswith(".step"))]
    largest = sorted(others, key=lambda s: -s.absmax)[:_SHOWN]
    tiniest = sorted((s for s, f in rest if s.below_fp16_normal and not f.state),
                     key=lambda s: (-s.below_fp16_normal, s.min_nonzero or 0.0))[:_SHOWN]
    notes: list[str] = []
    for eps in sorted({m.eps for m in moments if m.eps is not None and m.dtype == "float16"}):
        if eps < FP16_SUBNORMAL:
            notes.append(f"optimizer eps {eps:g} is below float16's smallest subnormal (6e-08): in this float16 "
                         "state it rounds to 0, and an update divides by sqrt(v) alone; keep the optimizer state "
                         "in float32")
    notes += _optimizer_settings(ck)
    return Inspection(path=path, n_tensors=len(summaries), flagged=tuple(flagged), scaler=scaler, notes=tuple(notes),
                      largest=tuple(largest), tiniest=tuple(tiniest),
                      moments=tuple(sorted(moments, key=lambda s: -s.absmax)[:_SHOWN]),
                      n_elements=sum(s.numel for s in summaries), scaler_meaning=tuple(scaler_meaning(scaler)))
