"""Saving and safely loading what a step needs: model, optimizer, scaler, batch, RNG.

Everything is loaded with ``torch.load(..., weights_only=True)``: a checkpoint
attached to a bug ticket is untrusted input, and a full pickle executes code.
The pickled-``nn.Module`` path exists only behind an explicit ``trust_pickle``.
Names of callables stored in a file (model factory, loss, optimizer class) are suggestions
(``resolve``): only torch.nn's own module classes and losses and torch.optim's optimizers are
imported and built unconfirmed (a transformers model is rebuilt from its config alone, ``_hf_model``);
anything else is confirmed on the command line (``--model``/``--loss``/``--optimizer``) or by a
package prefix you trust (``--trust-names``, ``NANHUNT_TRUST_NAMES``). How the step was compiled is read the same
way: torch's own backends by name, and of their settings only those that change nothing but the numbers, unless
you confirm the file's (``--trust-compile-options``; :func:`nanhunt._util._compiled.settle`).
"""

from __future__ import annotations

import json
import keyword
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..distributed import _dcp
from . import _hf_checkpoint, _names
from .._util._compiled import TORCH_BACKENDS, CompileSpec, read_record, settle
from .._util._errors import InputError
from .._util._safeload import load_file
from .._util._text import escaped, few
from ..step.step import Step, rng_state, set_rng_state, split_batch
from ._event import EventFile, read_event
from ._options import LoadOptions
from ._build import _Loaded, _batch_rng, _build, _build_optimizer, _capture_field, _is_batch_file, _loss_fn, _parse_device, _read_plain_checkpoint, _ready_model, _same_name, _scaler
from ._construction import loss_at_of
from ._hf import _hf_model
from ._lowp import read_plan
from ._nn_model import nn_model, nn_spec
from ._resolve import callable_path, resolve
from ._statedict import map_state_dict, parse_dtype
from ._write import CAPTURE_FORMAT, capture_record, save_capture, to_device, unwrap_model

__all__ = [
    "save_capture",
    "load_capture",
    "load_capture_dir",
    "load_replay",
    "Loaded",
    "LoadOptions",
    "given_spec",
    "unwrap_model",
    "load_file",
    "resolve",
    "callable_path",
    "load_step",
    "map_state_dict",
    "split_batch",
    "rng_state",
    "set_rng_state",
    "capture_record",
    "to_device",
    "nn_spec",
    "nn_model",
]


def load_capture(checkpoint: str | os.PathLike[str], batch: str | os.PathLike[str], **options: Any) -> Step:
    """A capture as ``nanhunt replay`` would use it, to poke at in a notebook: a :class:`~nanhunt.step.step.Step`
    holding the model (weights loaded), inputs, targets, loss, optimizer, GradScaler, dtype, device and RNG.

    Same safety rules and options as the command (``model_factory=``, ``loss=``, ``optimizer=``,
    ``trust_names=``, ``device=``, ``dtype=``, ``no_scaler=``, ``train=``, ``trust_pickle=``, ``compile=``,
    ``trust_compile_options=``). Run it as the replay does::

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
    compile: str | None = None,
    trust_compile_options: bool = False,
    eager: bool = False,
) -> Step:
    """Everything ``nanhunt replay`` needs, from the files and the flags; nothing is written. ``eager``: the step
    will run eagerly only (a compiled capture is said so, its settings not judged)."""
    return _load_files(checkpoint, batch, LoadOptions(
        model_factory=model_factory, loss=loss, optimizer=optimizer, trust_names=tuple(trust_names), device=device,
        dtype=dtype, no_scaler=no_scaler, train=train, trust_pickle=trust_pickle, compile=compile,
        trust_compile_options=trust_compile_options, eager=eager)).step


@dataclass(frozen=True)
class Loaded:
    """A capture loaded for its replay: the :class:`~nanhunt.step.step.Step`, complete, and what the Guard's event
    file beside the capture gave (None: there is none)."""

    step: Step
    event: EventFile | None = None


def load_replay(checkpoint: str, batch: str | None, options: LoadOptions, *, rank: int | None = None,
                shard: Callable[[nn.Module], None] | None = None) -> Loaded:
    """What ``nanhunt replay CHECKPOINT BATCH`` replays, or with no ``batch`` ``nanhunt replay DIR``: the capture
    directory ``checkpoint``, rank ``rank``'s batch (``shard``: see :func:`load_capture_dir`)."""
    if batch is None:
        return _load_dir(checkpoint, rank, options, shard)
    if rank is not None:
        raise InputError("--rank picks a batch of a capture directory; with a checkpoint and a batch file, "
                           "leave it out")
    return _load_files(checkpoint, batch, options)


