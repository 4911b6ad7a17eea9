"""Tensor subclasses a user might write (``__torch_dispatch__``), each running only the ops it lists and raising
``NotImplementedError`` on any other, as torchao's do.

- :class:`Wrapped`: holds its values in one inner tensor (``elem``) and wraps every result again: activations,
  gradients and parameters alike are ``Wrapped`` once one is.
- :class:`Opaque`: an int8 weight and a scale; it multiplies, transposes and detaches, and offers no way to its
  values (no ``dequantize``, no inner tensor of its dtype): a trace cannot measure it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten

WRAPPED_OPS = frozenset({aten.mm, aten.t, aten.view, aten.detach, aten.exp, aten.mul, aten.sum, aten.ones_like,
                         aten.expand, aten.clone, aten._to_copy, aten.copy_, aten.add, aten.add_, aten.alias,
                         aten.zeros_like, aten.empty_like, aten.relu, aten.threshold_backward})


class Wrapped(torch.Tensor):
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),  # type: ignore[attr-defined, no-any-return]
                                                   dtype=elem.dtype, device=elem.device,
                                                   requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> Wrapped:
        return Wrapped(inner["elem"])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Wrapped({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket not in WRAPPED_OPS:
            raise NotImplementedError(f"Wrapped does not run {func}")

        def unwrap(t: Any) -> Any:
            return t.elem if isinstance(t, Wrapped) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


class Opaque(torch.Tensor):
    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32,  # type: ignore[attr-defined, no-any-return]
                                                   device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> Opaque:
        return Opaque(inner["qdata"], inner["scale"])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Opaque({self.qdata!r}, {self.scale!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is aten.detach.default:
            return Opaque(args[0].qdata, args[0].scale)
        if func is aten.t.default:
            return Opaque(args[0].qdata.t(), args[0].scale)
        if func is aten.mm.default:
            a, b = (x.qdata.float() * x.scale if isinstance(x, Opaque) else x for x in args)
            return torch.mm(a, b)
        raise NotImplementedError(f"Opaque does not run {func}")
