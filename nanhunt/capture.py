"""Saving and safely loading what a step needs: model, optimizer, scaler, batch, RNG.

Everything is loaded with ``torch.load(..., weights_only=True)``: a checkpoint
attached to a bug ticket is untrusted input, and a full pickle executes code.
The pickled-``nn.Module`` path exists only behind an explicit ``trust_pickle``.
Names of callables stored in a file (model factory, loss, optimizer class) are suggestions
(``resolve``): only torch.nn's own module classes and losses and torch.optim's optimizers are
imported and built unconfirmed (a transformers model is rebuilt from its config alone, ``_hf_model``);
anything else is confirmed on the command line (``--model``/``--loss``/``--optimizer``) or by a
package prefix you trust (``--trust-names``, ``NANHUNT_TRUST_NAMES``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import keyword
import os
import random
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import _dcp, _names, _nn_structure, _peft
from ._names import loaded_from as _loaded_from, recognised as _allowed
from ._errors import CommandError, first_line as _first_line
from ._safeload import load_file
from ._tree import map_tensors
from ._wrappers import user_class
from .step import Step, rng_state, set_rng_state, split_batch

__all__ = [
    "save_capture",
    "load_capture",
    "load_capture_dir",
    "unwrap_model",
    "load_file",
    "resolve",
    "callable_path",
    "load_step",
    "map_state_dict",
    "split_batch",
    "rng_state",
    "set_rng_state",
]

CAPTURE_FORMAT = 1
_PREFIXES = ("module", "_orig_mod")  # DDP, torch.compile


# ------------------------------------------------------------ callable paths
def callable_path(obj: Any) -> str | None:
    """``"package.module:qualname"`` for a function or class (or an instance's class)."""
    target = obj if (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)) else type(obj)
    mod = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", None)
    if not mod or not qual or "<" in qual or mod == "__main__":
        return None
    return f"{mod}:{qual}"


def resolve(path: str, *, what: str, trusted: bool, trust: Sequence[str] = ()) -> Any:
    """Import ``"package.module:callable"``.

    A name you gave (``trusted``) is imported and looked up as written. A name read from a file is a
    suggestion, judged by its name before anything is imported: in torch.nn's or torch.optim's own modules
    (``_names.torch_own``), or inside a package prefix you trust (``trust``), it is imported where Python
    finds installed code and must resolve to an ``nn.Module`` class (model or loss), an optimizer class, one of
    ``torch.nn.functional``'s losses, or (under a trusted prefix) a function of that package, reached without
    passing through another module; any other name raises :class:`_names.NeedsConfirmation`. No
    standard-library module, no dunder attribute, and never a ``__main__`` module, even trusted."""
    if not isinstance(path, str):
        raise CommandError(f"{what} {path!r} is a {type(path).__name__}, not a 'package.module:callable' string")
    if _names.is_script(path):
        return _from_script(path, what=what, trusted=trusted)
    flag = _FLAGS.get(what, "--model")
    if _names.is_session(path):
        raise CommandError(f"{what} {path!r} was defined in a notebook or interactive session, which cannot be "
                           f"imported; put it in a module and pass {flag} package.module:{path.partition(':')[2]}")
    mod_name, sep, qual = path.partition(":")
    if not sep or not _dotted(mod_name) or not _dotted(qual):
        raise CommandError(f"{what} {path!r} is not of the form package.module:callable")
    if _names.is_main_module(mod_name):
        raise CommandError(f"{what} {path!r} is in {mod_name!r}, a program's __main__ module: importing it runs that "
                           f"program, so nanhunt never does; pass {flag} package.module:{_placeholder(flag)} naming "
                           "the module that defines it")
    prefix = False
    if not trusted:
        _vet_name(path, mod_name, qual, what)
        prefix = _names.trusted_by(mod_name, trust)
        if not prefix and not _names.torch_own(mod_name, what):
            if mod_name.partition(".")[0] == "torch":  # torch's own code, never the user's: nothing to confirm
                raise _refused(path, what, f"of torch, only {_TORCH_OWN.get(what, 'torch.nn')} are used unconfirmed")
            raise _names.NeedsConfirmation(
                f"the file names {what} {path!r}, which is not torch's own: nanhunt imports it and calls it with the "
                f"file's arguments only if you trust it; pass {flag} {path} to confirm", what=what, path=path)
    obj: Any = _import(mod_name, path, what=what, trusted=trusted)
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise CommandError(f"{what} {path!r}: module {mod_name!r} has no attribute {part!r}") from e
        if not trusted and isinstance(obj, types.ModuleType):
            # torch.os, torch.builtins: a path through another module reaches anything
            raise _refused(path, what, f"{part!r} is another module ({obj.__name__!r}), not something of {mod_name!r}")
    if not callable(obj):
        raise CommandError(f"{what} {path!r} is not callable")
    if trusted or _allowed(obj, what) or (
            prefix and inspect.isfunction(obj) and _names.trusted_by(getattr(obj, "__module__", None) or "", trust)):
        return obj
    # only a plain function of the named (non-torch) module is offered for confirmation: never a
    # builtin, a torch function or anything the name reached by another way
    own = (inspect.isfunction(obj) and getattr(obj, "__module__", None) == mod_name
           and mod_name.partition(".")[0] != "torch")
    fix = (f"if you trust it, pass {flag} {path} to confirm" if own and what in _FLAGS else
           f"pass {flag} package.module:{_placeholder(flag)} with your own" if what in _FLAGS
           else "rebuild it yourself")
    message = (f"the file names {what} {path!r}, which is {_kind(what)}: nanhunt does not call it "
               f"unconfirmed; {fix}")
    if own and what in _FLAGS:
        raise _names.NeedsConfirmation(message, what=what, path=path)
    raise CommandError(message)


# what a file's name may choose unconfirmed, in words
_TORCH_OWN = {"model factory": "torch.nn's module classes", "loss function": "torch.nn's losses",
              "optimizer class": "torch.optim's optimizers"}


def _placeholder(flag: str) -> str:
    return {"--model": "factory", "--optimizer": "Class"}.get(flag, "fn")


def _from_script(path: str, *, what: str, trusted: bool) -> Any:
    """A name recorded by the path of the script that defined it (``/dir/train.py:my_loss``)."""
    file, _, qual = path.rpartition(":")
    flag = _FLAGS.get(what, "--model")
    if not trusted:
        raise _names.NeedsConfirmation(
            f"the file names {what} {path!r}, defined in a script: nanhunt runs the script's imports and "
            f"definitions (never its loops or main block) only if you trust it; pass {flag} {path} to confirm",
            what=what, path=path)
    if not _dotted(qual):
        raise CommandError(f"{what} {path!r} is not of the form /path/script.py:name")
    obj: Any = _names.load_script(file)
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise CommandError(f"{what} {path!r}: script {file!r} defines no {part!r} at its top level") from e
    if not callable(obj):
        raise CommandError(f"{what} {path!r} is not callable")
    return obj


