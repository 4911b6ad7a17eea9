"""Local float32: run chosen submodules with autocast disabled and float32 inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from ._tree import map_tensors

__all__ = ["keep_fp32", "keep_fp32_permanently", "fp32_call", "LOSS_REGION"]

LOSS_REGION = "<loss>"  # the loss function, as a bisection candidate
_LOW = (torch.float16, torch.bfloat16)


def _to_fp32(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.float() if t.dtype in _LOW else t)


def _device_type(args: Any, module: nn.Module | None) -> str:
    stack = [args]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            return o.device.type
        if isinstance(o, (tuple, list)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    p = None if module is None else next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def fp32_call(fn: Callable[..., Any], device_type: str | None = None) -> Callable[..., Any]:
    """``fn`` run with autocast off and half-precision floating arguments cast to float32."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type or _device_type((args, kwargs), None), enabled=False):
            return fn(*_to_fp32(args), **_to_fp32(kwargs))

    return call


def _wrap(module: nn.Module) -> Callable[[], None]:
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    orig = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(_device_type((args, kwargs), module), enabled=False):
            return orig(*_to_fp32(args), **_to_fp32(kwargs))

    forward.__nanhunt_fp32__ = True  # type: ignore[attr-defined]
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = cast("Callable[..., Any]", previous)  # present in __dict__ when `had`
        else:
            module.__dict__.pop("forward", None)

    return undo


def _modules(model: nn.Module, names: Iterable[str]) -> list[nn.Module]:
    table = dict(model.named_modules())
    out = []
    for n in names:
        if n == LOSS_REGION:
            continue
        if n not in table:
            raise KeyError(f"{n!r} is not a module of the model (see model.named_modules())")
        out.append(table[n])
    return out


def keep_fp32_permanently(model: nn.Module, names: Iterable[str]) -> Callable[[], None]:
    """Run the named submodules in float32 from now on (the fix to keep). Returns an undo function.

    Example::

        nanhunt.keep_fp32_permanently(model, ["encoder.block.3.ff"])
    """
    undos = [_wrap(m) for m in _modules(model, names)]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


@contextlib.contextmanager
def keep_fp32(model: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """Inside the block, the named submodules run with autocast disabled and float32 inputs.

    Names are ``named_modules()`` names; everything is restored on exit, also on an exception.

    Example::

        with nanhunt.keep_fp32(model, ["blocks.1.ff.wo"]):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
    """
    undo = keep_fp32_permanently(model, names)
    try:
        yield
    finally:
        undo()
