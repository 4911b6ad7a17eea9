"""A Hugging Face Trainer checkpoint directory (``checkpoint-N/``), replayed as the Trainer left it.

The model is rebuilt from ``config.json`` (a class of transformers, built by ``_hf._hf_model``'s rules: nothing
fetched, no remote code), its layers counted against the weights' tensors, then built on the meta device to
check it against the weights' header, then for real with the weights of ``model.safetensors`` (or the shards
its ``model.safetensors.index.json`` names) in their dtype.
``optimizer.pt`` (a torch optimizer's state_dict, numbered over the Trainer's decay and no-decay groups) comes
back by parameter name; ``scaler.pt`` is a GradScaler's state, ``rng_state.pth`` the generators'. The .pt files
are read weights-only. ``training_args.bin`` is a pickle of arbitrary objects: it is read with every global it
names made inert (:mod:`._training_args`), for the precision the run used (fp16, bf16) and its learning-rate
settings; the optimizer's class it names is assumed (AdamW) and said in the step's notes, or given on the command
line.
``scheduler.pt`` is not needed: the learning rate of the next step is already in the optimizer's groups.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from .._util._errors import InputError, first_line as _first_line
from .._util._json import read_json
from .._util._read import own_file
from ._training_args import TRAINING_ARGS, read_training_args
from .._util._safeload import load_file
from .._util._safetensors import load_safetensors, safetensors_header
from ._build import _build, _check_dtypes, _Loaded, _take_dtypes, generator_state_problem, scaler_state_problem
from ._hf import _hf_model, _shared
from ._resolve import callable_path
from .._util._text import dtype_name, few as _few
from ._statedict import map_state_dict

__all__ = ["is_checkpoint_dir", "read"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
OPTIMIZER = "optimizer.pt"
SCALER = "scaler.pt"
RNG = "rng_state.pth"
_RANK0_RNG = "rng_state_0.pth"
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_FSDP_SHARDS = "pytorch_model_fsdp_0"  # accelerate's SHARDED_STATE_DICT: a DCP directory
_ADAMW = "torch.optim:AdamW"  # transformers' default optimizer (adamw_torch, adamw_torch_fused)
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*")


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding a transformers ``config.json``: a Trainer checkpoint, or a ``save_pretrained`` one (a
    ``config.json`` that is no regular file, a link, is refused when it is read)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, CONFIG))


def read(path: str, *, model_factory: str | None, optimizer: str | None, dtype: str | None, no_scaler: bool,
         trust_pickle: bool, notes: list[str]) -> tuple[_Loaded, dict[str, Any] | None]:
    """What the checkpoint holds (its model built and loaded, ``model_factory`` building it instead of the config
    when given), and the RNG state the step starts from (None: none saved)."""
    where = f"Trainer checkpoint {path!r}"
    files = _weight_files(path, where)
    header: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file, keys in files.items():
        held = safetensors_header(file, what=f"{where}: its weights")
        missing = [k for k in keys if k not in held]
        if missing:
            raise InputError(f"{where}: its {INDEX} puts {_few([_quoted(k) for k in missing])} in "
                               f"{_quoted(os.path.basename(file))}, which does not hold it; the checkpoint is "
                               "incomplete or damaged")
        header.update((k, held[k]) for k in (keys or held))
    # a factory you named is your own code, built as with any checkpoint; the config's class is checked first
    model = _build(model_factory, {}, trusted=True) if model_factory is not None else _from_config(path, where,
                                                                                                  header, notes)
    sd: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        tensors = load_safetensors(file, what=f"{where}: its weights")
        sd.update((k, tensors[k]) for k in (keys or tensors))
        del tensors
    _shared(sd, model)
    mapped = map_state_dict(sd, model, notes=notes)
    _check_dtypes(model, mapped)
    _take_dtypes(model, mapped)  # the weights as the run held them: a bfloat16 model stays bfloat16
    model.load_state_dict(mapped, strict=True)
    del sd, mapped

    got = _Loaded(model=model)
    opt_file = _file(path, OPTIMIZER, where)
    if opt_file is None:
        notes.append(f"{where} holds no {OPTIMIZER}: phase update not replayed")
    else:
        opt_sd = _mapping(load_file(opt_file, what=f"{where}: its {OPTIMIZER}", trust_pickle=trust_pickle),
                          OPTIMIZER, "an optimizer's state_dict", where)
        got.opt_names = _group_names(model, opt_sd, where, notes)
        if got.opt_names is not None:  # (else numbered over groups nanhunt cannot name: not replayed, said)
            got.opt_sd, got.opt_class = opt_sd, optimizer or _ADAMW
        if optimizer is None and got.opt_names is not None:
            _check_adamw(opt_sd, where)
            notes.append(f"{OPTIMIZER} replayed as torch.optim.AdamW, the Trainer's default, with the "
                         "hyper-parameters it saved (training_args.bin, which names the optimizer, is a pickle "
                         "nanhunt does not read); pass --optimizer package.module:Class if the run used another")
    scaler_file = _file(path, SCALER, where)
    if scaler_file is not None and not no_scaler:
        got.scaler_sd = _mapping(load_file(scaler_file, what=f"{where}: its {SCALER}", trust_pickle=trust_pickle),
                                 SCALER, "a GradScaler's state_dict", where)
        why = scaler_state_problem(got.scaler_sd) if got.scaler_sd else None  # ({}: a disabled scaler's)
        if why is not None:
            raise InputError(f"{where}: its {SCALER} holds a GradScaler state torch cannot use ({why}): the file "
                             "is damaged; delete it, or pass --no-scaler to replay without it")
    rng = _rng(path, where, trust_pickle, notes)
    # last: a checkpoint that does not say its precision is asked about only once every file it holds was judged
    got.autocast = {"dtype": _autocast(path, [d for d, _ in header.values()], scaler=scaler_file is not None,
                                       given=dtype, where=where, notes=notes)}
    return got, rng


# ------------------------------------------------------------------ weights
def _weight_files(path: str, where: str) -> dict[str, list[str]]:
    """The weight files to read, each with the tensors to take from it ([]: all): ``model.safetensors``, or the
    shards ``model.safetensors.index.json`` names, each a plain file name inside the directory."""
    single = _file(path, WEIGHTS, where)
    if single is not None:
        return {single: []}
    index = _file(path, INDEX, where)
    if index is None:
        if any(os.path.lexists(os.path.join(path, p)) for p in _PICKLED_WEIGHTS):
            raise InputError(f"{where} holds its weights as pytorch_model.bin (a pickle), not {WEIGHTS}; save the "
                               "model again with save_pretrained (safetensors, its default), or give that file as "
                               "the checkpoint with --model package.module:factory")
        if os.path.isdir(os.path.join(path, _FSDP_SHARDS)):
            raise InputError(f"{where} holds its weights as FSDP shards ({_FSDP_SHARDS}/), not {WEIGHTS}; merge "
                               f"them into one with accelerate merge-weights {os.path.join(path, _FSDP_SHARDS)} {path} "
                               "(it unpickles the shards' metadata: only for a checkpoint you trust), or save with "
                               "fsdp_state_dict_type FULL_STATE_DICT")
        if glob.glob(os.path.join(glob.escape(path), "global_step*")):
            raise InputError(f"{where} holds its weights as DeepSpeed ZeRO partitions (global_step*/), not "
                               f"{WEIGHTS}; gather them into one with python -m deepspeed.utils.zero_to_fp32 {path} "
                               f"{path} --safe_serialization (it unpickles the partitions: only for a checkpoint you "
                               "trust), or set stage3_gather_16bit_weights_on_model_save")
        raise InputError(f"{where} holds no {WEIGHTS} nor {INDEX}; is the checkpoint complete?")
    fix = f"the checkpoint is damaged; save it again (save_pretrained writes {INDEX} with its shards)"
    doc = read_json(index, what=f"a safetensors index ({INDEX})", fix=fix, label=f"{where}: its {INDEX}")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise InputError(f"{where}: its {INDEX} has no weight_map (each tensor's name -> its shard's file name); "
                           f"{fix}")
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if (os.path.basename(shard) != shard or shard in (".", "..") or "\\" in shard or "\x00" in shard
                or not shard.endswith(".safetensors")):
            raise InputError(f"{where}: its {INDEX} names {_quoted(shard)} as a shard, which is not the name of a "
                               ".safetensors file inside the checkpoint; nanhunt reads no other file")
        shards.setdefault(shard, []).append(key)
    out: dict[str, list[str]] = {}
    for shard, keys in shards.items():
        found = _file(path, shard, where)
        if found is None:
            raise InputError(f"{where}: its {INDEX} names the shard {_quoted(shard)}, which is not there; copy the "
                               "whole checkpoint directory")
        out[found] = keys
    return out


def _from_config(path: str, where: str, header: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 notes: list[str]) -> nn.Module:
    """The model ``config.json`` describes, checked against the weights' names and shapes before it is built
    (``_hf._fits``)."""
    spec, _ = _spec(path, where)
    return _hf_model(spec, where, notes, weights=header, config_label=f"its {CONFIG}")


def _spec(path: str, where: str) -> tuple[dict[str, Any], Any]:
    """``config.json`` as ``_hf_model`` takes a capture's model (the transformers class its ``architectures``
    names, the config's JSON text, and transformers' own choice of attention kernel), and that class."""
    fix = "pass --model package.module:factory"
    file = _file(path, CONFIG, where)
    if file is None:
        raise InputError(f"{where} holds no {CONFIG}; {fix}")
    config = read_json(file, what="a model config", fix=fix, label=f"{where}: its {CONFIG}")
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)
            and _CLASS_NAME.fullmatch(archs[0])):
        raise InputError(f"{where}: its {CONFIG} names no model class (architectures: one transformers class "
                           f"name); {fix}")
    try:
        import transformers
    except ImportError as e:
        raise InputError(f"{where} is a transformers model: install transformers to rebuild it, or {fix}") from e
    try:
        cls = getattr(transformers, archs[0])  # the package's own export of that name, or none
    except Exception as e:
        raise InputError(f"{where}: its {CONFIG} names {archs[0]!r}, which transformers "
                           f"{transformers.__version__} does not have ({_first_line(e)}); {fix}") from e
    return {"class": callable_path(cls), "config": json.dumps(config), "attn_implementation": None}, cls


# ------------------------------------------------------------ the rest of the state
def _group_names(model: nn.Module, opt_sd: Mapping[str, Any], where: str, notes: list[str]) -> list[Any] | None:
    """Each saved parameter group's parameters by name, as the Trainer made them: the parameters weight decay
    applies to, then the others (transformers' own rule, ``Trainer.get_decay_parameter_names``), each in the
    model's order; one group of all of them for an optimizer built on ``model.parameters()``. None (with a note)
    when the saved groups are neither."""
    groups = opt_sd.get("param_groups")
    if not (isinstance(groups, Sequence) and all(isinstance(g, Mapping) and isinstance(g.get("params"), Sequence)
                                                 for g in groups)):
        raise InputError(f"{where}: its {OPTIMIZER} is not an optimizer's state_dict (no param_groups with their "
                           "params); pass the checkpoint without it")
    sizes = [len(g["params"]) for g in groups]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(cast(Trainer, None), model))  # it reads the model alone
    split = [[n for n in trained if n in decay], [n for n in trained if n not in decay]]
    if sizes == [len(s) for s in split]:
        return split
    if sizes == [len(trained)]:
        return [trained]
    notes.append(f"{where}: the groups of its {OPTIMIZER} ({'/'.join(map(str, sizes))} parameters) are not the "
                 f"Trainer's ({len(split[0])} with weight decay, {len(split[1])} without): phase update not replayed")
    return None


def _check_adamw(opt_sd: Mapping[str, Any], where: str) -> None:
    """Assumed AdamW (no ``--optimizer``): refuse a state that is not Adam's moments."""
    state = opt_sd.get("state")
    keys = sorted({str(k) for s in state.values() if isinstance(s, Mapping) for k in s}) if isinstance(
        state, Mapping) else []
    if not isinstance(state, Mapping) or not all(isinstance(s, Mapping) and "exp_avg" in s and "exp_avg_sq" in s
                                                 for s in state.values()):
        raise InputError(f"{where}: its {OPTIMIZER} holds state ({', '.join(keys[:5]) or 'none'}) that is not "
                           "AdamW's, the Trainer's default; pass --optimizer package.module:Class naming the "
                           "optimizer the run used")


def _autocast(path: str, weights: list[torch.dtype], *, scaler: bool, given: str | None, where: str,
              notes: list[str]) -> str:
    """The autocast dtype the run used, read, never guessed: ``--dtype``; else what ``training_args.bin`` says
    (read inertly, :mod:`._training_args`): ``bf16`` bfloat16; ``fp16`` float16 where the GradScaler's state is
    beside it (every float16 autocast run of the Trainer saves one) and float32 where it is not (the Trainer on a
    CPU trains ``fp16=True`` without autocast); neither, float32. Without that file: float16 beside a GradScaler
    (only float16 needs one), the weights' own half dtype (a model trained in it), else one line asking for
    ``--dtype``: a replay in a precision the run did not use would name a failure that never happened."""
    if given is not None:
        return given
    args_file = _file(path, TRAINING_ARGS, where)
    args = read_training_args(args_file, where) if args_file is not None else None
    if args is not None and isinstance(args.get("fp16"), bool) and isinstance(args.get("bf16"), bool):
        said = {k: args[k] for k in ("learning_rate", "warmup_steps", "warmup_ratio", "lr_scheduler_type",
                                     "max_grad_norm", "weight_decay") if k in args}
        if said:
            notes.append(f"{where}: its {TRAINING_ARGS} says " + ", ".join(f"{k}={v}" for k, v in said.items()))
        if args["bf16"]:
            return "bfloat16"
        if args["fp16"] and scaler:
            return "float16"
        if args["fp16"]:
            notes.append(f"{where}: its {TRAINING_ARGS} says fp16=True, but no {SCALER} was saved, which every "
                         "float16 autocast run of the Trainer saves: the run did not autocast (the Trainer trains "
                         "fp16=True on a CPU in float32); replayed in float32; pass --dtype float16 if it did")
        return "float32"
    if scaler:
        return "float16"
    floats = {d for d in weights if d.is_floating_point}
    if floats in ({torch.bfloat16}, {torch.float16}):
        return dtype_name(floats.pop())
    why = (f"its {TRAINING_ARGS} holds no TrainingArguments" if args_file is not None
           else f"it holds no {TRAINING_ARGS} and no {SCALER}")
    raise InputError(f"{where} does not say which precision the run used ({why}); pass --dtype float32, "
                     "--dtype bfloat16 or --dtype float16 (what the run's autocast used)")


def _rng(path: str, where: str, trust_pickle: bool, notes: list[str]) -> dict[str, Any] | None:
    """torch's and CUDA's generator states from ``rng_state.pth`` (rank 0's ``rng_state_0.pth`` when each rank
    saved its own; Python's and NumPy's are not the step's);
    None when there is none, or (said in a note) when it cannot be used: the step then starts from the generator
    state nanhunt has, as it would without the file."""
    file = _file(path, RNG, where)
    if file is None:  # a run of several processes saved one per rank
        file = _file(path, _RANK0_RNG, where)
        if file is None:
            return None
        notes.append(f"{where} was saved by several processes: the step starts from rank 0's generator state "
                     f"({_RANK0_RNG})")
    unused = "not used: the step starts from nanhunt's own generator state"
    try:
        state = load_file(file, what=f"{where}: its {RNG}", trust_pickle=trust_pickle, safe_globals=_numpy_state())
    except InputError as e:
        notes.append(f"{e}; {unused}")
        return None
    cpu = state.get("cpu") if isinstance(state, Mapping) else None
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.shape == torch.get_rng_state().shape):
        notes.append(f"{where}: its {RNG} holds no torch generator state ('cpu'); {unused}")
        return None
    out: dict[str, Any] = {"torch": cpu}
    cuda = state.get("cuda")
    cuda = [cuda] if isinstance(cuda, torch.Tensor) else cuda  # one device's, or every device's
    if isinstance(cuda, list) and all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda):
        out["cuda"] = cuda
    # each checked as the replay would set it: the CUDA ones only where they are set, one a device
    tried = [("cpu", cpu, "cpu")] + [("cuda", c, f"cuda:{i}") for i, c in enumerate(out.get("cuda", []))
                                     if len(out["cuda"]) == torch.cuda.device_count()]
    for key, t, device in tried:
        why = generator_state_problem(t, device)
        if why is not None:
            raise InputError(f"{where}: its {os.path.basename(file)} holds a torch generator state ({key!r}) that "
                             f"torch refuses ({why}): the file is damaged; delete it to replay from nanhunt's own "
                             "generator state")
    return out


def _numpy_state() -> list[Any]:
    """What NumPy's generator state pickles as (an array of uint32 and its dtype), for the weights-only
    unpickler: the Trainer saves it beside torch's, as transformers' own loader allows. NumPy 1 named the array's
    constructor ``numpy.core.multiarray``, NumPy 2 ``numpy._core.multiarray``: either name is taken for it."""
    import numpy as np

    core: Any = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


# ------------------------------------------------------------------ files
def _file(path: str, name: str, where: str) -> str | None:
    """``name`` inside the checkpoint when it is there (None when not): a regular file of its own, never a link
    (nothing outside the directory is read) nor a device or a pipe (which could make nanhunt read forever)."""
    return own_file(path, name, f"{where}: its {_quoted(name)}", holder="a Trainer checkpoint directory")


def _mapping(obj: Any, name: str, expected: str, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise InputError(f"{where}: its {name} holds a {type(obj).__name__}, not {expected}; delete it to "
                           "replay without it")
    return obj


def _quoted(name: str) -> str:
    return repr(name if len(name) <= 200 else name[:197] + "...")
