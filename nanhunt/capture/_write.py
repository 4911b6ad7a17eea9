"""Writing a capture: the step's checkpoint and batch files (save_capture, capture_record)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..distributed import _dcp
from . import _names
from .._util._compiled import record_of
from .._util._files import new_files
from .._util._text import dtype_name
from .._util._tree import map_tensors
from .._util._wrappers import user_class
from ..step.step import rng_state, split_batch
from ._build import _group_names
from ._construction import Construction, how_built
from ._hf import _hf_model_spec
from ._lowp import captured
from ._nn_model import nn_spec
from ._resolve import callable_path


CAPTURE_FORMAT = 1


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module to save: without DDP/FSDP-style ``.module`` and torch.compile's ``_orig_mod``."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel",
                                                                    "FullyShardedDataParallel"):
            model = inner
            continue
        break
    return model


def save_capture(
    checkpoint_path: str | os.PathLike[str],
    batch_path: str | os.PathLike[str],
    *,
    model: nn.Module,
    batch: Any,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    model_factory: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    device_type: str | None = None,
    dtype: torch.dtype | None = None,
    rng: Mapping[str, Any] | None = None,
    model_state: Mapping[str, torch.Tensor] | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    scaler_state: Mapping[str, Any] | None = None,
    step_call: str | None = None,
    script_run: Mapping[str, Any] | None = None,
    compiled: Mapping[str, Any] | None = None,
    construction: Construction | None = None,
    loss_at: Sequence[int | str] | None = None,
) -> None:
    """Write ``checkpoint.pt`` + ``batch.pt`` that ``nanhunt replay`` replays with no other argument.

    ``batch`` is ``(inputs, targets)``, a tensor, or a dict of model keyword
    arguments. ``model_factory`` is ``"package.module:callable"`` (called with
    ``model_kwargs``); by default the model's class. ``loss_fn`` must be importable
    by name (a module-level function or an ``nn.Module`` loss with default
    arguments); ``None`` means the model returns its loss. ``rng`` defaults to the
    RNG state now: save before the step runs. ``model_state``/``optimizer_state``/
    ``scaler_state`` save those state dicts instead of the live objects' (a snapshot
    taken earlier); ``model`` and ``optimizer`` still name the classes. Both files
    load with ``torch.load(..., weights_only=True)``.

    A ``transformers`` model saved under its own class name also saves its config (JSON): the replay
    rebuilds it from that config, no ``--model`` needed. ``step_call="training_step"`` (Lightning): the
    step's loss is ``model.training_step(*inputs)``, not ``model(*inputs)``.

    A name defined in the running script is saved with how the script was started (its argv, working directory,
    path and the sha256 of its text: ``_names.script_run``), as now unless ``script_run`` gives it (the Guard
    takes it when it is made): its confirmed replay runs the script's definitions with that argv.

    A ``torch.compile``d model (or one given unwrapped with ``compiled``, what :func:`capture_record` says) is
    saved with its backend, mode, options and dynamic flag: the replay runs the step compiled too.

    Both files are written new and renamed onto their names once both are whole, or neither is: a symbolic link,
    a FIFO or anything else that is not a regular file at either name is refused with :class:`nanhunt.InputError`
    (also an ``OSError``), never written through nor waited on.

    A model of your own class with no ``model_kwargs`` is saved with the arguments it was built with, read back
    from its attributes and checked by building it again on the meta device (``construction``: what the Guard
    found, ``_construction.how_built``). ``loss_at``: where the model's output holds its loss (``[1]`` for
    ``logits, loss``).
    """
    ckpt, bfile = capture_record(
        model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer, scaler=scaler, model_factory=model_factory,
        model_kwargs=model_kwargs, device_type=device_type, dtype=dtype, rng=rng, model_state=model_state,
        optimizer_state=optimizer_state, scaler_state=scaler_state, step_call=step_call, script_run=script_run,
        compiled=compiled, construction=construction if construction is not None else _said(how_built(
            unwrap_model(model), model_factory, model_kwargs)), loss_at=loss_at)
    with new_files(os.fspath(checkpoint_path), os.fspath(batch_path)) as (ck, bt):
        torch.save(ckpt, ck)
        torch.save(bfile, bt)


def _said(construction: Construction) -> Construction:
    """``construction``, its problem said now (a warning), when the capture is written, not when it is replayed."""
    if construction.problem is not None:
        warnings.warn(f"nanhunt.save_capture: {construction.problem}", UserWarning, stacklevel=3)
    return construction


def capture_record(
    *,
    model: nn.Module,
    batch: Any,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    model_factory: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    device_type: str | None = None,
    dtype: torch.dtype | None = None,
    rng: Mapping[str, Any] | None = None,
    model_state: Mapping[str, torch.Tensor] | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    scaler_state: Mapping[str, Any] | None = None,
    step_call: str | None = None,
    script_run: Mapping[str, Any] | None = None,
    compiled: Mapping[str, Any] | None = None,
    construction: Construction | None = None,
    loss_at: Sequence[int | str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What :func:`save_capture` writes: the checkpoint's and the batch file's contents (the Guard's capture
    directory writes the same fields, the tensors as DCP shards). ``compiled``: how the model was compiled, when
    ``model`` is no longer its compiled wrapper (the Guard keeps the module it wraps)."""
    compiled = dict(compiled) if compiled is not None else record_of(model)  # before the wrapper is taken off
    model, factory, loss_path = _capture_names(model, model_factory, loss_fn, step_call)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    opt_class = None if optimizer is None else _optimizer_name(optimizer)
    state, lowp, nf4_parts = captured(model, model.state_dict() if model_state is None else model_state)
    ckpt: dict[str, Any] = {
        "nanhunt_capture": CAPTURE_FORMAT,
        "model": {k: v.detach().cpu() for k, v in state.items()},
        "model_factory": factory,
        "model_kwargs": dict(model_kwargs or {}),
        # how your model's class was called: its constructor's arguments as plain data (_construction)
        "model_init": None if construction is None else construction.record,
        # where the model's output holds its loss ([1] of `logits, loss`), when its loss is its own
        "loss_at": None if loss_at is None else list(loss_at),
        # torch.nn's own model (a Sequential of torch.nn layers): its layers, which its class alone does not rebuild
        "nn_model": nn_spec(model, model_factory, model_kwargs),
        # a transformers model named by its own class: rebuilt from its config (a factory you named wins)
        # (under FSDP2 the class the user wrote, not the one fully_shard made on the fly)
        "hf_model": _hf_model_spec(model) if factory == callable_path(user_class(model)) else None,
        "step_call": step_call,
        "training": bool(model.training),
        # every module's own flag: a frozen (eval) BatchNorm inside a training model stays frozen
        "module_training": {name: bool(m.training) for name, m in model.named_modules()},
        "loss_fn": loss_path,
        "optimizer": dict(optimizer_state) if optimizer_state is not None else (
            None if optimizer is None else optimizer.state_dict()),
        # a class defined in the training script by the script's path (replayed with --optimizer)
        "optimizer_class": opt_class,
        # the training script's argv and text, for names it defines: what their definitions read when replayed
        "script": dict(script_run) if script_run is not None else _names.script_run([factory, loss_path, opt_class]),
        # each group's parameters by name: the state_dict numbers them in group order, not model order
        "optimizer_params": None if optimizer is None else _group_names(model, optimizer),
        "scaler": dict(scaler_state) if scaler_state is not None else (None if scaler is None else scaler.state_dict()),
        "autocast": {
            "device_type": device_type or dev.type,
            "dtype": dtype_name(dtype or torch.float16),
        },
        "torch_version": str(torch.__version__),
        "device": str(dev),
        # how the step's model was compiled (backend, mode, options, dynamic): the replay runs it compiled too
        "compile": compiled,
        # torchao's float8 layers and their config, QLoRA's NF4 weights (saved dequantized), as plain data (_lowp)
        "lowp": lowp,
    }
    if nf4_parts is not None:  # the NF4 weights' quantized parts: rebuilt exactly, not quantized again
        ckpt["nf4_parts"] = nf4_parts
    if _dcp.sharded(model):  # FSDP2: which modules fully_shard wrapped, for the distributed replay to wrap again
        ckpt["fsdp"] = _dcp.fsdp_layout(model)
    inputs, targets = split_batch(batch)
    bfile = {
        "nanhunt_batch": CAPTURE_FORMAT,
        "inputs": _to_cpu(inputs),
        "targets": _to_cpu(targets),
        "rng": dict(rng) if rng is not None else rng_state(),
    }
    return ckpt, bfile


def _capture_names(model: nn.Module, model_factory: str | None, loss_fn: Any,
                   step_call: str | None) -> tuple[nn.Module, str, str | None]:
    """``save_capture``'s checks: the unwrapped model, the factory and the loss function's importable name."""
    if step_call not in (None, "training_step"):
        raise ValueError(f"step_call must be None or 'training_step', not {step_call!r}")
    model = unwrap_model(model)  # a DDP / torch.compile wrapper is saved as the model it wraps
    factory = model_factory or _names.capture_name(user_class(model))  # FSDP2: your class, not FSDP<Cls>
    if factory is None:
        raise ValueError("cannot name the model's class for rebuilding: pass model_factory='package.module:callable'")
    loss_path = None
    if loss_fn is not None:
        loss_path = _names.capture_name(loss_fn)
        if loss_path is None:
            raise ValueError("loss_fn must be importable by name (module-level function or nn.Module class)")
    return model, factory, loss_path


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str | None:
    """The optimizer's class as a capture names it; None for one defined in a notebook (the replay then leaves
    the update out, as for a plain checkpoint)."""
    name = _names.capture_name(optimizer)
    return None if name is None or _names.is_session(name) else name


def _to_cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().cpu())


def to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))
