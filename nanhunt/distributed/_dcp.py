"""Private: the Guard's capture directory for a sharded (FSDP2) or replicated (DDP) model, and reading it back in
one process.

A capture directory holds ``state/`` (``torch.distributed.checkpoint``: every rank writes its own shards of the
model and optimizer state, nothing is gathered onto one rank; a DDP model's replicated tensors are each written
once, by one rank), each rank's batch and RNG (``batch-rank{R}.pt``,
the format of a ``batch.pt``) and ``manifest.json``, written last: a directory without it is no capture.

Reading consolidates the shards into full tensors without ``torch.distributed``. DCP's own reader unpickles
``state/.metadata`` with ``pickle.load`` (any global the file names, code included) and its non-tensor entries
with ``torch.load(weights_only=False)``; here the metadata's pickle is first scanned (how deep it nests, how much
memory unpickling it would take), then unpickled by an unpickler that builds only DCP's metadata classes, every
field checked for the type DCP writes, and every entry is read with ``torch.load(weights_only=True)``, so a
hostile directory runs no code, and the memory it can make nanhunt allocate is bounded by the bytes of its shard
files. No symbolic link inside a capture directory is followed.

Everything of ``torch.distributed`` is imported inside the functions: ``import nanhunt`` stays light.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import pickle
import pickletools
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError, first_line as _first_line
from .._util._files import new_file, write_file
from .._util import _dispatch
from .._util._json import parse_json
from .._util._safeload import check_bytes
from .._util._text import dtype_name
from ._dcp_metadata import _check_budget, _lists, _load, _read_metadata, _read_tensor, _set_nested, _storage_index, not_linked
from ._dcp_metadata import _few as _few, _short as _short  # re-exported: the torchrun replay words its errors so

__all__ = ["MANIFEST", "STATE", "sharded", "batch_file", "is_capture_dir", "not_linked", "write_capture_dir",
           "read_manifest", "pick_rank", "load_state", "optimizer_by_index"]

FORMAT = 1
MANIFEST = "manifest.json"
STATE = "state"
WRAPPERS = ("fsdp2", "ddp")
MAX_MANIFEST_BYTES = 16 << 20  # names and flags: a model of 100,000 modules fits; parsed, JSON takes ~27x its size
MAX_WORLD = 1 << 20


# ------------------------------------------------------------------- writing
def sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor was ever made in this process
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def ddp_options(model: nn.Module) -> dict[str, bool] | None:
    """The options a ``DistributedDataParallel`` model was built with that its replay under torchrun rebuilds
    (manifest field ``ddp``); None when ``model`` is no DDP wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    return {"find_unused_parameters": bool(model.find_unused_parameters),
            "gradient_as_bucket_view": bool(model.gradient_as_bucket_view),
            "static_graph": bool(model.static_graph)}


def agree_any(flag: bool, group: Any) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (one small all_reduce; every rank must call it)."""
    return not _agree(not flag, _comm_device(group), group)


def fsdp_layout(module: nn.Module) -> list[dict[str, Any]]:
    """Which modules ``fully_shard`` wrapped, children before parents (the order to wrap them again), each
    with the mesh shape and the options the distributed replay must repeat. The options are read from
    FSDP2's state (no public getter); one torch cannot say is recorded as None and replayed by default."""
    from torch.distributed.fsdp import FSDPModule

    out: list[dict[str, Any]] = []
    for name, m in reversed(list(module.named_modules())):
        if not isinstance(m, FSDPModule):
            continue
        entry: dict[str, Any] = {"module": name, "mesh": None, "reshard_after_forward": None, "mp_policy": None}
        with suppress(Exception):  # FSDP2's internals differ between torch versions: record what is there
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            if group is not None:
                entry["mesh"] = [int(n) for n in group.mesh_info.mesh.shape]
                names = group.mesh_info.mesh.mesh_dim_names
                if names is not None:  # HSDP's 2-D mesh needs them
                    entry["mesh_dim_names"] = [str(n) for n in names]
                if not state._auto_reshard_after_forward:
                    entry["reshard_after_forward"] = group.post_forward_mesh_info is not None
            mp = state._mp_policy
            entry["mp_policy"] = {k: None if getattr(mp, k) is None else dtype_name(getattr(mp, k))
                                  for k in ("param_dtype", "reduce_dtype", "output_dtype")}
            entry["mp_policy"]["cast_forward_inputs"] = bool(mp.cast_forward_inputs)
        out.append(entry)
    return out