def _load_files(checkpoint: str, batch: str, options: LoadOptions) -> Loaded:
    dev = _parse_device(options.device) if options.device else None
    notes: list[str] = []
    rng = None
    if _hf_checkpoint.is_checkpoint_dir(checkpoint):  # a Trainer's checkpoint-N/: read whole, its model loaded
        ck, rng = _hf_checkpoint.read(checkpoint, model_factory=options.model_factory, optimizer=options.optimizer,
                                      dtype=options.dtype, no_scaler=options.no_scaler,
                                      trust_pickle=options.trust_pickle, notes=notes)
    else:
        ck = load_file(checkpoint, what="checkpoint", trust_pickle=options.trust_pickle)
    bt = load_file(batch, what="batch", trust_pickle=options.trust_pickle)
    _check_not_batch(ck, bt, checkpoint, batch)
    with _names.recorded(ck, f"checkpoint {checkpoint!r}", notes):  # a script name runs with its recorded argv
        step = _step_of(ck, bt, checkpoint, batch, dev=dev, options=options, notes=notes, rng=rng)
    # step{N}[-rank{R}]-checkpoint.pt: the Guard's event beside it
    event = checkpoint[: -len("checkpoint.pt")] + "event.json" if checkpoint.endswith("checkpoint.pt") else None
    return Loaded(step, read_event(event) if event is not None else None)


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

    ``shard`` (the distributed replay, ``nanhunt.hunt._dist_replay``): no shard is read here; the model is built,
    moved and handed to ``shard``, which wraps it as the capture was, and the optimizer is built on its
    parameters with the capture's groups and hyperparameters but no state: the caller loads the shards into
    both (``_dcp.load_sharded``)."""
    return _load_dir(os.fspath(path), rank, LoadOptions(
        model_factory=model_factory, loss=loss, optimizer=optimizer, trust_names=tuple(trust_names), device=device,
        dtype=dtype, no_scaler=no_scaler, train=train, trust_pickle=trust_pickle), shard).step


def _load_dir(path: str, rank: int | None, options: LoadOptions, shard: Callable[[nn.Module], None] | None) -> Loaded:
    if _hf_checkpoint.is_checkpoint_dir(path):
        raise InputError(f"{path!r} is a Trainer checkpoint directory, which replays with the batch of the step to "
                           "replay: nanhunt replay DIR batch.pt (a .pt of the model's keyword arguments, labels "
                           "included)")
    if not os.path.isdir(path):
        raise InputError(f"{path!r} is not a capture directory" + (
            "; a checkpoint file needs its batch file too: nanhunt replay CHECKPOINT BATCH" if os.path.isfile(path)
            else ": it does not exist; check the path"))
    man = _dcp.read_manifest(path)
    r = _dcp.pick_rank(man, rank, path)
    dev = _parse_device(options.device) if options.device else None
    where = f"capture directory {path!r}"
    with _names.recorded(man, where, []):  # (what a script you confirm runs with is said in the question)
        _confirm_all(man, options)  # before reading megabytes of shards
    state = _dcp.load_state(os.path.join(path, _dcp.STATE), tensors=shard is None)
    model_sd = {} if shard is not None else state.get("model")
    if not isinstance(model_sd, dict) or not all(isinstance(v, torch.Tensor) for v in model_sd.values()):
        raise InputError(f"{where}: its state holds no model state_dict; the capture is damaged")
    ck: dict[str, Any] = {k: v for k, v in man.items() if k not in ("model", "optimizer", "optimizer_params")}
    ck.update(nanhunt_capture=CAPTURE_FORMAT, model=model_sd, optimizer=None, optimizer_params=None)
    if state.get("optimizer") is not None:
        ck["optimizer"], ck["optimizer_params"] = _dcp.optimizer_by_index(state["optimizer"], where)
        if shard is not None:
            ck["optimizer"]["state"] = {}  # loaded into the sharded optimizer by the caller
    batch = _dcp.not_linked(os.path.join(path, _dcp.batch_file(r)), f"{where}: its {_dcp.batch_file(r)}")
    bt = load_file(batch, what="batch", trust_pickle=options.trust_pickle)
    _check_not_batch(ck, bt, path, batch)
    seen = man["ranks_seen"]
    why = ("the first rank that saw the failure" if seen and r == min(seen) else
           f"the failure was seen by rank(s) {', '.join(map(str, seen))}" if seen else "no rank saw it")
    note = f"capture of {man['world_size']} ranks ({man['wrapper']}): rank {r}'s batch replayed ({why})"
    notes = [note]
    with _names.recorded(ck, where, notes):  # a script's names: run with the argv it recorded
        step = _step_of(ck, bt, path, batch, dev=dev, options=options, notes=notes, shard=shard)
    return Loaded(step, read_event(os.path.join(path, f"event-rank{r}.json")))


def _step_of(ck: Any, bt: Any, checkpoint: str, batch: str, *, dev: torch.device | None, options: LoadOptions,
             notes: list[str], rng: Mapping[str, Any] | None = None,
             shard: Callable[[nn.Module], None] | None = None) -> Step:
    """The Step of a loaded checkpoint and batch (two files, or the parts of a capture directory); ``rng``: the
    checkpoint's RNG state, for a batch file without its own; ``shard``: see :func:`load_capture_dir`."""
    model_factory, loss = options.model_factory, options.loss
    if isinstance(ck, _Loaded):  # a Trainer checkpoint directory: its model built and loaded (--model too)
        got, model_factory = ck, None
        got.loss_path = loss
    elif isinstance(ck, nn.Module):
        got = _Loaded(model=ck, loss_path=loss)
    elif isinstance(ck, Mapping) and "nanhunt_capture" in ck:
        _confirm_all(ck, options)
        # sharded, the weights are read into the wrapped model by the caller: none here to check shapes against
        got = _read_capture(ck, checkpoint, options=options, dev=dev, notes=notes, shapes=shard is None)
    elif isinstance(ck, Mapping):
        got = _read_plain_checkpoint(ck, loss)
    else:
        raise InputError(f"checkpoint holds a {type(ck).__name__}; expected a state_dict or a dict with 'model'")

    if dev is None:
        dev = torch.device("cpu")
    model = _ready_model(got, ck, dev, model_factory=model_factory, train=options.train, notes=notes, shard=shard)

    if isinstance(bt, nn.Module):
        raise InputError("the batch file holds a model, not a batch")
    inputs, targets = split_batch(bt)
    own_rng = _batch_rng(bt, batch) if isinstance(bt, Mapping) and "nanhunt_batch" in bt else None  # first
    inputs, targets = to_device(inputs, dev), to_device(targets, dev)

    loss_fn = _loss_fn(got.loss_path, trusted=loss is not None, trust=options.trust) if got.loss_path else None

    optimizer = None
    if got.opt_sd is not None:
        optimizer = _build_optimizer(model, got.opt_sd, options.optimizer or got.opt_class, got.opt_names,
                                     trusted=options.optimizer is not None, trust=options.trust)
        if optimizer is None:
            notes.append("optimizer state present but its class is unknown: phase update not replayed")
    scaler = _scaler(got.scaler_sd, dev, notes) if got.scaler_sd is not None and not options.no_scaler else None
    dt = parse_dtype(options.dtype or str(got.autocast.get("dtype", "float16")))
    compiled = _compiled(ck if isinstance(ck, Mapping) and "nanhunt_capture" in ck else {}, checkpoint, options,
                         notes)
    # the model's own loss, an element of what it returns (logits, loss): the one the capture recorded
    loss_at = loss_at_of(ck, f"checkpoint {checkpoint!r}") if loss_fn is None and isinstance(ck, Mapping) else None
    return Step(model, inputs, targets, loss_fn=loss_fn, dtype=dt, device_type=dev.type, scaler=scaler,
                optimizer=optimizer, rng=own_rng if own_rng is not None else rng, compile_spec=compiled,
                notes=tuple(notes), snapshot=options.snapshot, loss_at=loss_at)