_FLAGS = _names.FLAGS


def _dotted(name: str) -> bool:
    return bool(name) and all(p.isidentifier() and not keyword.iskeyword(p) for p in name.split("."))


def _kind(what: str) -> str:
    return {"model factory": "not an nn.Module class",
            "optimizer class": "not a torch.optim.Optimizer class"}.get(
        what, "neither an nn.Module class nor one of torch.nn.functional's losses")


def _refused(path: str, what: str, why: str) -> CommandError:
    flag = _FLAGS.get(what)
    fix = f"pass {flag} package.module:{_placeholder(flag)} with your own" if flag else "rebuild it yourself"
    return CommandError(f"the file names {what} {path!r}, which nanhunt refuses: {why}; the file may be "
                        f"hostile; {fix}")


def _vet_name(path: str, mod_name: str, qual: str, what: str) -> None:
    """What can be said of a name from a file before anything is imported."""
    dunder = next((p for p in qual.split(".") if p.startswith("__")), None)
    if dunder:
        raise _refused(path, what, f"{dunder!r} is a Python internal")
    top = mod_name.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__":
        raise _refused(path, what, f"{top!r} is Python's own module, which holds no "
                                   f"{'loss' if what == 'loss function' else 'model or optimizer'}")


def _find(mod_name: str) -> ModuleSpec | None:
    """The spec of ``mod_name`` found without running any of its packages' ``__init__``."""
    parts = mod_name.split(".")
    spec: ModuleSpec | None = None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None) or ModuleSpec(name, None)
            if loaded.__dict__.get("__path__") is not None:
                spec.submodule_search_locations = list(loaded.__path__)
            continue
        if i == 0:
            try:
                spec = importlib.util.find_spec(name)  # a top-level name: nothing is executed
            except (ImportError, ValueError):
                return None
        else:
            where = None if spec is None else spec.submodule_search_locations
            if not where:
                return None  # the parent is a plain module, not a package
            spec = importlib.machinery.PathFinder.find_spec(name, list(where))
        if spec is None:
            return None
    return spec


def _import(mod_name: str, path: str, *, what: str, trusted: bool) -> Any:
    """Import ``mod_name``. A name you gave is looked up in the current directory too; a name read
    from a file (torch's own, or under a prefix you trust) only where Python finds installed code
    (site-packages, PYTHONPATH): importing a module runs it, and the current directory may hold a
    ticket's model.py or your own train.py."""
    if mod_name in sys.modules:
        return sys.modules[mod_name]  # imported already: nothing runs
    saved = list(sys.path)
    cwd = os.path.realpath(os.getcwd())
    top = mod_name.partition(".")[0]
    flag = _FLAGS.get(what, "--model")
    refused = _names.NeedsConfirmation(
        f"the file names {what} {path!r}, whose module is in the current directory, not installed: importing it "
        f"runs that code; pass {flag} {path} to confirm you trust it, or install its package", what=what, path=path)
    if trusted:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    else:
        # PYTHONPATH entries you set are trusted; a relative one ('.') would follow the directory
        # nanhunt runs in, so only absolute ones count.
        explicit = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if os.path.isabs(p)}
        if cwd not in explicit:
            if _loaded_from(sys.modules.get(top)) == cwd:  # a submodule of a package imported from here
                raise refused
            sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != cwd]
    try:
        if not trusted and _find(mod_name) is None:  # found missing before any package's __init__ runs
            raise ModuleNotFoundError(f"no module named {mod_name!r}", name=top if _find(top) is None else mod_name)
        return importlib.import_module(mod_name)
    except Exception as e:
        if not trusted and isinstance(e, ModuleNotFoundError) and e.name == top and (
                os.path.exists(os.path.join(cwd, top + ".py")) or os.path.isdir(os.path.join(cwd, top))):
            raise refused from e
        fix = "run from the project directory or install its package" if trusted else \
            "install its package or put it on PYTHONPATH"
        raise CommandError(f"cannot import {what} module {mod_name!r} ({type(e).__name__}: {e}); {fix}") from e
    finally:
        if not trusted:
            sys.path[:] = saved


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
    """
    ckpt, bfile = capture_record(
        model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer, scaler=scaler, model_factory=model_factory,
        model_kwargs=model_kwargs, device_type=device_type, dtype=dtype, rng=rng, model_state=model_state,
        optimizer_state=optimizer_state, scaler_state=scaler_state, step_call=step_call)
    torch.save(ckpt, os.fspath(checkpoint_path))
    torch.save(bfile, os.fspath(batch_path))


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
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What :func:`save_capture` writes: the checkpoint's and the batch file's contents (the Guard's capture
    directory writes the same fields, the tensors as DCP shards)."""
    model, factory, loss_path = _capture_names(model, model_factory, loss_fn, step_call)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    ckpt: dict[str, Any] = {
        "nanhunt_capture": CAPTURE_FORMAT,
        "model": {k: v.detach().cpu()
                  for k, v in (model.state_dict() if model_state is None else model_state).items()},
        "model_factory": factory,
        "model_kwargs": dict(model_kwargs or {}),
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
        "optimizer_class": None if optimizer is None else _optimizer_name(optimizer),
        # each group's parameters by name: the state_dict numbers them in group order, not model order
        "optimizer_params": None if optimizer is None else _group_names(model, optimizer),
        "scaler": dict(scaler_state) if scaler_state is not None else (None if scaler is None else scaler.state_dict()),
        "autocast": {
            "device_type": device_type or dev.type,
            "dtype": str(dtype or torch.float16).replace("torch.", ""),
        },
        "torch_version": str(torch.__version__),
        "device": str(dev),
    }
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


