"""Private: walk the nested containers users pass around for tensors.

Containers come back as their own type: a transformers ``ModelOutput`` keeps ``.logits``, a
``BatchEncoding`` or ``OrderedDict`` stays one, a namedtuple or dataclass keeps its fields. Objects
the walker does not know are left as they are (and not looked into).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar

import torch

__all__ = ["map_tensors", "iter_tensors", "iter_leaves"]

_T = TypeVar("_T")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor inside containers replaced by ``fn(tensor)``; each container is rebuilt
    as its own type (``obj`` itself is never changed)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind(map_tensors(o, fn) for o in obj)
    if kind is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        items = [map_tensors(o, fn) for o in obj]
        if hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments
            return _rebuilt(lambda: kind(*items), lambda: tuple(items))
        return _rebuilt(lambda: kind(items), lambda: tuple(items))
    if isinstance(obj, list):
        return _rebuilt(lambda: _filled(obj, enumerate(map_tensors(o, fn) for o in obj)),
                        lambda: [map_tensors(o, fn) for o in obj])
    if isinstance(obj, MutableMapping):  # OrderedDict, ModelOutput, BatchEncoding (a UserDict)
        values = {k: map_tensors(v, fn) for k, v in obj.items()}
        return _rebuilt(lambda: _filled(obj, values.items()), lambda: values)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(new, f.name, map_tensors(getattr(obj, f.name), fn))  # frozen ones too
        return new
    return obj


def _filled(obj: Any, items: Any) -> Any:
    """A shallow copy of the mutable container ``obj`` (its type, attributes) with ``items`` set."""
    new = copy.copy(obj)
    for k, v in items:
        new[k] = v  # ModelOutput's __setitem__ also sets the attribute (.logits)
    return new


def _rebuilt(make: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception:  # a container type that cannot be copied or built from its items
        return fallback()


def iter_leaves(obj: Any, kind: type[_T]) -> Iterator[_T]:
    """Every ``kind`` inside containers (sequences, mappings, dataclasses), depth first."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from iter_leaves(o, kind)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from iter_leaves(o, kind)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_leaves(getattr(obj, f.name, None), kind)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside containers, depth first."""
    return iter_leaves(obj, torch.Tensor)