def _compiled(ck: Mapping[str, Any], checkpoint: str, options: LoadOptions, notes: list[str]) -> CompileSpec | None:
    """How the step is replayed compiled: as ``--compile`` says, else as the capture recorded when by one of
    torch's own backends, with the settings :func:`settle` lets through (a backend the file names otherwise, and
    the settings left out, are said in a note with the flag that confirms them); None: eager only."""
    try:
        recorded = read_record(ck.get("compile"))
    except ValueError as e:
        raise InputError(f"checkpoint {checkpoint!r} is not a valid nanhunt capture: {e}; save the capture "
                           "again (nanhunt.save_capture)") from e
    if options.eager:
        if recorded is not None:
            notes.append(f"the step ran compiled (backend {_shown_name(recorded.backend)!r}); it is run eagerly here")
        return None
    if options.compile is not None:
        spec = given_spec(options.compile, recorded, trusted=options.trust_compile_options)
        if recorded is not None and recorded.backend == spec.backend and not options.trust_compile_options \
                and (recorded.options or recorded.mode is not None):
            notes.append(f"--compile {spec.backend} replays with torch's defaults, not the capture's compile "
                         "settings: pass --trust-compile-options to use them as recorded")
        return spec
    if recorded is None:
        return None
    if recorded.backend not in TORCH_BACKENDS:
        name = _shown_name(recorded.backend)
        notes.append(f"the step ran compiled by backend {name!r}, a name from the file: it is replayed eager only; "
                     f"pass --compile {name} to replay it compiled too (imports it)")
        return None
    used, left = settle(recorded, trusted=options.trust_compile_options)
    if left:
        notes.append(f"the capture's compile settings {few(left, 4)} are not used (unconfirmed, only those that "
                     "change nothing but the numbers are; others can name a program, a path or a compiler flag): "
                     "pass --trust-compile-options to use them as recorded")
    return used


