"""Rebuilding what a checkpoint holds: the model (factory or plain), the loss, the scaler, the optimizer, the batch's RNG; dtype and training-flag checks."""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from . import _names
from .._util._errors import InputError, first_line as _first_line
from .._util._text import dtype_name, escaped, few
from ._hf import _through_training_step
from ._construction import arguments
from ._lowp import LowpPlan, convert_float8, quantize_nf4
from ._resolve import resolve
from ._statedict import map_state_dict


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
    saved_init: Any = None  # the file's model_init (the model's constructor arguments), for the model you confirmed
    recorded_factory: Any = None  # the file's model_factory, which you confirmed
    lowp: LowpPlan | None = None  # float8 layers and NF4 weights to rebuild once the model is built and loaded


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
        raise InputError(f"checkpoint holds keys {keys}; expected a state_dict, {{'model': ...}} or {{'state_dict': ...}}")
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
        model = _build(model_factory, got.saved_kwargs, trusted=True, init=got.saved_init,
                       recorded=got.recorded_factory, sd=got.sd if shard is None else None)
    if model is None:
        raise InputError("the checkpoint holds only weights; pass --model package.module:factory to build the model")
    if got.step_call == "training_step":
        _through_training_step(model)
    if got.sd is not None and shard is None:
        mapped = map_state_dict(got.sd, model, notes=notes)
        _check_dtypes(model, mapped)
        if isinstance(ck, Mapping) and "nanhunt_capture" in ck:
            _take_dtypes(model, mapped)  # a capture holds the live state: replay the weights in their dtype
        model.load_state_dict(mapped, strict=True)
    if got.lowp is not None:  # converted as the step's model was: after its weights, before any sharding
        model = convert_float8(model, got.lowp, device=dev, notes=notes, where="the capture")

    model.to(dev)
    if got.lowp is not None and got.lowp.nf4:
        if shard is None:  # on its device: moving an NF4Tensor dequantizes it
            quantize_nf4(model, got.lowp, notes=notes, where="the capture")
        else:
            notes.append("the capture's NF4 weights are replayed dequantized: a sharded replay does not quantize "
                         "them again")
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
            raise InputError(f"loss {loss_path!r} is a class that must be constructible with no arguments, "
                               f"but {_first_line(e)}; pass a function (package.module:fn) or a class whose "
                               "arguments have defaults") from e
    return cast("Callable[..., Any]", obj)  # resolve() checked obj is callable


def _scaler(scaler_sd: Mapping[str, Any], dev: torch.device, notes: list[str]) -> torch.amp.GradScaler | None:
    """A GradScaler with the checkpoint's state; None for a disabled one."""
    if not scaler_sd:  # GradScaler(enabled=False).state_dict() is {}
        notes.append("the checkpoint's GradScaler was disabled (empty state): replayed without a scaler")
        return None
    why = scaler_state_problem(scaler_sd)
    if why is not None:
        raise InputError(f"the checkpoint's GradScaler state cannot be loaded ({why}); pass --no-scaler to replay "
                         "without it")
    scaler = torch.amp.GradScaler(dev.type)
    try:
        scaler.load_state_dict(dict(scaler_sd))
    except Exception as e:
        raise InputError(f"the checkpoint's GradScaler state cannot be loaded ({_first_line(e)}); "
                           "pass --no-scaler to replay without it") from e
    return scaler


_SCALER_NUMBERS = ("scale", "growth_factor", "backoff_factor")
_SCALER_COUNTS = ("growth_interval", "_growth_tracker")  # torch keeps the tracker in an int32 tensor


def scaler_state_problem(state: Mapping[str, Any]) -> str | None:
    """What of a GradScaler's (enabled) state_dict torch cannot use, or None. ``load_state_dict`` takes any
    value and the step fails on it later (``float('abc')`` as the scale is made a tensor): its scale and factors
    must be numbers, its interval and tracker counts an int32 holds."""
    for k in (*_SCALER_NUMBERS, *_SCALER_COUNTS):
        if k not in state:
            return f"it has no {k!r}"
        v = state[k]
        if k in _SCALER_NUMBERS and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return f"its {k!r} is {_value(v)}, not a number"
        if k in _SCALER_COUNTS and not (type(v) is int and 0 <= v < 2**31):
            return f"its {k!r} is {_value(v)}, not a count below 2**31"
    return None


def generator_state_problem(state: torch.Tensor, device: str = "cpu") -> str | None:
    """Why torch refuses ``state`` as the state of a generator on ``device`` (a right-sized tensor of bytes may
    still be no state: mt19937's is checked when set), or None; tried on a new generator, leaving torch's own as
    they are."""
    try:
        torch.Generator(device).set_state(state.clone())
    except (RuntimeError, TypeError, ValueError) as e:
        lines = str(e).strip().splitlines()
        return lines[0] if lines else type(e).__name__
    return None


def _value(v: Any) -> str:
    """A value read from a file, as a message quotes it: short, one line."""
    if type(v) is int:
        return str(v) if v.bit_length() <= 64 else f"an integer of {v.bit_length():,} bits"
    if isinstance(v, (str, float, bool)) or v is None:
        text = repr(v)
        return escaped(text if len(text) <= 40 else text[:37] + "...")
    return f"a {type(v).__name__}"