def nn_spec(model: nn.Module, model_factory: str | None,
            model_kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A model built by one of torch.nn's own classes (the model's, or ``model_factory`` naming one): its structure
    (``_nn_structure``), or None when ``model_kwargs`` rebuild it. ValueError, asking for a factory, when neither
    rebuilds it exactly."""
    name = model_factory or _names.capture_name(user_class(model))
    if name is None or not _names.torch_own(name.partition(":")[0], "model factory"):
        return None  # your factory or class rebuilds it
    try:
        if model_kwargs:
            _same_on_meta(model, _nn_class(name), model_kwargs)
            return None
        return _nn_structure.structure(model, _nn_class)
    except (ValueError, CommandError) as e:
        raise ValueError(f"cannot rebuild the model from torch.nn's classes: {e}; "
                         "pass model_factory='package.module:factory'") from None


def _same_on_meta(model: nn.Module, cls: type[nn.Module], kwargs: Mapping[str, Any]) -> None:
    """``cls(**kwargs)`` (on the meta device) is ``model`` (``_nn_structure.matches``)."""
    try:
        with torch.device("meta"):
            probe = cls(**({**kwargs, "device": "meta"} if "device" in kwargs else kwargs))
    except Exception as e:
        raise ValueError(f"{cls.__name__}(**model_kwargs) raised {_first_line(e)}") from None
    if not _nn_structure.matches(probe, model):
        raise ValueError(f"{cls.__name__}(**model_kwargs) differs from the model")


def _nn_class(path: str) -> type[nn.Module]:
    """One of torch.nn's module classes, named by a capture's description of a model (never anyone else's)."""
    if not isinstance(path, str) or not _names.torch_own(path.partition(":")[0], "model factory"):
        raise ValueError(f"names {path!r}, not one of torch.nn's classes")
    cls = resolve(path, what="model factory", trusted=False)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"names {path!r}, not one of torch.nn's module classes")
    return cls


def _nn_model(spec: Mapping[str, Any], where: str, sd: Mapping[str, Any] | None) -> nn.Module:
    """The model a capture's ``nn_model`` describes; with ``sd`` (the file's weights), built on the meta device
    first and checked against them, as a factory the file names is (``_check_on_meta``)."""
    fix = "save the capture again or pass --model package.module:factory"
    try:
        if sd is not None:
            with torch.device("meta"):
                probe = _nn_structure.build(spec, _nn_class)
            map_state_dict(sd, probe)  # every key and shape, one error line
            held = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
            given = sum(t.numel() for t in sd.values() if isinstance(t, torch.Tensor))
            if held > given:
                raise ValueError(f"holds {held} values, more than the file's {given}")
        return _nn_structure.build(spec, _nn_class)
    except ValueError as e:
        raise CommandError(f"{where}: its torch.nn model (field 'nn_model') {e}; {fix}") from None


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str | None:
    """The optimizer's class as a capture names it; None for one defined in a notebook (the replay then leaves
    the update out, as for a plain checkpoint)."""
    name = _names.capture_name(optimizer)
    return None if name is None or _names.is_session(name) else name


def _to_cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().cpu())


def to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))


# ------------------------------------------------------- transformers models, rebuilt from their config
# Attention kernels that are torch's own. transformers also takes a Hub repository here ("kernels-community/...")
# and downloads and runs its code: a file may not choose that.
_HF_ATTENTION = (None, "eager", "sdpa", "flex_attention")
# Config entries that make a model's constructor fetch something (a pretrained backbone, remote code).
_HF_FETCHING = ("auto_map", "trust_remote_code", "use_pretrained_backbone", "backbone")


def _hf_model_spec(model: nn.Module) -> dict[str, Any] | None:
    """A ``transformers`` model's class, config (JSON text) and attention kernel; None for any other model. A
    PEFT model: its base model's, with the adapters' configs under ``"peft"`` (nanhunt._peft)."""
    if _peft.is_peft_model(model):
        return _peft.spec(model, _hf_model_spec)
    transformers = sys.modules.get("transformers")  # imported already if the model is one of its models
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    try:
        config = json.dumps(model.config.to_dict())
    except (TypeError, ValueError):  # a config holding something JSON cannot say: replay needs --model
        return None
    attn = getattr(model.config, "_attn_implementation", None)
    return {"class": callable_path(user_class(model)), "config": config,
            "attn_implementation": attn if isinstance(attn, str)
            else None}


def _hf_model(spec: Mapping[str, Any], where: str, notes: list[str] | None = None) -> nn.Module:
    """The ``transformers`` model a capture names, built from its config and nothing else from the file: the
    class must be a ``PreTrainedModel`` subclass of the transformers package (vetted as ``resolve`` vets any
    name), its config class the class's own ``config_class``, the config plain JSON that asks to fetch nothing,
    and the attention kernel one of torch's."""
    fix = "pass --model package.module:factory"
    path, text, attn = spec.get("class"), spec.get("config"), spec.get("attn_implementation")
    if not isinstance(path, str) or not isinstance(text, str) or not (attn is None or isinstance(attn, str)):
        raise CommandError(f"{where} is not a valid nanhunt capture: field 'hf_model' holds no class name and JSON "
                           f"config; {fix}")
    if path.partition(":")[0].partition(".")[0] != "transformers":
        raise _refused(path, "model factory", "it is not a class of the transformers package")
    # the one package outside torch whose classes a file may name: built from a config only, checked below
    cls: Any = resolve(path, what="model factory", trusted=False, trust=("transformers",))
    transformers = sys.modules["transformers"]  # resolve imported a module of it
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    config_cls: Any = getattr(cls, "config_class", None)
    if not (_transformers_class(cls, transformers.PreTrainedModel) and _transformers_class(config_cls, base)):
        raise _refused(path, "model factory", "it is not a transformers PreTrainedModel class")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise CommandError(f"{where} is not a valid nanhunt capture: the config of {path!r} is not a JSON "
                           f"object; {fix}")
    fetching = _fetching(config)
    if fetching:
        raise _refused(path, "model factory", f"its config asks to fetch something ({fetching}): nanhunt builds a "
                                              "model from the file alone")
    if attn not in _HF_ATTENTION:
        raise _refused(path, "model factory", f"its attention kernel {attn!r} is not one of torch's "
                                              f"({', '.join(a for a in _HF_ATTENTION if a)})")
    try:
        cfg = config_cls.from_dict(config)
        cfg._attn_implementation = attn  # what the run used, set on every sub-config: never what the JSON says
        model = cls(cfg)
    except Exception as e:
        raise CommandError(f"cannot build {path} from the capture's config: {_first_line(e)}; {fix}") from e
    if not isinstance(model, nn.Module):
        raise CommandError(f"{path} built a {type(model).__name__}, not an nn.Module; {fix}")
    return _peft.rebuild(model, spec.get("peft"), where, notes)  # a PEFT model's adapters, from their JSON configs


def _transformers_class(obj: Any, base: type) -> bool:
    """``obj`` is a subclass of ``base`` defined in the transformers package."""
    return inspect.isclass(obj) and issubclass(obj, base) and obj.__module__.partition(".")[0] == "transformers"