def _shown_name(name: str) -> str:
    """A backend's name from a file, for one line: escaped and cut short."""
    shown = escaped(name)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def given_spec(name: str, recorded: CompileSpec | None, *, trusted: bool = False) -> CompileSpec:
    """The backend ``--compile NAME`` names: one of torch's own, or ``package.module:function`` imported (you gave
    the name: that is the confirmation). The recorded mode and options come with it only when it is the recorded
    backend and ``trusted`` (``--trust-compile-options``): a backend you type is used with torch's defaults, the
    recorded dynamic flag (which changes only the numbers) kept."""
    if name not in TORCH_BACKENDS and ":" not in name:
        raise InputError(f"--compile {name}: name one of torch's backends ({', '.join(TORCH_BACKENDS)}) or your "
                           "own as package.module:function")
    fn = None if name in TORCH_BACKENDS else resolve(name, what="compile backend", trusted=True)
    if recorded is not None and recorded.backend == name and trusted:
        return replace(recorded, fn=fn)
    return CompileSpec(name, dynamic=None if recorded is None else recorded.dynamic, fn=fn)


def _confirm_all(ck: Mapping[str, Any], names: LoadOptions) -> None:
    """Every name of the file that the replay will use unconfirmed, judged before any is imported or called: one
    error naming all the confirmations they need, not one per run."""
    pending_names: list[tuple[str, Any]] = []
    if names.model_factory is None and not isinstance(ck.get("hf_model"), Mapping):
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
            except InputError:
                pass  # refused outright, or not importable: said when the step is built
    if len(pending) == 1:
        raise pending[0]
    if pending:
        listed = " and ".join(f"{e.what} {e.path!r}" for e in pending)
        flags = " ".join(f"{e.flag} {e.path}" for e in pending)
        raise InputError(f"the file names {listed}, which nanhunt imports and calls only if you confirm them "
                           f"(your own code or another library's, not torch's own); if you trust them, pass {flags}"
                           f"{_names.confirming(e.path for e in pending)}")


