"""Running one step: the model called on its inputs, the loss, backward, the update (run_step)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from .._util._errors import InputError
from .precision import float32_master, fp32_call


def _call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        shape = "keyword arguments " + ", ".join(kwargs) if kwargs else f"{len(args)} positional argument(s)"
        raise InputError(f"the batch gives {shape}, which {type(model).__name__}.forward does not take ({e})") from e
    except ValueError:  # no signature available
        pass
    return model(*args, **kwargs)


def _loss_of(output: Any, targets: Any, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output) if targets is None else loss_fn(output, targets)  # type: ignore[no-any-return]
    loss = output
    if not isinstance(loss, torch.Tensor):
        if isinstance(output, Mapping) and "loss" in output:
            loss = output["loss"]
        elif getattr(output, "loss", None) is not None:
            loss = output.loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(output).__name__ if not isinstance(output, torch.Tensor) else f"tensor of shape {tuple(output.shape)}"
        raise InputError(f"the model returned a {what}, not a loss; give a loss function (--loss package.module:fn)")
    return loss


def _backward(t: torch.Tensor) -> None:
    # Tensor.backward is unannotated in torch. Cast it rather than call torch.autograd.backward(t):
    # a __torch_function__ override (tensor subclass or mode) still sees Tensor.backward, as before.
    cast("Callable[[], None]", t.backward)()


def run_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    loss_fn: Callable[..., Any] | None,
    dtype: torch.dtype,
    device_type: str,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer | None,
    fp32_loss: bool = False,
    fp32_update: bool = False,
) -> torch.Tensor:
    """One step as training runs it: forward and loss under autocast, scaled backward, update.
    ``fp32_loss`` computes the loss with autocast off on float32 inputs, ``fp32_update`` runs the update
    on float32 master copies of half-precision parameters (bisection trials)."""
    if fp32_loss and loss_fn is not None:
        loss_fn = fp32_call(loss_fn, device_type)
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        loss = _loss_of(_call_model(model, inputs), targets, loss_fn)
    if loss.requires_grad:
        _backward(scaler.scale(loss) if scaler is not None else loss)
        if optimizer is not None:
            with float32_master(optimizer) if fp32_update else contextlib.nullcontext():
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
    return loss
