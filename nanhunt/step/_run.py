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


# where a model's output holds its loss: an index of a tuple or list, or a key of a dict (one level)
LossAt = tuple[int | str, ...]


def _loss_of(output: Any, targets: Any, loss_fn: Callable[..., Any] | None,
             loss_at: LossAt | None = None) -> torch.Tensor:
    """The step's loss: ``loss_fn``'s, else the model's own: its output (a scalar), the element ``loss_at`` of
    it (what the capture recorded), its ``.loss`` or ``["loss"]``, or the one scalar (of several, the one with an
    autograd history) in a tuple, list or dict it returned (``logits, loss = model(x, y)``)."""
    if loss_fn is not None:
        return loss_fn(output) if targets is None else loss_fn(output, targets)  # type: ignore[no-any-return]
    loss = output
    if not isinstance(loss, torch.Tensor):
        if loss_at is not None:
            loss = _element(output, loss_at)
        elif isinstance(output, Mapping) and "loss" in output:
            loss = output["loss"]
        elif getattr(output, "loss", None) is not None:
            loss = output.loss
        else:
            found = scalars_in(output)
            if len(found) == 1:
                loss = found[0][1]
            elif found:
                where = ", ".join(at_text(at) for at, _ in found)
                raise InputError(f"the model returned a {type(output).__name__} holding {len(found)} scalars with a "
                                 f"gradient ({where}) and the capture does not say which is the loss; give a loss "
                                 "function that picks it (--loss package.module:fn, called on the model's output)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(output).__name__ if not isinstance(output, torch.Tensor) else f"tensor of shape {tuple(output.shape)}"
        raise InputError(f"the model returned a {what}, not a loss; give a loss function (--loss package.module:fn)")
    return loss


def _items(output: Any) -> list[tuple[int | str, Any]]:
    """The elements of a tuple or list by index, of a dict by (string) key; none of anything else."""
    if isinstance(output, (tuple, list)):
        return list(enumerate(output))
    if isinstance(output, Mapping):
        return [(k, v) for k, v in output.items() if isinstance(k, str)]
    return []


def scalars_in(output: Any) -> list[tuple[LossAt, torch.Tensor]]:
    """The 0-dim floating tensors among the elements of a model's output (one level); of several, those with an
    autograd history (a replay's forward without gradients has none)."""
    found: list[tuple[LossAt, torch.Tensor]] = [
        ((k,), v) for k, v in _items(output) if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()]
    graded = [(k, v) for k, v in found if v.grad_fn is not None]
    return graded if len(found) > 1 and graded else found


def loss_position(output: Any, node: Any) -> LossAt | None:
    """Where the model's output holds the loss whose backward ran from the autograd node ``node``: the element
    that is a scalar made by that node; None when no element is (or ``output`` is a tensor itself)."""
    if node is None or isinstance(output, torch.Tensor):
        return None
    return next(((k,) for k, t in _items(output) if isinstance(t, torch.Tensor) and t.dim() == 0
                 and t.grad_fn is node), None)


def at_text(at: LossAt) -> str:
    """``[1]`` or ``['loss']``, as Python indexes the output."""
    return "".join(f"[{k!r}]" for k in at)


def _element(output: Any, at: LossAt) -> Any:
    found: Any = output
    for k in at:
        items = dict(_items(found))
        if k not in items:
            raise InputError(f"the capture says the loss is the model's output{at_text(at)}, but the model returned "
                             f"a {type(output).__name__} without it; is --model the model that wrote the capture?")
        found = items[k]
    return found


def _with_targets(model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, Any]:
    """With no loss function, the targets go to the model as its next positional argument when its forward takes
    one (``logits, loss = model(x, y)``, a Guard's batch ``(x, y)``): nothing else could use them. Else as they
    were (the model's loss comes from its inputs alone)."""
    if isinstance(inputs, Mapping):
        return inputs, targets
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    try:
        inspect.signature(model.forward).bind(*args, targets)
    except (TypeError, ValueError):
        return inputs, targets
    return (*args, targets), None


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
    loss_at: LossAt | None = None,
) -> torch.Tensor:
    """One step as training runs it: forward and loss under autocast, scaled backward, update.
    ``fp32_loss`` computes the loss with autocast off on float32 inputs, ``fp32_update`` runs the update
    on float32 master copies of half-precision parameters (bisection trials). ``loss_at``: where the model's
    output holds its loss (``_loss_of``)."""
    if fp32_loss and loss_fn is not None:
        loss_fn = fp32_call(loss_fn, device_type)
    if loss_fn is None and targets is not None:
        inputs, targets = _with_targets(model, inputs, targets)
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        loss = _loss_of(_call_model(model, inputs), targets, loss_fn, loss_at)
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
