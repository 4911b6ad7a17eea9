"""The Guard's detection: each check an on-device flag, every rank's flags in one host read (one all_reduce)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._util import _dispatch
from .._util._dispatch import local_tensor
from .._util._wrappers import user_modules

__all__ = ["LOSS", "GRADS", "PARAMS", "SKIP", "Detector", "nonfinite", "nonfinite_weights", "any_set", "scalars",
           "seen", "free_read", "scaler_entry"]

# The four flags of one check, in this order, as bits of a rank's answer. On the device each flag is a
# float scalar that is 0 when fine and non-zero (1 or NaN) otherwise, so one all_reduce(SUM) of a
# (world, 4) matrix tells every rank what every rank saw.
LOSS, GRADS, PARAMS, SKIP = 1, 2, 4, 8
_N_FLAGS = 4
_EXACT = (torch.float16, torch.bfloat16, torch.float32)  # a loss of these reads into a float32 as it is


class Detector:
    """Flags for the loss, the gradients and the parameters an optimizer updates, and the read that turns them
    into every rank's bits. ``rank`` is None outside ``torch.distributed``; ``world`` is 1 there."""

    def __init__(self, optimizer: torch.optim.Optimizer, process_group: Any = None) -> None:
        # What an update can change: the optimizer's parameters (frozen weights are never written).
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._params_by_device = _by_device(self.params)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._zero = torch.zeros((), device=self.device)
        self._pg = process_group
        self.rank: int | None = None
        self.world = 1
        self._comm_device = torch.device("cpu")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            import torch.distributed as dist

            self.rank = dist.get_rank(process_group)
            self.world = dist.get_world_size(process_group)
            if self.device.type == "cuda" and "nccl" in str(dist.get_backend(process_group)):
                self._comm_device = self.device

    def loss_flag(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        if loss is None:
            return None
        # 0 * x is 0 for finite x and NaN for NaN/Inf: one op, no overflow on large finite losses.
        zeroed = loss * 0
        return zeroed if zeroed.dim() == 0 else zeroed.sum(dtype=torch.float32)

    def grads_flag(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> torch.Tensor:
        """With a GradScaler, its ``found_inf`` (unscaling first if the loop did not); else one fused check."""
        if scaler is not None:
            found = scaler._found_inf_per_device(optimizer)
            if not found:
                scaler.unscale_(optimizer)
                found = scaler._found_inf_per_device(optimizer)
            infs = list(found.values())
            return infs[0] if len(infs) == 1 else torch.stack([t.to(self.device) for t in infs]).sum()
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return nonfinite(grads, self.device)

    def params_flag(self) -> torch.Tensor:
        """The parameters the optimizer updates."""
        return nonfinite(self.params, self.device, self._params_by_device)

    def weights_flag(self, module: nn.Module) -> torch.Tensor:
        """The model's parameters, and any other parameter the optimizer updates."""
        weights = list(module.parameters())
        ids = {id(p) for p in weights}
        return nonfinite(weights + [p for p in self.params if id(p) not in ids], self.device)

    def read(self, flags: list[torch.Tensor | None], extra: list[torch.Tensor],
             loss: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        """Every rank's flag bits and this rank's extra scalars, in one host read (and one all_reduce); scalars
        whose read waits for nothing (:func:`free_read`) are read one by one instead.

        ``loss``: the step's loss, for its bit (LOSS): read as it is where its value alone tells (one process, one
        value, a dtype a float32 read holds exactly: it is non-finite exactly when it reads so), else its flag."""
        given = len(extra)
        at: int | None = None  # where the loss's own value is among the values read
        if loss is not None:
            loss = local_tensor(loss)
            if self.world == 1 and loss.numel() == 1 and loss.dtype in _EXACT:
                at = next((k for k, t in enumerate(extra) if t is loss), given)  # there already (scalars)
                extra = extra if at < given else [*extra, loss]
            else:
                flags = [self.loss_flag(loss), *flags[1:]]
        world = self.world
        if world == 1 and all(f is None or free_read(f) for f in flags) and all(map(free_read, extra)):
            values: list[Any] = [0 if f is None else f.item() for f in flags] + [t.item() for t in extra]
        else:
            parts = [self._zero if f is None else f for f in flags] + extra
            dev, f32 = self.device, torch.float32
            # Convert only what needs it: each tensor op costs microseconds, attribute checks don't.
            vec = torch.stack([t if t.dtype is f32 and t.device == dev and t.dim() == 0
                               else t.reshape(()).to(dev, f32) for t in parts])
            if world > 1:
                import torch.distributed as dist

                mat = torch.zeros((world, _N_FLAGS), device=self._comm_device)
                mat[self.rank or 0] = vec[:_N_FLAGS].to(self._comm_device)
                dist.all_reduce(mat, group=self._pg)
                values = torch.cat([mat.reshape(-1), vec[_N_FLAGS:].to(self._comm_device)]).tolist()
            else:
                values = vec.tolist()
        n = world * _N_FLAGS
        # NaN != 0 is True: a NaN flag (a NaN that reached the reduction) counts as set.
        per_rank = [sum(1 << i for i in range(_N_FLAGS) if values[r * _N_FLAGS + i] != 0) for r in range(world)]
        out = [float(v) for v in values[n:]]
        if at is not None and not math.isfinite(out[at]):
            per_rank[0] |= LOSS
        return per_rank, out[:given]

    def own(self, per_rank: list[int]) -> int:
        """This rank's bits."""
        return per_rank[self.rank or 0]


def free_read(t: torch.Tensor) -> bool:
    """Reading ``t``'s value waits for nothing: it is on the CPU. Such scalars are read one by one (``item()``, a
    microsecond), which costs less than the ops that gather them into one tensor (a stack, a dtype conversion, a
    copy: some 10 us each after a step's work has left the caches cold); a device's are gathered into one read,
    since each read waits for the device to finish."""
    return t.is_cpu


def scaler_entry(scaler: torch.amp.GradScaler) -> tuple[torch.Tensor | float | None, torch.Tensor | int | None]:
    """The GradScaler's scale and growth tracker as a step begins (None: not made yet): their numbers where a read
    waits for nothing (:func:`free_read`), else copies on their device."""
    scale, tracker = scaler._scale, scaler._growth_tracker
    if scale is None or tracker is None:
        return None, None
    if free_read(scale) and free_read(tracker):
        return scale.item(), int(tracker.item())
    return scale.detach().clone(), tracker.detach().clone()


def any_set(per_rank: list[int]) -> int:
    """The bits any rank set."""
    out = 0
    for b in per_rank:
        out |= b
    return out


def seen(per_rank: list[int], mask: int) -> tuple[int, ...]:
    """The ranks that set a bit of ``mask``."""
    return tuple(r for r, b in enumerate(per_rank) if b & mask)


def nonfinite(tensors: list[torch.Tensor], device: torch.device,
              groups: dict[torch.device, list[torch.Tensor]] | None = None) -> torch.Tensor:
    """A float scalar on ``device``: 0 when every tensor is finite, non-zero otherwise; a fused check
    per device, no host read. On CUDA the max-norm (read-only, one multi-tensor kernel; unlike the
    2-norm it cannot overflow on large finite values, and it propagates NaN). On the CPU,
    ``_foreach_norm`` runs one op per tensor, so use GradScaler's fused check with an inverse scale
    of 1, which leaves every value as it was."""
    flags: list[torch.Tensor] = []
    with torch.no_grad():  # no per-tensor detach(): at this size the Python per tensor is the cost
        for dev, ts in (groups if groups is not None else _by_device(tensors)).items():
            if dev.type == "cpu":
                found = torch.zeros((), device=dev)
                _dispatch.amp_check_and_unscale(ts, found, _one(dev))
            else:
                found = torch.stack(_dispatch.foreach_norm(ts, math.inf, dtype=torch.float32)).amax() * 0
            flags.append(found if dev == device else found.to(device))
    if not flags:
        return torch.zeros((), device=device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum()


def scalars(extra: list[torch.Tensor], loss: torch.Tensor | None, grad_norm: torch.Tensor | float | None
             ) -> Callable[[list[float]], tuple[float | None, float | None]]:
    """Append the loss and the gradient norm (one-element tensors) to ``extra``, the scalars of a read; returns
    how to find them among the values read after ``extra``'s own."""
    start = len(extra)

    def slot(x: torch.Tensor | None) -> int | None:
        if x is None or x.numel() != 1:
            return None
        extra.append(local_tensor(x.detach() if x.requires_grad else x))  # the loss itself: read() finds it there
        return len(extra) - 1 - start

    at_loss = slot(loss)
    at_norm = slot(grad_norm) if isinstance(grad_norm, torch.Tensor) else None
    fixed = float(grad_norm) if isinstance(grad_norm, (int, float)) else None

    def found(tail: list[float]) -> tuple[float | None, float | None]:
        return (None if at_loss is None else tail[at_loss], fixed if at_norm is None else tail[at_norm])

    return found


def nonfinite_weights(model: nn.Module, params: list[torch.Tensor]) -> str | None:
    """``fc1.weight holds 3 NaN and 1 Inf (of 2048), and 2 other parameters hold NaN/Inf``: the first non-finite
    parameter of this rank (its shard, under FSDP), by the model's names, and how many others; None: none here.
    The failure path only: one host read per parameter."""
    names = {id(p): f"{name}.{pn}" if name else pn
             for name, mod in user_modules(model).items() for pn, p in mod.named_parameters(recurse=False)}
    found: list[tuple[torch.Tensor, int, int]] = []
    done: set[int] = set()
    for p in [*model.parameters(), *params]:
        if id(p) in done or not p.is_floating_point():
            continue
        done.add(id(p))
        t = local_tensor(p.detach())
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            found.append((p, nan, inf))
    if not found:
        return None
    p, nan, inf = found[0]
    counts = " and ".join(f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "Inf")) if n)
    name = names.get(id(p), "a parameter the optimizer updates outside the model")
    more = len(found) - 1
    others = f", and {more} other parameter{'s hold' if more != 1 else ' holds'} NaN/Inf" if more else ""
    return f"{name} holds {counts} (of {local_tensor(p.detach()).numel()}){others}"


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    first = tensors[0].device if tensors else None
    if all(t.device == first and not t.is_sparse for t in tensors):
        return {first: tensors} if first is not None else {}
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t.coalesce()._values() if t.is_sparse else t)
    return out


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), device=device)
    return one
