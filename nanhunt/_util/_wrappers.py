"""Module names as the user wrote them: torch's wrappers (DDP, DataParallel, FSDP1, ``torch.compile``,
activation checkpointing) add a path part to every name of the model they wrap; the trace, the bisection and
``keep_fp32`` leave it out, so a live trace and the replay of its capture (the unwrapped model) agree."""

from __future__ import annotations

import sys
from collections.abc import Iterator

from torch import nn

__all__ = ["wrapped", "user_named_modules", "user_modules", "user_class"]

# Modules torch wraps around the one the user wrote, and the attribute holding it. Their names are not the
# user's (``module.fc1`` under DDP is ``fc1``; FSDP1 adds ``_fsdp_wrapped_module.`` at every wrapped level), and a
# capture and its replay use the unwrapped model: module names skip them, so the live trace and the replay agree.
_WRAPPERS = {
    "DistributedDataParallel": "module", "DataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",  # FSDP1; FSDP2's fully_shard modifies in place
    "OptimizedModule": "_orig_mod",  # torch.compile
    "CheckpointWrapper": "_checkpoint_wrapped_module", "OffloadWrapper": "_checkpoint_wrapped_module",
}


def wrapped(module: nn.Module) -> nn.Module | None:
    """The module a torch wrapper (DDP, FSDP1, torch.compile, activation checkpointing) wraps; else ``None``."""
    for cls in type(module).__mro__:
        attr = _WRAPPERS.get(cls.__name__)
        if attr is not None and cls.__module__.startswith("torch."):
            inner = module._modules.get(attr)
            return inner if isinstance(inner, nn.Module) else None
    return None


def user_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """``model.named_modules()`` with the names the user wrote: the path parts of torch's wrappers left out
    (the wrapper shares its inner module's name, and is flagged). Each module once, in the same order."""
    seen: set[int] = set()
    todo: list[tuple[str, nn.Module]] = [("", model)]
    while todo:
        name, mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        inner = wrapped(mod)
        yield name, mod, inner is not None
        kids = [(name if child is inner else f"{name}.{attr}" if name else attr, child)
                for attr, child in mod._modules.items() if child is not None]
        todo.extend(reversed(kids))


def user_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's modules by the names a trace gives them (torch's wrappers left out), in order."""
    return {name: mod for name, mod, wrapper in user_named_modules(model) if not wrapper}


def user_class(module: nn.Module) -> type:
    """The class the user wrote: ``fully_shard`` swaps a module's class for a subclass made on the fly."""
    if "torch.distributed.fsdp" in sys.modules:
        from torch.distributed.fsdp import FSDPModule

        for cls in type(module).__mro__:
            if not issubclass(cls, FSDPModule):
                return cls
    return type(module)
