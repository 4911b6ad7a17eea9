"""Tensor subclasses (``__torch_dispatch__``): the values one stands for, as a plain tensor, and its copies.

A subclass such as torchao's ``Float8TrainingTensor`` or ``NF4Tensor`` implements the ops its own code needs
and raises on every other one (``aminmax``, ``isnan``, ``_foreach_norm``...). nanhunt never calls such an op on
it: it measures the plain tensor the value stands for, read through the subclass's own parts, and copies it
through its own ops or its inner tensors. Nothing here imports the library that defines a subclass: the rules
go by what a class has (its attributes and methods), read once per class.

The rules, first match:

1. not a dispatch subclass (a plain tensor, ``nn.Parameter``, a ``__torch_function__``-only class): itself;
2. a DTensor (``_local_tensor``): this rank's shard, no collective, then these rules again;
3. a float8 training tensor (torchao's ``Float8TrainingTensor``: ``_data``, ``_scale``, ``_orig_dtype``): the
   high-precision value, ``_data / _scale`` in its original dtype;
4. a quantized weight that restores itself (``get_original_weight()``: torchao's ``NF4Tensor``; or a
   ``dequantize()`` of its own, not ``Tensor.dequantize``): what that gives;
5. any other wrapper (``__tensor_flatten__``) whose inner tensors include one of its own shape and dtype: that
   tensor, the values it wraps;
6. else: not measurable (``None``); the callers say so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["is_plain", "plain_values", "local_tensor", "subclass_clone", "subclass_copy", "inner_tensors", "parts"]

_Rule = Callable[[torch.Tensor], "torch.Tensor | None"]
# What a class inherits when it does not take part in dispatch (torch.Tensor's own, a Parameter's).
_NOT_DISPATCH = torch.Tensor.__torch_dispatch__
_TENSOR_DEQUANTIZE = torch.Tensor.dequantize
_RULES: dict[type, _Rule | None] = {torch.Tensor: None, torch.nn.Parameter: None}  # None: a plain tensor


def is_plain(t: torch.Tensor) -> bool:
    """``t`` is no dispatch subclass: every op runs on it as on a plain tensor."""
    return _rule(t.__class__) is None


def plain_values(t: torch.Tensor) -> torch.Tensor | None:
    """The values ``t`` stands for on this rank, as a tensor no subclass handles (``t`` itself when it is
    plain); ``None`` when they cannot be read without an op the subclass may not implement. Read without
    autograd, and without changing ``t`` or any state the step reads."""
    rule = _rule(t.__class__)
    if rule is None:
        return t
    try:
        with torch.no_grad():
            return rule(t)
    except Exception:  # the subclass refused an op of its own rule: its values stay unread
        return None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of ``t``, as a plain tensor: a DTensor's local shard (no collective), a
    tensor subclass's high-precision values (:func:`plain_values`). A value that cannot be read is one
    zero of ``t``'s dtype (judged finite, with no magnitude: it adds nothing to a check or a maximum)."""
    if t.__class__ is torch.Tensor:
        return t
    v = plain_values(t)
    if v is None:
        return torch.zeros(1, dtype=t.dtype, device=t.device)
    return v


def _rule(cls: type) -> _Rule | None:
    try:
        return _RULES[cls]
    except KeyError:
        rule = _RULES[cls] = _rule_for(cls)
        return rule


def _rule_for(cls: type) -> _Rule | None:
    if getattr(cls, "__torch_dispatch__", _NOT_DISPATCH) is _NOT_DISPATCH:
        return None
    if "_local_tensor" in _slots(cls) or hasattr(cls, "to_local"):
        return _dtensor_local
    if {"_data", "_scale", "_orig_dtype"} <= _slots(cls):
        return _float8_training
    if callable(getattr(cls, "get_original_weight", None)):
        return _original_weight
    if getattr(cls, "dequantize", _TENSOR_DEQUANTIZE) is not _TENSOR_DEQUANTIZE and not isinstance(
            cls.__dict__.get("dequantize"), staticmethod):
        return _dequantized
    return _wrapped


def _slots(cls: type) -> set[str]:
    """The attribute names a class declares (``__slots__`` and annotations, along its bases)."""
    names: set[str] = set()
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
        names.update(c.__dict__.get("__annotations__", {}))
    return names


def _again(v: Any) -> torch.Tensor | None:
    return plain_values(v) if isinstance(v, torch.Tensor) else None


def _dtensor_local(t: torch.Tensor) -> torch.Tensor | None:
    local = getattr(t, "_local_tensor", None)
    return _again(local) if local is not None else _wrapped(t)


def _float8_training(t: torch.Tensor) -> torch.Tensor | None:
    data, scale, dtype = getattr(t, "_data"), getattr(t, "_scale"), getattr(t, "_orig_dtype")
    data, scale = _again(data), _again(scale)
    if data is None or scale is None:
        return None
    # what the subclass's own to_original_precision computes, in the dtype the wrapper says it has
    return (data.to(dtype) / scale).to(t.dtype)


def _original_weight(t: torch.Tensor) -> torch.Tensor | None:
    return _again(getattr(t, "get_original_weight")())


def _dequantized(t: torch.Tensor) -> torch.Tensor | None:
    return _again(t.dequantize())


def inner_tensors(t: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]], Any] | None:
    """A subclass's inner tensors by name and its metadata (``__tensor_flatten__``); None without one, or where it
    refuses."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, ctx = flatten()
        inner = [(n, getattr(t, n)) for n in names]
    except Exception:  # a flatten that refuses (or names what is not there): no parts to go by
        return None
    return [(n, v) for n, v in inner if isinstance(v, torch.Tensor)], ctx


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a subclass tensor is made of, through nested subclasses (none for a plain tensor, or
    where ``__tensor_flatten__`` is missing or refuses)."""
    got = inner_tensors(t)
    out: list[torch.Tensor] = []
    for _, v in got[0] if got is not None else ():
        out.extend((v,) if is_plain(v) else parts(v))
    return out


def _wrapped(t: torch.Tensor) -> torch.Tensor | None:
    got = inner_tensors(t)
    if got is None:
        return None
    for _, v in got[0]:
        if v.shape == t.shape and v.dtype == t.dtype:
            return _again(v)
    return None


def subclass_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of a subclass tensor that shares no memory with it, holding exactly what it holds: rebuilt from
    copies of its inner tensors (``__tensor_unflatten__``), else its own ``clone``. Not the other way round: a
    subclass's clone may compute anew (torchao's NF4 clone quantizes its dequantized values again)."""
    got = inner_tensors(t)
    if got is not None:
        try:
            inner = {n: v.clone() if is_plain(v) else subclass_clone(v) for n, v in got[0]}
            return type(t).__tensor_unflatten__(inner, got[1], t.size(), t.stride())  # type: ignore[attr-defined, no-any-return]
        except Exception:  # an unflatten that wants more than its parts: the subclass's own clone
            pass
    return t.clone()


def subclass_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` where one is a subclass, exactly: inner tensor into inner tensor (two values of one class
    whose parts match in name, shape and dtype), else its own ``copy_``."""
    d, s = inner_tensors(dst), inner_tensors(src)
    if (d is not None and s is not None and type(dst) is type(src)
            and [(n, v.shape, v.dtype) for n, v in d[0]] == [(n, v.shape, v.dtype) for n, v in s[0]]):
        for (_, a), (_, b) in zip(d[0], s[0]):
            if is_plain(a) and is_plain(b):
                a.copy_(b)
            else:
                subclass_copy(a, b)
        return
    dst.copy_(src)