def _parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"--device {device!r} is not a device torch knows; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device} was given but no CUDA device is available here; use --device cpu")
    if dev.type == "meta":
        raise InputError("--device meta holds no values to replay; use --device cpu or cuda")
    try:
        torch.empty(0, device=dev)  # a known type may still be missing here (mps on Linux, cuda:7 of 2 GPUs)
    except Exception as e:
        raise InputError(f"--device {device} was given but no such device is available here; use --device cpu") from e
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
    raise InputError(f"{where} is not a valid nanhunt capture: field {name!r} {what}, expected {expected}; {fix}")


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
        raise InputError(f"batch {path!r} is not a valid nanhunt capture: field 'rng' does not hold generator "
                           "states (uint8 tensors); save the capture again (nanhunt.save_capture)")
    why = generator_state_problem(t) if t is not None else None
    if why is not None:
        raise InputError(f"batch {path!r} is not a valid nanhunt capture: field 'rng' holds a torch generator "
                         f"state that torch refuses ({why}); save the capture again (nanhunt.save_capture)")
    return out


def _build(path: str, kwargs: Mapping[str, Any], *, trusted: bool, trust: Sequence[str] = (),
           sd: Mapping[str, Any] | None = None, init: Any = None, recorded: Any = None) -> nn.Module:
    """The model ``path`` builds with ``kwargs``; with ``sd`` (the file's weights) and a name the file chose among
    torch.nn's own classes, built on the meta device first and checked against them. ``init``: the file's record
    of the constructor arguments of its model ``recorded`` (``path`` names it), used instead of ``kwargs`` and
    checked against ``sd`` (``_construction.arguments``)."""
    factory = resolve(path, what="model factory", trusted=trusted, trust=trust)
    args: list[Any] = []
    if init is not None:
        args, kwargs = arguments(init, factory, recorded, "the capture", sd)
    elif sd is not None and not trusted and _names.torch_own(path.partition(":")[0], "model factory"):
        _check_on_meta(path, factory, kwargs, sd)
    try:
        model = factory(*args, **kwargs)
    except Exception as e:
        raise InputError(f"model factory {path!r} raised {_first_line(e)}") from e
    if not isinstance(model, nn.Module):
        raise InputError(f"model factory {path!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _check_on_meta(path: str, factory: Any, kwargs: Mapping[str, Any], sd: Mapping[str, Any]) -> None:
    """Build ``factory`` on the meta device (no memory) and check every parameter and buffer against the file's
    tensors: a 2 KB file naming ``Linear(25000, 25000)`` over a 4 x 4 weight would allocate 2.5 GB before
    ``load_state_dict`` found the shapes wrong. A ``device`` argument from the file is replaced by meta."""
    try:
        with torch.device("meta"):
            probe = factory(**({**kwargs, "device": "meta"} if "device" in kwargs else kwargs))
    except Exception as e:
        raise InputError(f"model factory {path!r} raised {_first_line(e)}") from e
    if not isinstance(probe, nn.Module):
        raise InputError(f"model factory {path!r} returned a {type(probe).__name__}, not an nn.Module")
    map_state_dict(sd, probe)  # every key and shape, one error line
    held = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
    given = sum(t.numel() for t in sd.values() if isinstance(t, torch.Tensor))
    if held > given:  # tensors outside the state dict (non-persistent buffers) the file cannot size
        raise InputError(f"model factory {path!r} with the file's model_kwargs holds {held} values, more than the "
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
    bad = [f"{k} ({dtype_name(v.dtype)} in the checkpoint, {dtype_name(own[k].dtype)} in the model)"
           for k, v in sd.items() if k in own and v.dtype != own[k].dtype
           and not (v.is_floating_point() and own[k].is_floating_point())]
    if bad:
        raise InputError(f"checkpoint dtypes don't match the model: {few(bad)}; nanhunt converts only between "
                           "floating dtypes — is --model the factory that built this checkpoint?")


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
            raise InputError("the checkpoint's optimizer_params do not match its optimizer's param_groups; "
                               "save the capture again")
        unknown = [n for g in names for n in g if not isinstance(n, str) or n not in by_name]
        if unknown:
            raise InputError(f"the checkpoint's optimizer holds parameters the model does not have: {unknown[:3]!r}; "
                               "is --model the factory that built this checkpoint?")
        if len({n for g in names for n in g}) != sum(len(g) for g in names):
            raise InputError("the checkpoint's optimizer names one parameter twice; save the capture again")
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
        raise InputError(f"cannot rebuild the optimizer {cls_path}: {_first_line(e)}") from e
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
            raise InputError(f"the checkpoint's optimizer state is invalid: param_groups[{g}] has no list of "
                               "parameter indices; save the capture again")
        for i in ids:
            why = ("is not an index" if type(i) is not int else "is repeated" if i in used else
                   "is out of range" if not 0 <= i < n else None)
            if why:
                raise InputError(f"the checkpoint's optimizer state is invalid: param_groups[{g}] names parameter "
                                   f"{i!r}, which {why} (the model has {n} parameters, 0..{n - 1}, each in one group); "
                                   "is --model the factory that built this checkpoint?")
            used.add(i)