def _check_not_batch(ck: Any, bt: Any, checkpoint: str, batch: str) -> None:
    """Refuse a nanhunt batch file given as the checkpoint (or the two files swapped)."""
    if _is_batch_file(ck) and isinstance(bt, Mapping) and "nanhunt_capture" in bt:
        raise InputError(f"these look swapped: {checkpoint!r} is a nanhunt batch and {batch!r} a checkpoint; "
                           f"give the checkpoint first: nanhunt replay {batch} {checkpoint}")
    if _is_batch_file(ck):
        raise InputError(f"checkpoint {checkpoint!r} is a nanhunt batch file, not a checkpoint; give the "
                           "checkpoint.pt written beside it first")


def _read_capture(ck: Mapping[str, Any], checkpoint: str, *, options: LoadOptions, dev: torch.device | None,
                  notes: list[str], shapes: bool = True) -> _Loaded:
    """The fields of a nanhunt capture, each checked; the model built from the file's factory (untrusted)
    unless ``--model`` names one; with ``shapes``, checked against the file's weights before it is allocated."""
    model_factory, loss = options.model_factory, options.loss
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
    got.lowp = read_plan(ck, f"checkpoint {checkpoint!r}")  # before anything is built: torchao's float8, NF4
    saved_dev = str(ck.get("device", "cpu"))
    got.step_call = checked("step_call", str, "'training_step' or null", again)
    if got.step_call not in (None, "training_step"):
        raise InputError(f"checkpoint {checkpoint!r} is not a valid nanhunt capture: field 'step_call' is "
                           f"{got.step_call!r}, expected 'training_step' or null; {again}")
    if model_factory is not None:  # a factory you named is called with the file's arguments if it is the file's
        kwargs = ck.get("model_kwargs")
        if _same_name(model_factory, ck.get("model_factory")) and isinstance(kwargs, Mapping):
            got.saved_kwargs = dict(kwargs)
            got.saved_init, got.recorded_factory = ck.get("model_init"), ck.get("model_factory")  # how it was built
    else:
        factory = checked("model_factory", str, "'package.module:factory'", "pass --model package.module:factory",
                          required=True)
        kwargs = checked("model_kwargs", Mapping, "a dict of keyword arguments", "pass --model package.module:factory")
        hf = checked("hf_model", Mapping, "a transformers model's class and JSON config, or null",
                     "pass --model package.module:factory")
        layers = checked("nn_model", Mapping, "torch.nn layers' classes and arguments, or null",
                         "pass --model package.module:factory")
        if hf is not None:
            # its size checked against the capture's weights before it is built (a PEFT model's adapters are
            # not in the config: the names are checked when the weights are loaded)
            weights = {k: (t.dtype, tuple(t.shape)) for k, t in got.sd.items() if isinstance(t, torch.Tensor)}
            got.model = _hf_model(hf, f"checkpoint {checkpoint!r}", notes, weights=weights if shapes else None,
                                  exact=False)
        elif layers is not None and _names.torch_own(factory.partition(":")[0], "model factory"):
            # (written only for a model of torch.nn's own class; another factory's name builds its own model)
            got.model = nn_model(layers, f"checkpoint {checkpoint!r}", got.sd if shapes else None)
        else:
            trusted = _names.trusted_by(factory.partition(":")[0], options.trust)  # a package you trust: its arguments
            got.model = _build(factory, kwargs or {}, trusted=False, trust=options.trust, sd=got.sd if shapes else None,
                               init=ck.get("model_init") if trusted else None, recorded=factory)
    if saved_dev.startswith("cuda") and (dev is None or dev.type == "cpu"):
        notes.append(f"captured on {saved_dev}, replayed on cpu: autocast op lists differ between devices, "
                     "so the result may differ")
    torch_v = ck.get("torch_version")
    if torch_v and torch_v != torch.__version__:
        notes.append(f"captured with torch {torch_v}, replayed with {torch.__version__}")
    return got


