"""FSDP1 (``FullyShardedDataParallel``) under the Guard: what its capture gathers, and what the Guard refuses.

FSDP1 keeps each unit's parameters as one flat shard per rank (``_flat_param``; with ``use_orig_params=True``, views
of it), so the unwrapped model's own ``state_dict()`` holds shards, not weights, and calling it on a module holding
nested units runs their state-dict hooks (collectives; before the first forward, a lazy initialisation that breaks
the root's). A capture therefore takes FSDP1's full state dict and its unflattened optimizer state, gathered by
every rank together (collectives), and the rank(s) that saw the failure save them as the ordinary per-rank files:
``nanhunt replay`` replays them in one process, as a DDP capture.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .._util._wrappers import wrapped

__all__ = ["top", "refusal", "NO_ROLLBACK", "persistent_buffers", "user_name", "full_state"]

NO_ROLLBACK = ("nanhunt.Guard cannot roll back under FSDP1 (FullyShardedDataParallel): it restores the unwrapped "
               "model's tensors in place, which FSDP1 keeps as flat shards; use on_fail='raise', 'dump' or 'warn'")
NO_SNAPSHOT = ("nanhunt.Guard keeps no snapshots under FSDP1 (FullyShardedDataParallel): each would gather the full "
               "state on every rank; drop snapshot_every (a check before optimizer.step() captures the pre-update "
               "state)")
# the path parts FSDP1's full state dict leaves out (torch's clean_tensor_name)
_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _fsdp1_class() -> type | None:
    if "torch.distributed.fsdp" not in sys.modules:  # no FSDP1 model was ever made in this process
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def top(model: nn.Module) -> nn.Module | None:
    """The module whose ``state_dict()`` under FSDP1's full state dict names the unwrapped model's tensors: the
    outermost FSDP1 wrapper (below DDP-style and ``torch.compile`` wrappers), or the model itself when only its
    submodules are FSDP1 units. None: no FSDP1 in ``model``."""
    fsdp = _fsdp1_class()
    if fsdp is None or not any(isinstance(m, fsdp) for m in model.modules()):
        return None
    m = model
    while not isinstance(m, fsdp):
        inner = wrapped(m)
        if inner is None:
            return m
        m = inner
    return m


def refusal(model: nn.Module, *, on_fail: str, snapshot_every: int | None) -> str | None:
    """Why a Guard with these options cannot watch ``model`` (None: it can)."""
    if top(model) is None:
        return None
    if on_fail == "rollback":
        return NO_ROLLBACK
    if snapshot_every is not None:
        return NO_SNAPSHOT
    return None


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a ``state_dict()`` holds, by ``named_buffers()`` name, without calling it (see the module's
    docstring)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def user_name(name: str) -> str:
    """A parameter or buffer name as the user wrote it (as FSDP1's full state dict names it)."""
    for part in _PARTS:
        name = name.replace(part, "")
    return name


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full model state and the optimizer state keyed by parameter name (``FSDP.optim_state_dict``), both
    unflattened, on the CPU, on every rank. Collectives: every rank of the FSDP1 units' groups must call it."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = top(model)
    assert root is not None
    # Offload only from an accelerator: with the flat parameters on the CPU already, torch frees the unsharded
    # storage it has just "copied" and the gather fails (torch 2.13).
    offload = any(p.device.type != "cpu" for p in root.parameters())
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=offload, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=False)):
        model_sd = root.state_dict()
        optim_sd = FSDP.optim_state_dict(root, optimizer)
    # clones already (FSDP1's post hook): the unsharded storage is freed on leaving
    return {user_name(k): v.detach().cpu() for k, v in model_sd.items()}, optim_sd