def _fetching(obj: Any, key: str = "", depth: int = 0) -> str | None:
    """The first config entry (at any depth) that would make a constructor download or import something."""
    if depth > 64:
        return f"{key}...: nested too deep to check, over 64 levels"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if k in _HF_FETCHING and v not in (None, False, "", {}, []):
            return f"{key}{k}"
        found = _fetching(v, f"{key}{k}.", depth + 1)
        if found:
            return found
    return None


def _through_training_step(model: nn.Module) -> None:
    """Replay a Lightning capture: calling the model runs ``model.training_step(*inputs)`` (the step's loss);
    its own calls of the model inside run the real forward. Set on the instance: the Step calls ``model(*inputs)``."""
    training_step = getattr(model, "training_step", None)
    if not callable(training_step):
        raise CommandError(f"the capture replays the step through training_step, which {type(model).__name__} does "
                           "not have; is --model the LightningModule that wrote it?")
    forward = model.forward
    inside = False

    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside
        if inside:
            return forward(*args, **kwargs)
        inside = True
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*self\.log\(\)")  # no Trainer to log to
                out = training_step(*args, **kwargs)
        finally:
            inside = False
        if out is None:
            raise CommandError("training_step returned None for the captured batch (it skipped the step)")
        return out

    setattr(model, "forward", step)