def batch_file(rank: int) -> str:
    return f"batch-rank{rank}.pt"


def is_capture_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                  buffers: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state, by fully qualified name (no collective, nothing
    gathered); ``buffers`` replace the live ones (the copies a step began with)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd: dict[str, Any] = dict(get_model_state_dict(module))
    for name, t in buffers.items():
        live = model_sd.get(name)
        if isinstance(live, torch.Tensor) and live.shape == t.shape:
            model_sd[name] = t
    return {"model": model_sd, "optimizer": get_optimizer_state_dict(module, optimizer)}


def optimizer_by_name(osd: Mapping[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``Optimizer.state_dict()`` (a snapshot's copy: parameters numbered in group order) keyed by parameter name,
    as ``get_optimizer_state_dict`` writes it and :func:`optimizer_by_index` reads it back."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if any(n is None for n in order):
        raise ValueError("the optimizer updates tensors outside the model, which a capture directory cannot name")
    return {"state": {order[i]: v for i, v in osd.get("state", {}).items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd.get("param_groups", [])]}


def any_rank(flag: bool, module: nn.Module) -> bool:
    """Whether ``flag`` is set on any rank that holds shards of ``module`` (one all_reduce per dimension of its
    DTensors' device mesh, every one of those ranks must call it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in module.parameters() if isinstance(p, DTensor)), None)
    if mesh is None:
        return flag
    found = torch.tensor([1.0 if flag else 0.0])
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        t = found.to(_comm_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        found = t.cpu()
    return float(found) != 0.0


def write_capture_dir(path: str, *, state: Any, fields: Mapping[str, Any], batch: Mapping[str, Any],
                      ranks_seen: tuple[int, ...], step: int, wrapper: str, group: Any = None) -> str | None:
    """Write the capture directory; every rank of ``group`` must call it (each step is agreed by one small
    ``all_reduce``, so a rank that failed never leaves the others waiting). ``state``: this rank's state, or
    an exception raised making it (the others then write nothing). Returns None, or why there is no capture."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = _comm_device(group)
    error: str | None = f"{type(state).__name__}: {state}" if isinstance(state, BaseException) else None
    manifest = {"nanhunt_capture_dir": FORMAT, "world_size": world, "wrapper": wrapper,
                "ranks_seen": sorted(ranks_seen), "step": step, **fields}
    if error is None:
        try:
            text = json.dumps(manifest, indent=1, allow_nan=False)  # model_kwargs that JSON cannot say: no capture
            if rank == 0:
                _clear(path)  # a capture of this step written earlier; its manifest goes first
            os.makedirs(path, exist_ok=True)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if not _agree(error is None, device, group):
        return error or "another rank could not prepare its part of the capture"
    try:
        from torch.distributed.checkpoint.state_dict_saver import save

        save(state, checkpoint_id=os.path.join(path, STATE), process_group=group)  # raises on every rank
        _save_atomic(batch, os.path.join(path, batch_file(rank)))
    except Exception as e:
        error = f"{type(e).__name__}: {_first_line(e)}"
    if not _agree(error is None, device, group):
        return error or "another rank could not write its part of the capture"
    if rank == 0:
        try:
            write_file(os.path.join(path, MANIFEST), text)  # a new file renamed in: never through a link
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if not _agree(error is None, device, group):
        return error or "rank 0 could not write the capture's manifest"
    return None


def _comm_device(group: Any) -> torch.device:
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(ok: bool, device: torch.device, group: Any) -> bool:
    """Whether every rank is ``ok`` (one all_reduce of one number)."""
    import torch.distributed as dist

    failed = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(failed, group=group)
    return float(failed) == 0.0


def _clear(path: str) -> None:
    with suppress(FileNotFoundError):
        os.remove(os.path.join(path, MANIFEST))
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _save_atomic(obj: Any, path: str) -> None:
    with new_file(path) as f:  # a new file renamed in, removed on any error: never through a link nor a FIFO
        torch.save(obj, f)


# ------------------------------------------------------------------- reading
def read_manifest(path: str) -> dict[str, Any]:
    """The manifest, its own fields checked (the capture's fields are checked where a checkpoint's are)."""
    where = f"capture directory {path!r}"
    file = not_linked(os.path.join(path, MANIFEST), f"{where}: its {MANIFEST}")
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, STATE, ".metadata")):
            raise InputError(f"{where} has no {MANIFEST}: the job died while writing it, so the capture is not "
                               "whole; use an earlier capture")
        raise InputError(f"{where} is not a nanhunt capture directory (no {MANIFEST}); give a capture directory "
                           "the Guard wrote, or a checkpoint and a batch file")
    if os.path.getsize(file) > MAX_MANIFEST_BYTES:
        raise InputError(f"{where}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES >> 20} MiB, which no capture "
                           "writes; nanhunt refuses it")
    try:
        with open(file, "rb") as f:
            man = parse_json(f.read(MAX_MANIFEST_BYTES + 1), max_bytes=MAX_MANIFEST_BYTES)
    except ValueError as e:  # too deep, not UTF-8, not JSON: bounded before json recurses
        raise InputError(f"{where}: {MANIFEST} {_first_line(e)}; the capture is damaged") from e
    if not isinstance(man, dict) or man.get("nanhunt_capture_dir") != FORMAT:
        raise InputError(f"{where}: {MANIFEST} is not a nanhunt manifest of format {FORMAT}; write the capture "
                           "again with this nanhunt")

    def bad(name: str, expected: str) -> InputError:
        return InputError(f"{where} is not a valid nanhunt capture: {MANIFEST} field {name!r} is "
                            f"{_short(man.get(name))}, expected {expected}")

    world = man.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise bad("world_size", f"an integer from 1 to {MAX_WORLD}")
    if man.get("wrapper") not in WRAPPERS:
        raise bad("wrapper", " or ".join(repr(w) for w in WRAPPERS))
    seen = man.get("ranks_seen")
    if not isinstance(seen, list) or not all(type(r) is int and 0 <= r < world for r in seen):
        raise bad("ranks_seen", f"a list of ranks from 0 to {world - 1}")
    if type(man.get("step")) is not int or man["step"] < 0:
        raise bad("step", "a step index (an integer >= 0)")
    return man


def pick_rank(man: Mapping[str, Any], rank: int | None, path: str) -> int:
    """``--rank`` checked against the capture, or the first rank that saw the failure (0 if none did)."""
    world = int(man["world_size"])
    if rank is None:
        return min(man["ranks_seen"], default=0)
    if not 0 <= rank < world:
        raise InputError(f"--rank {rank} is out of range: capture directory {path!r} was written by {world} "
                           f"rank(s), 0 to {world - 1}; pick one of them")
    return rank


def load_state(path: str, *, tensors: bool = True) -> dict[str, Any]:
    """The DCP checkpoint at ``path`` consolidated into full CPU tensors, nested as it was saved; without
    ``tensors``, only its other entries (the optimizer's groups and hyperparameters)."""
    where = f"the capture's state {path!r}"
    meta = _read_metadata(path, where)
    storage = _storage_index(meta, path, where)
    entries = meta.state_dict_metadata
    planner = meta.planner_data or {}
    _check_budget(entries, storage, path, where)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    for fqn, md in entries.items():
        if isinstance(md, TensorStorageMetadata):
            if not tensors:
                continue
            value: Any = _read_tensor(fqn, md, storage, path, where)
        else:
            value = _load(path, storage[(fqn, None)], where, fqn)
        _set_nested(out, planner.get(fqn, (fqn,)), value, where)
    return {k: _lists(v) for k, v in out.items()}


def optimizer_by_index(osd: Any, where: str) -> tuple[dict[str, Any], list[list[str]]]:
    """A state dict of ``get_optimizer_state_dict`` (keyed by parameter name) as ``Optimizer.state_dict()``
    numbers it, and each group's parameter names (what ``save_capture`` records as ``optimizer_params``)."""
    fix = "the capture is damaged; use an earlier one"
    groups = osd.get("param_groups") if isinstance(osd, Mapping) else None
    state = osd.get("state", {}) if isinstance(osd, Mapping) else None
    if not isinstance(groups, list) or not isinstance(state, Mapping) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
            and all(isinstance(n, str) for n in g["params"]) for g in groups):
        raise InputError(f"{where}: its optimizer state has no parameter groups naming their parameters; {fix}")
    names = [list(g["params"]) for g in groups]
    index = {n: i for i, n in enumerate(n for g in names for n in g)}
    unknown = [str(k) for k in state if k not in index]
    if unknown:
        raise InputError(f"{where}: its optimizer state names parameters no group holds ({_few(unknown)}); {fix}")
    sd = {"state": {index[k]: v for k, v in state.items()},
          "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups]}
    return sd, names


def load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load the DCP checkpoint at ``path`` into ``model`` (sharded again as it was, FSDP2) and ``optimizer``:
    a collective of ``torch.distributed.checkpoint.load`` in which each rank reads only the chunks its shards
    need, through :func:`safe_reader` (weights-only, the one-process path's checks)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    reader, planner = safe_reader(path)
    try:
        load(state, storage_reader=reader, planner=planner)
    except CheckpointException as e:  # every rank raises it, naming each rank's own error
        failures = sorted(e.failures.items())
        first = next((exc for _, (exc, _tb) in failures if isinstance(exc, InputError)), None)
        if first is not None:
            raise InputError(str(first)) from None
        rank, (exc, _tb) = failures[0] if failures else (-1, (e, None))
        raise InputError(f"the capture's state {path!r} cannot be loaded into the sharded model (rank {rank}: "
                           f"{_first_line(exc)}); is --model the factory that built this capture?") from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def safe_reader(path: str) -> tuple[Any, Any]:
    """A ``StorageReader`` and ``LoadPlanner`` for ``torch.distributed.checkpoint.load`` that read as
    :func:`load_state` does: the metadata by the unpickler that builds only DCP's classes, every place checked
    to lie in a shard file of ``path``, every entry (tensor or not) with ``torch.load(weights_only=True)``.
    DCP's own reader would ``pickle.load`` the metadata and its planner unpickle non-tensor entries with
    ``weights_only=False``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    where = f"the capture's state {path!r}"

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = _read_metadata(path, where)
            _check_budget(meta.state_dict_metadata, _storage_index(meta, path, where), path, where)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self.checked = _storage_index(metadata, path, where)  # every rank checks the places it reads

        def read_data(self, plan: Any, planner: Any) -> Future[None]:
            for req in plan.items:
                fqn = str(req.storage_index.fqn)
                off = None if req.storage_index.offset is None else tuple(int(i) for i in req.storage_index.offset)
                info = self.checked.get((fqn, off))
                if info is None:
                    raise InputError(f"{where}: a chunk of {fqn!r} at {off} is not stored; the capture is damaged")
                value = _load(path, info, where, fqn)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_object(req, value)
                    continue
                if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_meta:
                    raise InputError(f"{where}: a chunk of {fqn!r} holds {type(value).__name__}, not a tensor; "
                                       "the capture is damaged")
                for dim, (start, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    if not (0 <= start and start + n <= value.shape[dim]):
                        raise InputError(f"{where}: a chunk of {fqn!r} is smaller than its .metadata says; the "
                                           "capture is damaged")
                    value = value.narrow(dim, start, n)
                target = planner.resolve_tensor(req).detach()
                if target.size() != value.size():
                    raise InputError(f"{where}: {fqn!r} is {tuple(value.shape)} in the capture and "
                                       f"{tuple(target.shape)} in this model; is --model the factory that built it?")
                target.copy_(value)
                planner.commit_tensor(req, target)
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # the bytes' pickle bounded first, as a file's is: a hostile entry is refused, never a crash
            check_bytes(value.getvalue(), name=f"the entry {read_item.dest_index.fqn!r} of the capture's state")
            self.load_object(read_item, torch.load(value, map_location="cpu", weights_only=True))

        def load_object(self, read_item: Any, obj: Any) -> None:
            """A non-tensor entry already read weights-only, put where DCP's planner would put it (the
            place exists: DCP reads only the entries of the state dict it loads into)."""
            if not self.flatten_state_dict:
                self.state_dict[read_item.dest_index.fqn] = obj
                return
            keys = self.mappings[read_item.dest_index.fqn]
            node: Any = self.original_state_dict
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = obj

    return SafeReader(path), SafePlanner()


