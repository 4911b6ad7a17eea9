"""Private: walk the nested containers users pass around (tuples, lists, dicts) for tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["map_tensors", "iter_tensors", "iter_leaves"]

_T = TypeVar("_T")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor inside tuples, lists and dicts replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def iter_leaves(obj: Any, kind: type[_T]) -> Iterator[_T]:
    """Every ``kind`` inside tuples, lists and dicts, depth first."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from iter_leaves(o, kind)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_leaves(o, kind)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside tuples, lists and dicts, depth first."""
    return iter_leaves(obj, torch.Tensor)