# ------------------------------------------------------------------ loading
def map_state_dict(sd: Mapping[str, Any], model: nn.Module, *,
                   notes: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Map DDP (``module.``), torch.compile (``_orig_mod.``) and wrapper prefixes (Lightning's ``model.``)
    to the model's keys, and check every key and shape; one error listing the first mismatches.

    A key keeps its name when the model has it (``AveragedModel``'s own ``module.*``); otherwise the
    shortest prefix whose removal makes it a model key is removed. Keys of something beside the model
    (a loss's ``criterion.pos_weight``) are ignored with a line in ``notes``."""
    want = model.state_dict()
    heads = {k.split(".", 1)[0] for k in want}
    # each checkpoint key -> (components stripped, its wrapper head or None, the model key it fits)
    fits: dict[str, tuple[int, str | None, str]] = {}
    unmatched: list[str] = []
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            continue
        found = next(((i, head, cand) for i, head, cand in _candidates(k) if cand in want), None)
        if found is None:
            unmatched.append(k)
        else:
            fits[k] = found
    # one wrapper head for most keys ('model.') wins over a stray one ('criterion.') fitting the same key
    popular: dict[str | None, int] = {}
    for _, head, _ in fits.values():
        popular[head] = popular.get(head, 0) + 1
    source: dict[str, str] = {}
    ambiguous: list[str] = []
    for k, (i, head, target) in fits.items():
        other = source.get(target)
        if other is None:
            source[target] = k
            continue
        j, other_head, _ = fits[other]
        mine, theirs = (-i, popular[head]), (-j, popular[other_head])
        if mine == theirs:
            ambiguous.append(f"{other} and {k} (both {target})")
        elif mine > theirs:
            source[target] = k
    if ambiguous:
        raise CommandError(f"checkpoint keys fit the model in more than one way: {_few(ambiguous)}; "
                           "save the model's own state_dict (model.state_dict())")
    out = {target: sd[k] for target, k in source.items()}
    duplicates = [k for k in fits if source[fits[k][2]] != k]
    # a key naming none of the model's top-level entries, under any wrapper, belongs to something else
    foreign = [k for k in unmatched if not any(cand.split(".", 1)[0] in heads for _, _, cand in _candidates(k))]
    missing = [k for k in want if k not in out]
    shapes = [f"{k} {tuple(out[k].shape)} vs {tuple(want[k].shape)}"
              for k in want if k in out and tuple(out[k].shape) != tuple(want[k].shape)]
    # only a complete load ignores them: beside a missing key, an extra one is likely that key renamed
    unexpected = unmatched if missing or shapes else [k for k in unmatched if k not in foreign]
    if not (missing or shapes) and (foreign or duplicates) and notes is not None:
        notes.append(f"checkpoint entries that are not the model's were ignored: {_few(foreign + duplicates)}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {_few(shapes)}")
        raise CommandError("checkpoint keys don't match the model: " + "; ".join(parts)
                           + " — is --model the factory that built this checkpoint?")
    return out


def _candidates(key: str) -> list[tuple[int, str | None, str]]:
    """``key`` and its shorter forms, fewest components stripped first: any number of DDP/compile
    prefixes and at most one other wrapper component (its name given, as the wrapper's head)."""
    parts = key.split(".")
    out: list[tuple[int, str | None, str]] = []
    for i in range(len(parts)):
        wrappers = [p for p in parts[:i] if p not in _PREFIXES]
        if len(wrappers) <= 1:
            out.append((i, wrappers[0] if wrappers else None, ".".join(parts[i:])))
    return out


def _few(items: list[str], n: int = 3) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.replace("torch.", "")]
    except KeyError:
        raise CommandError(f"unknown dtype {name!r}; use float16, bfloat16 or float32") from None


def load_capture(checkpoint: str | os.PathLike[str], batch: str | os.PathLike[str], **options: Any) -> Step:
    """A capture as ``nanhunt replay`` would use it, to poke at in a notebook: a :class:`~nanhunt.step.Step`
    holding the model (weights loaded), inputs, targets, loss, optimizer, GradScaler, dtype, device and RNG.

    Same safety rules and options as the command (``model_factory=``, ``loss=``, ``optimizer=``,
    ``trust_names=``, ``device=``, ``dtype=``, ``no_scaler=``, ``train=``, ``trust_pickle=``). Run it as the replay does::

        step = nanhunt.load_capture("nan-captures/step000003-checkpoint.pt", "nan-captures/step000003-batch.pt")
        with step.isolated():
            loss = step.run()
    """
    return load_step(os.fspath(checkpoint), os.fspath(batch), **options)


def load_step(
    checkpoint: str,
    batch: str,
    *,
    model_factory: str | None = None,
    loss: str | None = None,
    optimizer: str | None = None,
    trust_names: Sequence[str] = (),
    device: str | None = None,
    dtype: str | None = None,
    no_scaler: bool = False,
    train: bool | None = None,
    trust_pickle: bool = False,
) -> Step:
    """Everything ``nanhunt replay`` needs, from the files and the flags; nothing is written."""
    names = _Names(model_factory, loss, optimizer, _names.trusted_prefixes(trust_names))
    dev = _parse_device(device) if device else None
    ck = load_file(checkpoint, what="checkpoint", trust_pickle=trust_pickle)
    bt = load_file(batch, what="batch", trust_pickle=trust_pickle)
    _check_not_batch(ck, bt, checkpoint, batch)
    step = _step_of(ck, bt, checkpoint, batch, dev=dev, names=names, dtype=dtype, no_scaler=no_scaler, train=train,
                    notes=[])
    if checkpoint.endswith("checkpoint.pt"):  # step{N}[-rank{R}]-checkpoint.pt: the Guard's event beside it
        step.event_file = checkpoint[: -len("checkpoint.pt")] + "event.json"
    return step


def load_capture_dir(
    path: str | os.PathLike[str],
    *,
    rank: int | None = None,
    model_factory: str | None = None,
    loss: str | None = None,
    optimizer: str | None = None,
    trust_names: Sequence[str] = (),
    device: str | None = None,
    dtype: str | None = None,
    no_scaler: bool = False,
    train: bool | None = None,
    trust_pickle: bool = False,
    shard: Callable[[nn.Module], None] | None = None,
) -> Step:
    """A capture directory written by :class:`nanhunt.Guard` under FSDP2 (``manifest.json``, DCP shards in
    ``state/``, ``batch-rank{R}.pt``) as one process replays it: the shards consolidated into the full model
    and optimizer state of the unwrapped model, and rank ``rank``'s batch (default: the first rank that saw the
    failure). The same checks and options as :func:`load_capture`; the shards are always read weights-only
    (``trust_pickle`` concerns the batch file only).

    ``shard`` (the distributed replay, ``nanhunt._dist_replay``): no shard is read here; the model is built,
    moved and handed to ``shard``, which wraps it as the capture was, and the optimizer is built on its
    parameters with the capture's groups and hyperparameters but no state: the caller loads the shards into
    both (``_dcp.load_sharded``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CommandError(f"{path!r} is not a capture directory" + (
            "; a checkpoint file needs its batch file too: nanhunt replay CHECKPOINT BATCH" if os.path.isfile(path)
            else ": it does not exist; check the path"))
    man = _dcp.read_manifest(path)
    r = _dcp.pick_rank(man, rank, path)
    dev = _parse_device(device) if device else None
    names = _Names(model_factory, loss, optimizer, _names.trusted_prefixes(trust_names))
    _confirm_all(man, names)  # before reading megabytes of shards
    where = f"capture directory {path!r}"
    state = _dcp.load_state(os.path.join(path, _dcp.STATE), tensors=shard is None)
    model_sd = {} if shard is not None else state.get("model")
    if not isinstance(model_sd, dict) or not all(isinstance(v, torch.Tensor) for v in model_sd.values()):
        raise CommandError(f"{where}: its state holds no model state_dict; the capture is damaged")
    ck: dict[str, Any] = {k: v for k, v in man.items() if k not in ("model", "optimizer", "optimizer_params")}
    ck.update(nanhunt_capture=CAPTURE_FORMAT, model=model_sd, optimizer=None, optimizer_params=None)
    if state.get("optimizer") is not None:
        ck["optimizer"], ck["optimizer_params"] = _dcp.optimizer_by_index(state["optimizer"], where)
        if shard is not None:
            ck["optimizer"]["state"] = {}  # loaded into the sharded optimizer by the caller
    batch = _dcp.not_linked(os.path.join(path, _dcp.batch_file(r)), f"{where}: its {_dcp.batch_file(r)}")
    bt = load_file(batch, what="batch", trust_pickle=trust_pickle)
    _check_not_batch(ck, bt, path, batch)
    seen = man["ranks_seen"]
    why = ("the first rank that saw the failure" if seen and r == min(seen) else
           f"the failure was seen by rank(s) {', '.join(map(str, seen))}" if seen else "no rank saw it")
    note = f"capture of {man['world_size']} ranks ({man['wrapper']}): rank {r}'s batch replayed ({why})"
    step = _step_of(ck, bt, path, batch, dev=dev, names=names, dtype=dtype, no_scaler=no_scaler, train=train,
                    notes=[note], shard=shard)
    step.event_file = os.path.join(path, f"event-rank{r}.json")
    return step


def _step_of(ck: Any, bt: Any, checkpoint: str, batch: str, *, dev: torch.device | None, names: _Names,
             dtype: str | None, no_scaler: bool, train: bool | None, notes: list[str],
             shard: Callable[[nn.Module], None] | None = None) -> Step:
    """The Step of a loaded checkpoint and batch (two files, or the parts of a capture directory); ``shard``:
    see :func:`load_capture_dir`."""
    model_factory, loss = names.model, names.loss
    if isinstance(ck, nn.Module):
        got = _Loaded(model=ck, loss_path=loss)
    elif isinstance(ck, Mapping) and "nanhunt_capture" in ck:
        _confirm_all(ck, names)
        # sharded, the weights are read into the wrapped model by the caller: none here to check shapes against
        got = _read_capture(ck, checkpoint, names=names, dev=dev, notes=notes, shapes=shard is None)
    elif isinstance(ck, Mapping):
        got = _read_plain_checkpoint(ck, loss)
    else:
        raise CommandError(f"checkpoint holds a {type(ck).__name__}; expected a state_dict or a dict with 'model'")

    if dev is None:
        dev = torch.device("cpu")
    model = _ready_model(got, ck, dev, model_factory=model_factory, train=train, notes=notes, shard=shard)

    if isinstance(bt, nn.Module):
        raise CommandError("the batch file holds a model, not a batch")
    inputs, targets = split_batch(bt)
    rng = _batch_rng(bt, batch) if isinstance(bt, Mapping) and "nanhunt_batch" in bt else None
    inputs, targets = to_device(inputs, dev), to_device(targets, dev)

    loss_fn = _loss_fn(got.loss_path, trusted=loss is not None, trust=names.trust) if got.loss_path else None

    optimizer = None
    if got.opt_sd is not None:
        optimizer = _build_optimizer(model, got.opt_sd, names.optimizer or got.opt_class, got.opt_names,
                                     trusted=names.optimizer is not None, trust=names.trust)
        if optimizer is None:
            notes.append("optimizer state present but its class is unknown: phase update not replayed")
    scaler = _scaler(got.scaler_sd, dev, notes) if got.scaler_sd is not None and not no_scaler else None
    dt = parse_dtype(dtype or str(got.autocast.get("dtype", "float16")))
    return Step(model, inputs, targets, loss_fn=loss_fn, dtype=dt, device_type=dev.type, scaler=scaler,
                optimizer=optimizer, rng=rng, notes=tuple(notes))


@dataclass(frozen=True)
class _Names:
    """The names you gave (``--model``, ``--loss``, ``--optimizer``: trusted) and the package prefixes you trust
    (``--trust-names``, NANHUNT_TRUST_NAMES), checked."""

    model: str | None = None
    loss: str | None = None
    optimizer: str | None = None
    trust: tuple[str, ...] = ()


@dataclass
class _Loaded:
    """What ``load_step`` read from a checkpoint, before the model is built and moved."""

    model: nn.Module | None = None
    sd: Mapping[str, Any] | None = None
    opt_sd: Mapping[str, Any] | None = None
    scaler_sd: Mapping[str, Any] | None = None
    opt_class: str | None = None
    opt_names: list[Any] | None = None
    training: bool = True
    module_training: Mapping[str, Any] | None = None
    loss_path: str | None = None
    autocast: Mapping[str, Any] = field(default_factory=dict)
    step_call: str | None = None
    saved_kwargs: dict[str, Any] = field(default_factory=dict)


def _confirm_all(ck: Mapping[str, Any], names: _Names) -> None:
    """Every name of the file that the replay will use unconfirmed, judged before any is imported or called: one
    error naming all the confirmations they need, not one per run."""
    pending_names: list[tuple[str, Any]] = []
    if names.model is None and not isinstance(ck.get("hf_model"), Mapping):
        pending_names.append(("model factory", ck.get("model_factory")))
    if names.loss is None:
        pending_names.append(("loss function", ck.get("loss_fn")))
    if names.optimizer is None:
        pending_names.append(("optimizer class", ck.get("optimizer_class")))
    pending: list[_names.NeedsConfirmation] = []
    for what, name in pending_names:
        if isinstance(name, str):
            try:
                resolve(name, what=what, trusted=False, trust=names.trust)
            except _names.NeedsConfirmation as e:
                pending.append(e)
            except CommandError:
                pass  # refused outright, or not importable: said when the step is built
    if len(pending) == 1:
        raise pending[0]
    if pending:
        listed = " and ".join(f"{e.what} {e.path!r}" for e in pending)
        flags = " ".join(f"{e.flag} {e.path}" for e in pending)
        raise CommandError(f"the file names {listed}, which nanhunt imports and calls only if you confirm them "
                           f"(your own code or another library's, not torch's own); if you trust them, pass {flags}")


def _check_not_batch(ck: Any, bt: Any, checkpoint: str, batch: str) -> None:
    """Refuse a nanhunt batch file given as the checkpoint (or the two files swapped)."""
    if _is_batch_file(ck) and isinstance(bt, Mapping) and "nanhunt_capture" in bt:
        raise CommandError(f"these look swapped: {checkpoint!r} is a nanhunt batch and {batch!r} a checkpoint; "
                           f"give the checkpoint first: nanhunt replay {batch} {checkpoint}")
    if _is_batch_file(ck):
        raise CommandError(f"checkpoint {checkpoint!r} is a nanhunt batch file, not a checkpoint; give the "
                           "checkpoint.pt written beside it first")


def _read_capture(ck: Mapping[str, Any], checkpoint: str, *, names: _Names, dev: torch.device | None,
                  notes: list[str], shapes: bool = True) -> _Loaded:
    """The fields of a nanhunt capture, each checked; the model built from the file's factory (untrusted)
    unless ``--model`` names one; with ``shapes``, checked against the file's weights before it is allocated."""
    model_factory, loss = names.model, names.loss
    def checked(name: str, types: type, expected: str, fix: str, *, required: bool = False) -> Any:
        return _capture_field(ck, name, types, expected, f"checkpoint {checkpoint!r}", fix, required=required)

    got = _Loaded()
    again = "save the capture again (nanhunt.save_capture)"
    got.sd = checked("model", Mapping, "the model's state_dict", again, required=True)
    got.opt_sd = checked("optimizer", Mapping, "an optimizer state_dict or null", again)
    got.opt_class = checked("optimizer_class", str, "'package.module:Class' or null", again)
    got.opt_names = checked("optimizer_params", list, "a list of parameter names per group, or null", again)
    got.scaler_sd = checked("scaler", Mapping, "a GradScaler state_dict or null", "pass --no-scaler to replay without it")
    got.training = bool(ck.get("training", True))
    got.module_training = checked("module_training", Mapping, "a dict of module name -> bool", again)
    got.loss_path = loss or checked("loss_fn", str, "'package.module:fn' or null", "pass --loss package.module:fn")
    got.autocast = checked("autocast", Mapping, "a dict with 'dtype'", "pass --dtype") or {}
    saved_dev = str(ck.get("device", "cpu"))
    got.step_call = checked("step_call", str, "'training_step' or null", again)
    if got.step_call not in (None, "training_step"):
        raise CommandError(f"checkpoint {checkpoint!r} is not a valid nanhunt capture: field 'step_call' is "
                           f"{got.step_call!r}, expected 'training_step' or null; {again}")
    if model_factory is not None:  # a factory you named is called with the file's arguments if it is the file's
        kwargs = ck.get("model_kwargs")
        if _same_name(model_factory, ck.get("model_factory")) and isinstance(kwargs, Mapping):
            got.saved_kwargs = dict(kwargs)
    else:
        factory = checked("model_factory", str, "'package.module:factory'", "pass --model package.module:factory",
                          required=True)
        kwargs = checked("model_kwargs", Mapping, "a dict of keyword arguments", "pass --model package.module:factory")
        hf = checked("hf_model", Mapping, "a transformers model's class and JSON config, or null",
                     "pass --model package.module:factory")
        layers = checked("nn_model", Mapping, "torch.nn layers' classes and arguments, or null",
                         "pass --model package.module:factory")
        if hf is not None:
            got.model = _hf_model(hf, f"checkpoint {checkpoint!r}", notes)
        elif layers is not None and _names.torch_own(factory.partition(":")[0], "model factory"):
            # (written only for a model of torch.nn's own class; another factory's name builds its own model)
            got.model = _nn_model(layers, f"checkpoint {checkpoint!r}", got.sd if shapes else None)
        else:
            got.model = _build(factory, kwargs or {}, trusted=False, trust=names.trust, sd=got.sd if shapes else None)
    if saved_dev.startswith("cuda") and (dev is None or dev.type == "cpu"):
        notes.append(f"captured on {saved_dev}, replayed on cpu: autocast op lists differ between devices, "
                     "so the result may differ")
    torch_v = ck.get("torch_version")
    if torch_v and torch_v != torch.__version__:
        notes.append(f"captured with torch {torch_v}, replayed with {torch.__version__}")
    return got


def _same_name(given: str, saved: Any) -> bool:
    """``--model`` names the file's factory: the same name, or the same module (by file stem) and qualname
    (``model:Net`` recorded, ``/dir/model.py:Net`` confirmed)."""
    if not isinstance(saved, str):
        return False
    if given == saved:
        return True
    (gm, _, gq), (sm, _, sq) = given.rpartition(":"), saved.rpartition(":")
    # only a script path confirming a top-level module's name: /dir/model.py:Net for model:Net
    return gm.endswith(".py") and gq == sq and os.path.splitext(os.path.basename(gm))[0] == sm


def _read_plain_checkpoint(ck: Mapping[str, Any], loss: str | None) -> _Loaded:
    """A checkpoint not written by nanhunt: a model, a state_dict, or a dict holding one (and maybe the
    optimizer and scaler states)."""
    got = _Loaded(loss_path=loss)
    if isinstance(ck.get("model"), nn.Module):
        got.model = ck["model"]
    elif isinstance(ck.get("model"), Mapping):
        got.sd = ck["model"]
    elif isinstance(ck.get("state_dict"), Mapping):
        got.sd = ck["state_dict"]
    elif ck and all(isinstance(v, torch.Tensor) for v in ck.values()):
        got.sd = ck
    else:
        keys = ", ".join(list(map(str, ck))[:5])
        raise CommandError(f"checkpoint holds keys {keys}; expected a state_dict, {{'model': ...}} or {{'state_dict': ...}}")
    o = ck.get("optimizer")
    got.opt_sd = o if isinstance(o, Mapping) else None
    s = ck.get("scaler")
    got.scaler_sd = s if isinstance(s, Mapping) else None
    return got


def _ready_model(got: _Loaded, ck: Any, dev: torch.device, *, model_factory: str | None, train: bool | None,
                 notes: list[str], shard: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The model built (``--model`` trusted), its weights loaded, moved to ``dev`` and set to train/eval;
    with ``shard``, wrapped by it instead of loaded (the caller loads the shards)."""
    model = got.model
    if model_factory is not None:
        model = _build(model_factory, got.saved_kwargs, trusted=True)
    if model is None:
        raise CommandError("the checkpoint holds only weights; pass --model package.module:factory to build the model")
    if got.step_call == "training_step":
        _through_training_step(model)
    if got.sd is not None and shard is None:
        mapped = map_state_dict(got.sd, model, notes=notes)
        _check_dtypes(model, mapped)
        if isinstance(ck, Mapping) and "nanhunt_capture" in ck:
            _take_dtypes(model, mapped)  # a capture holds the live state: replay the weights in their dtype
        model.load_state_dict(mapped, strict=True)

    model.to(dev)
    model.train(got.training if train is None else train)
    if got.module_training is not None and (train is None or train == got.training):
        _restore_training(model, got.module_training)
    if shard is not None:
        shard(model)
    return model


def _loss_fn(loss_path: str, *, trusted: bool, trust: Sequence[str] = ()) -> Callable[..., Any]:
    """The loss callable ``loss_path`` names (trusted only when given as ``--loss``)."""
    obj = resolve(loss_path, what="loss function", trusted=trusted, trust=trust)
    if inspect.isclass(obj):  # a loss class is instantiated into a callable module
        try:
            obj = obj()
        except Exception as e:
            raise CommandError(f"loss {loss_path!r} is a class that must be constructible with no arguments, "
                               f"but {_first_line(e)}; pass a function (package.module:fn) or a class whose "
                               "arguments have defaults") from e
    return cast("Callable[..., Any]", obj)  # resolve() checked obj is callable


def _scaler(scaler_sd: Mapping[str, Any], dev: torch.device, notes: list[str]) -> torch.amp.GradScaler | None:
    """A GradScaler with the checkpoint's state; None for a disabled one."""
    if not scaler_sd:  # GradScaler(enabled=False).state_dict() is {}
        notes.append("the checkpoint's GradScaler was disabled (empty state): replayed without a scaler")
        return None
    scaler = torch.amp.GradScaler(dev.type)
    try:
        scaler.load_state_dict(dict(scaler_sd))
    except Exception as e:
        raise CommandError(f"the checkpoint's GradScaler state cannot be loaded ({_first_line(e)}); "
                           "pass --no-scaler to replay without it") from e
    return scaler


def _parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise CommandError(f"--device {device!r} is not a device torch knows; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {device} was given but no CUDA device is available here; use --device cpu")
    if dev.type == "meta":
        raise CommandError("--device meta holds no values to replay; use --device cpu or cuda")
    try:
        torch.empty(0, device=dev)  # a known type may still be missing here (mps on Linux, cuda:7 of 2 GPUs)
    except Exception as e:
        raise CommandError(f"--device {device} was given but no such device is available here; use --device cpu") from e
    return dev


def _is_batch_file(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "nanhunt_batch" in obj


def _capture_field(d: Mapping[str, Any], name: str, types: type, expected: str, where: str, fix: str, *,
                   required: bool = False) -> Any:
    """``d[name]`` if it is a ``types`` (or absent/None and not ``required``); else one error line."""
    value = d.get(name)
    if value is None and not required:
        return None
    if isinstance(value, types):
        return value
    what = "is missing" if name not in d else f"is of type {type(value).__name__}"
    raise CommandError(f"{where} is not a valid nanhunt capture: field {name!r} {what}, expected {expected}; {fix}")


def _batch_rng(bt: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    """The RNG state a nanhunt batch file holds: torch's generator and CUDA's (other keys are ignored)."""
    rng = _capture_field(bt, "rng", Mapping, "a dict of generator states", f"batch {path!r}",
                         "save the capture again (nanhunt.save_capture)")
    if rng is None:
        return None
    out = {k: v for k, v in rng.items() if k in ("torch", "cuda")}
    t = out.get("torch")
    cuda = out.get("cuda", [])
    if (t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8)) or not (
            isinstance(cuda, (list, tuple)) and all(isinstance(c, torch.Tensor) for c in cuda)):
        raise CommandError(f"batch {path!r} is not a valid nanhunt capture: field 'rng' does not hold generator "
                           "states (uint8 tensors); save the capture again (nanhunt.save_capture)")
    return out


def _build(path: str, kwargs: Mapping[str, Any], *, trusted: bool, trust: Sequence[str] = (),
           sd: Mapping[str, Any] | None = None) -> nn.Module:
    """The model ``path`` builds with ``kwargs``; with ``sd`` (the file's weights) and a name the file chose among
    torch.nn's own classes, built on the meta device first and checked against them."""
    factory = resolve(path, what="model factory", trusted=trusted, trust=trust)
    if sd is not None and not trusted and _names.torch_own(path.partition(":")[0], "model factory"):
        _check_on_meta(path, factory, kwargs, sd)
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise CommandError(f"model factory {path!r} raised {_first_line(e)}") from e
    if not isinstance(model, nn.Module):
        raise CommandError(f"model factory {path!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _check_on_meta(path: str, factory: Any, kwargs: Mapping[str, Any], sd: Mapping[str, Any]) -> None:
    """Build ``factory`` on the meta device (no memory) and check every parameter and buffer against the file's
    tensors: a 2 KB file naming ``Linear(25000, 25000)`` over a 4 x 4 weight would allocate 2.5 GB before
    ``load_state_dict`` found the shapes wrong. A ``device`` argument from the file is replaced by meta."""
    try:
        with torch.device("meta"):
            probe = factory(**({**kwargs, "device": "meta"} if "device" in kwargs else kwargs))
    except Exception as e:
        raise CommandError(f"model factory {path!r} raised {_first_line(e)}") from e
    if not isinstance(probe, nn.Module):
        raise CommandError(f"model factory {path!r} returned a {type(probe).__name__}, not an nn.Module")
    map_state_dict(sd, probe)  # every key and shape, one error line
    held = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
    given = sum(t.numel() for t in sd.values() if isinstance(t, torch.Tensor))
    if held > given:  # tensors outside the state dict (non-persistent buffers) the file cannot size
        raise CommandError(f"model factory {path!r} with the file's model_kwargs holds {held} values, more than the "
                           f"file's {given}; the file may be hostile; pass --model package.module:factory")


def _restore_training(model: nn.Module, flags: Mapping[str, Any]) -> None:
    """Set each module's own ``training`` flag as saved (older captures hold only the root's). The
    attribute is set, not ``train()`` called: that would recurse and reset the children again."""
    for name, m in model.named_modules():
        flag = flags.get(name)
        if isinstance(flag, bool):
            m.training = flag


def _check_dtypes(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """A floating tensor may load into a floating one of another width; any other mismatch would be
    cast silently by ``load_state_dict`` (int, bool or complex weights into float ones, float into int
    buffers) and change what the values mean."""
    own = model.state_dict(keep_vars=True)
    bad = [f"{k} ({_dtype_name(v)} in the checkpoint, {_dtype_name(own[k])} in the model)"
           for k, v in sd.items() if k in own and v.dtype != own[k].dtype
           and not (v.is_floating_point() and own[k].is_floating_point())]
    if bad:
        raise CommandError(f"checkpoint dtypes don't match the model: {_few(bad)}; nanhunt converts only between "
                           "floating dtypes — is --model the factory that built this checkpoint?")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _take_dtypes(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Give the model's floating parameters and buffers the dtypes of the saved ones, as ``model.half()``
    would: ``load_state_dict`` would cast a float16/bfloat16 model's weights to the factory's float32,
    and its low-precision batch would then meet float32 weights. Each tensor stays the same object
    (tied weights, ``requires_grad``); the optimizer is built on them afterwards."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            saved = sd.get(name)
            if saved is not None and saved.dtype != t.dtype and saved.is_floating_point() and t.is_floating_point():
                t.data = t.data.to(saved.dtype)


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str | None]]:
    """Each parameter group's parameters by their name in ``model`` (None: not the model's)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


def _build_optimizer(model: nn.Module, sd: Mapping[str, Any], cls_path: str | None,
                     names: list[Any] | None = None, *, trusted: bool = False,
                     trust: Sequence[str] = ()) -> torch.optim.Optimizer | None:
    """The optimizer, its groups holding the parameters they held when saved: by name when the capture
    says (decay / no-decay groups), else by position (older captures, plain checkpoints). ``trusted``: the
    class was given as ``--optimizer``."""
    if not cls_path:
        return None
    cls = resolve(cls_path, what="optimizer class", trusted=trusted, trust=trust)
    params = list(model.parameters())
    by_name = dict(model.named_parameters())
    saved_groups = sd.get("param_groups")
    if names is not None:
        if not (isinstance(saved_groups, (list, tuple)) and len(names) == len(saved_groups) and all(
                isinstance(g, list) and isinstance(sg, Mapping) and isinstance(sg.get("params"), (list, tuple))
                and len(g) == len(sg["params"]) for g, sg in zip(names, saved_groups))):
            raise CommandError("the checkpoint's optimizer_params do not match its optimizer's param_groups; "
                               "save the capture again")
        unknown = [n for g in names for n in g if not isinstance(n, str) or n not in by_name]
        if unknown:
            raise CommandError(f"the checkpoint's optimizer holds parameters the model does not have: {unknown[:3]!r}; "
                               "is --model the factory that built this checkpoint?")
        if len({n for g in names for n in g}) != sum(len(g) for g in names):
            raise CommandError("the checkpoint's optimizer names one parameter twice; save the capture again")
    # the state is keyed by these numbers: each must be one of the saved parameters, once
    _check_param_indices(sd, len(params) if names is None else sum(len(g) for g in names))
    groups = []
    try:
        for k, g in enumerate(sd["param_groups"]):
            hyper = {key: v for key, v in g.items() if key != "params"}
            held = [by_name[n] for n in names[k]] if names is not None else [params[i] for i in g["params"]]
            groups.append({"params": held, **hyper})
        opt = cls(groups)
        opt.load_state_dict(dict(sd))
    except Exception as e:
        raise CommandError(f"cannot rebuild the optimizer {cls_path}: {_first_line(e)}") from e
    return opt  # type: ignore[no-any-return]


def _check_param_indices(sd: Mapping[str, Any], n: int) -> None:
    """Each group's ``params`` must be indices of the model's parameters, each used once: a negative
    one would pick a parameter from the end, a repeated one would update it twice."""
    groups = sd.get("param_groups")
    if not isinstance(groups, (list, tuple)):
        return  # no groups to check: rebuilding reports it
    used: set[int] = set()
    for g, group in enumerate(groups):
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(ids, (list, tuple)):
            raise CommandError(f"the checkpoint's optimizer state is invalid: param_groups[{g}] has no list of "
                               "parameter indices; save the capture again")
        for i in ids:
            why = ("is not an index" if type(i) is not int else "is repeated" if i in used else
                   "is out of range" if not 0 <= i < n else None)
            if why:
                raise CommandError(f"the checkpoint's optimizer state is invalid: param_groups[{g}] names parameter "
                                   f"{i!r}, which {why} (the model has {n} parameters, 0..{n - 1}, each in one group); "
                                   "is --model the factory that built this checkpoint?")
            used.add(i)
