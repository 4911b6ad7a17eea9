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

from .._util._errors import CommandError, first_line as _first_line
from .._util import _dispatch
from .._util._safeload import check_bytes, parse_json

__all__ = ["MANIFEST", "STATE", "sharded", "batch_file", "is_capture_dir", "not_linked", "write_capture_dir",
           "read_manifest", "pick_rank", "load_state", "optimizer_by_index"]

FORMAT = 1
MANIFEST = "manifest.json"
STATE = "state"
WRAPPERS = ("fsdp2", "ddp")
MAX_MANIFEST_BYTES = 16 << 20  # names and flags: a model of 100,000 modules fits; parsed, JSON takes ~27x its size
MAX_WORLD = 1 << 20
# a .metadata holds a few kB per tensor; a tensor is stored in about as many chunks as ranks wrote it
MAX_METADATA_BYTES = 64 << 20
MAX_CHUNKS = 4096
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file in state/, never a path


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
            entry["mp_policy"] = {k: None if getattr(mp, k) is None else str(getattr(mp, k)).replace("torch.", "")
                                  for k in ("param_dtype", "reduce_dtype", "output_dtype")}
            entry["mp_policy"]["cast_forward_inputs"] = bool(mp.cast_forward_inputs)
        out.append(entry)
    return out


def batch_file(rank: int) -> str:
    return f"batch-rank{rank}.pt"


def is_capture_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def not_linked(path: str, what: str) -> str:
    """``path`` (a file or directory inside a capture directory, called ``what``), refused when it is a symbolic
    link: the Guard writes none, and one in a capture from someone else could put any file of this machine in
    the report, or make nanhunt read a device forever."""
    if os.path.islink(path):
        raise CommandError(f"{what} is a symbolic link; nanhunt reads only the files a capture directory holds, "
                           "never one a link points to: copy the real files into it")
    return path


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
            tmp = os.path.join(path, MANIFEST + ".partial")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, os.path.join(path, MANIFEST))
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
    tmp = path + ".partial"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


# ------------------------------------------------------------------- reading
def read_manifest(path: str) -> dict[str, Any]:
    """The manifest, its own fields checked (the capture's fields are checked where a checkpoint's are)."""
    where = f"capture directory {path!r}"
    file = not_linked(os.path.join(path, MANIFEST), f"{where}: its {MANIFEST}")
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, STATE, ".metadata")):
            raise CommandError(f"{where} has no {MANIFEST}: the job died while writing it, so the capture is not "
                               "whole; use an earlier capture")
        raise CommandError(f"{where} is not a nanhunt capture directory (no {MANIFEST}); give a capture directory "
                           "the Guard wrote, or a checkpoint and a batch file")
    if os.path.getsize(file) > MAX_MANIFEST_BYTES:
        raise CommandError(f"{where}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES >> 20} MiB, which no capture "
                           "writes; nanhunt refuses it")
    try:
        with open(file, "rb") as f:
            man = parse_json(f.read(MAX_MANIFEST_BYTES + 1), max_bytes=MAX_MANIFEST_BYTES)
    except ValueError as e:  # too deep, not UTF-8, not JSON: bounded before json recurses
        raise CommandError(f"{where}: {MANIFEST} {_first_line(e)}; the capture is damaged") from e
    if not isinstance(man, dict) or man.get("nanhunt_capture_dir") != FORMAT:
        raise CommandError(f"{where}: {MANIFEST} is not a nanhunt manifest of format {FORMAT}; write the capture "
                           "again with this nanhunt")

    def bad(name: str, expected: str) -> CommandError:
        return CommandError(f"{where} is not a valid nanhunt capture: {MANIFEST} field {name!r} is "
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
        raise CommandError(f"--rank {rank} is out of range: capture directory {path!r} was written by {world} "
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
        raise CommandError(f"{where}: its optimizer state has no parameter groups naming their parameters; {fix}")
    names = [list(g["params"]) for g in groups]
    index = {n: i for i, n in enumerate(n for g in names for n in g)}
    unknown = [str(k) for k in state if k not in index]
    if unknown:
        raise CommandError(f"{where}: its optimizer state names parameters no group holds ({_few(unknown)}); {fix}")
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
        first = next((exc for _, (exc, _tb) in failures if isinstance(exc, CommandError)), None)
        if first is not None:
            raise CommandError(str(first)) from None
        rank, (exc, _tb) = failures[0] if failures else (-1, (e, None))
        raise CommandError(f"the capture's state {path!r} cannot be loaded into the sharded model (rank {rank}: "
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
                    raise CommandError(f"{where}: a chunk of {fqn!r} at {off} is not stored; the capture is damaged")
                value = _load(path, info, where, fqn)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_object(req, value)
                    continue
                if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_meta:
                    raise CommandError(f"{where}: a chunk of {fqn!r} holds {type(value).__name__}, not a tensor; "
                                       "the capture is damaged")
                for dim, (start, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    if not (0 <= start and start + n <= value.shape[dim]):
                        raise CommandError(f"{where}: a chunk of {fqn!r} is smaller than its .metadata says; the "
                                           "capture is damaged")
                    value = value.narrow(dim, start, n)
                target = planner.resolve_tensor(req).detach()
                if target.size() != value.size():
                    raise CommandError(f"{where}: {fqn!r} is {tuple(value.shape)} in the capture and "
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


# ---------------------------------------------------------- DCP's metadata
def _layout(name: str) -> torch.layout:
    """A layout from its name, as DCP pickles one (once per tensor); only torch's own."""
    found = _layouts().get(name)
    if found is None:
        raise ValueError(f"{name!r} is not a torch layout")
    return found


@functools.cache
def _layouts() -> dict[str, torch.layout]:
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _path_text(*parts: Any) -> str:
    """A pickled path (``StorageMeta.checkpoint_id``) as the name it was: kept, never opened. Not pathlib's own
    class, which copies every part it is given: one long string named a thousand times would take a thousand
    copies."""
    if not all(isinstance(p, str) for p in parts) or sum(len(p) for p in parts) > 4096:
        raise ValueError("a path that is not a short name")
    return "/".join(parts)


def _empty_dict() -> dict[Any, Any]:
    """An ``OrderedDict`` as pickle writes one: made empty, its items set after (given a dict to copy, it would
    copy it each time it is named)."""
    return {}


def _mem_format(value: int) -> Any:
    """DCP's memory-format enum member; a function, so that no pickle can make one of its members and set
    attributes on it (NEWOBJ of an Enum class returns the member itself)."""
    return _dispatch.dcp_mem_format(value)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): _empty_dict,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    }
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = _path_text
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "StorageMeta"):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = getattr(filesystem, "_StorageInfo")
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _Foreign(pickle.UnpicklingError):
    """A global no DCP metadata names."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses and nothing else: any other global is refused, never imported."""

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file)
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise _Foreign(f"{module}.{name}")
        return found


class _Made:
    """A list, dict, set, tuple or object the unpickler would make, as the scan of the opcodes follows it: how
    deep it nests, how many items it holds, whether it is an instance made by NEWOBJ (the one thing BUILD may
    set attributes of) and whether it is inside another (pickle.dump writes a value whole before it puts it
    in another: one changed after that is a pickle written by hand, and its depth would be out of date)."""

    __slots__ = ("depth", "items", "instance", "inside")

    def __init__(self, depth: int, items: int, instance: bool = False) -> None:
        self.depth, self.items, self.instance, self.inside = depth, items, instance, False


_LEAF = _Made(0, 0)  # a number, a string, None, a global: holds nothing, never changed
_PUT = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
_GET = ("GET", "BINGET", "LONG_BINGET")
_CHANGES = ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD")  # the value below their items
_MAKES = ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE", "LIST", "DICT", "TUPLE", "TUPLE1", "TUPLE2",
          "TUPLE3", "FROZENSET", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST")
_CALLS = ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST")
# bytes the unpickler may hold for what an opcode makes (CPython, 64-bit), at most: a value (any not named here),
# a memo or stack slot, an empty set or dict, an instance and its __dict__; each item an opcode puts in a container
# or passes to a call counts 16 more (32 in a dict or set), a string or number its length
_COST = {"PUT": 16, "BINPUT": 16, "LONG_BINPUT": 16, "MEMOIZE": 16, "GET": 8, "BINGET": 8, "LONG_BINGET": 8,
         "MARK": 8, "EMPTY_SET": 216, "FROZENSET": 216, "EMPTY_DICT": 64, "DICT": 64, "REDUCE": 160, "NEWOBJ": 160,
         "NEWOBJ_EX": 160, "OBJ": 160, "INST": 160, "BUILD": 160}
_HASHED = ("SETITEM", "SETITEMS", "DICT", "ADDITEMS", "FROZENSET")
MAX_METADATA_MEMORY = 512 << 20  # DCP's own .metadata unpickles to about 12 times its bytes
MAX_METADATA_DEPTH = 32  # DCP's own nest 11 deep, as the scan counts
_LEAVES, _PUTS, _GETS, _MARKS, _CHANGE, _MAKE = range(6)  # what an opcode does, as the scan follows it


@functools.cache
def _opcodes() -> dict[str, tuple[int, int, int, bool, int, bool]]:
    """Each opcode's kind (above), cost, the number of values it takes from the stack below the topmost MARK,
    whether it takes that MARK and the values above it, what each value it takes costs, whether it leaves one."""
    out = {}
    for op in pickletools.opcodes:
        name, before = op.name, op.stack_before
        marked = pickletools.markobject in before
        kind = (_PUTS if name in _PUT else _GETS if name in _GET else _MARKS if name == "MARK" else
                _CHANGE if name in _CHANGES else _MAKE if name in _MAKES else _LEAVES)
        out[name] = (kind, _COST.get(name, 56), before.index(pickletools.markobject) if marked else len(before),
                     marked, 32 if name in _HASHED else 16, bool(op.stack_after))
    return out


def _scan_metadata(data: bytes, where: str) -> None:
    """Refuse, before it is unpickled, a .metadata that nests deeper than :data:`MAX_METADATA_DEPTH` (a dict key
    of a tuple nested 100k deep crashed the process when hashed), would take more than
    :data:`MAX_METADATA_MEMORY` to unpickle (10 MB of empty sets took 2.75 GB), or is no pickle pickle.dump
    writes. Its opcodes are followed on a model of the unpickler's stack, marks and memo; nothing is built."""
    def odd(why: str) -> CommandError:
        return CommandError(f"{where}: its .metadata is not a pickle as pickle.dump writes it ({why}); nanhunt "
                            "refuses it")

    table = _opcodes()
    stack: list[_Made] = []
    marks: list[int] = []  # the stack's length at each MARK, as the unpickler keeps them
    memo: list[_Made] = []
    cost = 0
    ops: Iterable[tuple[Any, Any, Any]] = pickletools.genops(io.BytesIO(data))  # an argument's type is its opcode's
    try:
        for op, arg, _ in ops:
            if cost > MAX_METADATA_MEMORY:
                break
            name = op.name
            kind, base, below, marked, each, leaves = table[name]
            cost += base
            if arg.__class__ in (str, bytes, bytearray):
                cost += len(arg) if arg.__class__ is not str or arg.isascii() else 4 * len(arg)
            if kind == _GETS:
                if not 0 <= arg < len(memo):
                    raise odd(f"memo key {arg} read before it was stored")
                stack.append(memo[arg])
                continue
            if kind == _PUTS:
                key = len(memo) if name == "MEMOIZE" else arg
                if len(stack) <= (marks[-1] if marks else 0):
                    raise odd(f"{name} with nothing to store")
                if key > len(memo):  # the unpickler sizes its memo table by the largest key
                    raise odd(f"memo key {key} skips past the {len(memo)} values stored so far")
                memo[key:key + 1] = [stack[-1]]
                continue
            if kind == _MARKS:
                marks.append(len(stack))
                continue
            if name == "POP" and marks and len(stack) == marks[-1]:
                marks.pop()
                continue
            if marked and not marks:
                raise odd(f"{name} without a MARK")
            first = (marks.pop() if marked else len(stack)) - below
            if first < (marks[-1] if marks else 0):  # the unpickler takes no value from below a MARK
                raise odd(f"{name} takes more values than the stack holds")
            items = stack[first:]
            del stack[first:]
            if kind == _LEAVES:
                if arg.__class__ is int:
                    cost += arg.bit_length() >> 3
                if name == "DUP":  # the value itself, twice
                    stack += items * 2
                elif leaves:
                    stack.append(_LEAF)
                continue
            cost += each * len(items)
            made = items[0] if kind == _CHANGE else None
            if made is not None:
                items = items[1:]
                if made is _LEAF or (name == "BUILD" and not made.instance):
                    raise odd(f"{name} on a value that is no container it made")
            depth = 0
            for i in items:
                i.inside = True
                if i.depth > depth:
                    depth = i.depth
                if name in _CALLS or name == "BUILD":  # a call may copy what its arguments hold (torch.Size),
                    cost += 40 * i.items  # BUILD copies the state's items into the instance
            if made is None:
                made = _Made(depth + 1, len(items), name.startswith("NEWOBJ"))
            elif made.inside:  # its own item, too: a cycle
                raise odd("a list, dict or object changes after it was put in another")
            else:
                made.items += len(items)
                made.depth = max(made.depth, depth + 1)
            stack.append(made)
            if made.depth > MAX_METADATA_DEPTH:
                raise CommandError(f"{where}: its .metadata nests values more than {MAX_METADATA_DEPTH} deep (DCP's "
                                   "own nest 11); nanhunt refuses it")
    except ValueError as e:  # pickletools: a bad opcode or argument, no STOP
        raise CommandError(f"{where}: its .metadata is damaged ({_first_line(e)})") from e
    if cost > MAX_METADATA_MEMORY:
        raise CommandError(f"{where}: its .metadata would take more than {MAX_METADATA_MEMORY >> 20} MiB of memory "
                           "to unpickle, which no DCP checkpoint nanhunt reads needs; nanhunt refuses it")


def _read_metadata(path: str, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    not_linked(path, where)
    file = not_linked(os.path.join(path, ".metadata"), f"{where}: its .metadata")
    if not os.path.isfile(file):
        raise CommandError(f"{where} has no .metadata: it is not a whole torch.distributed.checkpoint; the capture "
                           "is damaged")
    if os.path.getsize(file) > MAX_METADATA_BYTES:
        raise CommandError(f"{where}: its .metadata is {os.path.getsize(file)} bytes, more than the "
                           f"{MAX_METADATA_BYTES} nanhunt reads (a few kB per tensor); the capture is damaged")
    with open(file, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    _scan_metadata(data, where)
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Foreign as e:
        raise CommandError(f"{where}: its .metadata names {_short(str(e))}, which is not part of a DCP checkpoint's "
                           "metadata and would run code if unpickled; nanhunt refuses it") from e
    except Exception as e:  # the unpickler builds only dataclasses: any error means a damaged file
        raise CommandError(f"{where}: its .metadata is damaged ({_first_line(e)})") from e
    if not isinstance(meta, Metadata):
        raise CommandError(f"{where}: its .metadata holds a {type(meta).__name__}, not DCP metadata")
    _check_metadata(meta, where)
    return meta


_MISSING = object()


def _expect(ok: bool, value: Any, what: str, expected: str, where: str) -> None:
    """Refuse ``value`` (``_MISSING``: no such field), read from the file as ``what``, unless ``ok``."""
    if not ok:
        raise CommandError(f"{where}: its .metadata is damaged: {what} is {_kind(value)}, expected {expected}")


def _field(obj: Any, name: str, test: Callable[[Any], bool], expected: str, owner: str, where: str) -> Any:
    """Field ``name`` of ``obj`` (one of DCP's dataclasses as the file made it), refused unless ``test`` holds."""
    value = getattr(obj, name, _MISSING)
    _expect(value is not _MISSING and test(value), value, f"field {name!r} of {owner}", expected, where)
    return value


def _shape(value: Any, ndim: int | None = None) -> bool:
    return type(value) is torch.Size and (ndim is None or len(value) == ndim) and all(
        type(d) is int and 0 <= d < 1 << 62 for d in value)


def _check_metadata(meta: Any, where: str) -> None:
    """Every field of the metadata that nanhunt or DCP's planner reads is of the type DCP writes: the file
    could hold any value the unpickler makes (a chunk that is a number, a size of floats, a field left out)."""
    _StorageInfo = _dispatch.dcp_storage_info()
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    top = "the metadata"
    shape = "a torch.Size of integers >= 0"
    entries = _field(meta, "state_dict_metadata", lambda v: type(v) is dict, "a dict", top, where)
    for fqn, md in entries.items():
        _expect(type(fqn) is str, fqn, "an entry's name", "a str", where)
        _expect(type(md) in (TensorStorageMetadata, BytesStorageMetadata), md, f"entry {fqn!r}",
                "a TensorStorageMetadata or BytesStorageMetadata", where)
        if type(md) is BytesStorageMetadata:
            continue
        of = repr(fqn)
        props = _field(md, "properties", lambda v: type(v) is TensorProperties, "a TensorProperties", of, where)
        _field(props, "dtype", lambda v: isinstance(v, torch.dtype), "a torch.dtype", of, where)
        _field(props, "layout", lambda v: v is torch.strided, "torch.strided", of, where)
        size = _field(md, "size", _shape, shape, of, where)
        for c in _field(md, "chunks", lambda v: type(v) is list, "a list", of, where):
            _expect(type(c) is ChunkStorageMetadata, c, f"a chunk of {of}", "a ChunkStorageMetadata", where)
            for name in ("offsets", "sizes"):
                _field(c, name, lambda v: _shape(v, len(size)), f"a torch.Size of {len(size)} integers >= 0",
                       f"a chunk of {of}", where)
    planner = _field(meta, "planner_data", lambda v: v is None or type(v) is dict, "None or a dict", top, where)
    for fqn, keys in (planner or {}).items():
        _expect(type(keys) is tuple and len(keys) > 0 and all(type(k) in (str, int) for k in keys), keys,
                f"the place of {_short(fqn)} in field 'planner_data'", "a tuple of names and indices", where)
    storage = _field(meta, "storage_data", lambda v: type(v) is dict, "a dict", top, where)
    for key, info in storage.items():
        _expect(type(key) is MetadataIndex, key, "a key of field 'storage_data'", "a MetadataIndex", where)
        fqn = _field(key, "fqn", lambda v: type(v) is str, "a str", "a storage key", where)
        _field(key, "offset", lambda v: v is None or _shape(v), f"None or {shape}", f"a storage key of {fqn!r}",
               where)
        _expect(type(info) is _StorageInfo, info, f"the place of {fqn!r} in field 'storage_data'",
                "a _StorageInfo", where)
    _field(meta, "storage_meta", lambda v: v is None or type(v) is StorageMeta, "None or a StorageMeta", top, where)


def _kind(value: Any) -> str:
    """What a value read from the file is, in words: its type, and the value itself when it is short."""
    if value is _MISSING:
        return "missing"
    if value is None:
        return "None"
    name = type(value).__name__
    text = f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    if isinstance(value, (bool, int, float, str, bytes)) or (
            isinstance(value, (tuple, list)) and len(value) <= 8 and all(
                isinstance(v, (bool, int, float, str)) for v in value)):
        shown = _short(value, 40)
        return f"{text} {shown}" if isinstance(value, (tuple, list)) else f"{text} ({shown})"
    return text


def _storage_index(meta: Any, path: str, where: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """Where each entry's bytes are: ``(fqn, chunk offsets)`` -> storage info, each checked to lie in a
    shard file of ``path`` (a plain name, no path) and to be read by the default torch.save format."""
    sizes: dict[str, int] = {}
    out: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for key, info in meta.storage_data.items():
        rel = getattr(info, "relative_path", None)
        off, n = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not _SHARD_NAME.fullmatch(rel) \
                or type(off) is not int or type(n) is not int or off < 0 or n <= 0:
            raise CommandError(f"{where}: its .metadata places data at {_short(rel)}, which is not a shard file "
                               "of the checkpoint; nanhunt refuses it")
        if getattr(info, "transform_descriptors", None):
            raise CommandError(f"{where}: its shards are stored transformed ({_short(info.transform_descriptors)}), "
                               "which nanhunt does not read; save without storage extensions")
        if rel not in sizes:
            file = not_linked(os.path.join(path, rel), f"{where}: its shard file {rel!r}")
            if not os.path.isfile(file):
                raise CommandError(f"{where}: its shard file {rel!r} is missing; copy the whole capture directory")
            sizes[rel] = os.path.getsize(file)
        if off + n > sizes[rel]:
            raise CommandError(f"{where}: its shard file {rel!r} is truncated; copy the whole capture directory")
        offset = None if key.offset is None else tuple(int(i) for i in key.offset)
        out[(str(key.fqn), offset)] = info
    return out


def _check_budget(entries: Mapping[str, Any], storage: Mapping[Any, Any], path: str, where: str) -> None:
    """Every tensor is made of chunks that tile it exactly, each stored in its own bytes (no two entries'
    byte ranges overlap in a shard file): then the full tensors take no more bytes than the shard files hold."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ranges: dict[str, list[tuple[int, int]]] = {}  # shard file -> (offset, length) of every entry read from it
    for (fqn, _), info in storage.items():
        ranges.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length)))
    for rel, spans in ranges.items():
        spans.sort()
        if any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
            raise CommandError(f"{where}: two entries of its .metadata claim the same bytes of {rel!r}; nanhunt "
                               "refuses it")
    for fqn, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            if (fqn, None) not in storage:
                raise CommandError(f"{where}: the data of {fqn!r} is not stored; the capture is damaged")
            continue
        size = tuple(md.size)
        if len(md.chunks) > MAX_CHUNKS:
            raise CommandError(f"{where}: {fqn!r} is stored in {len(md.chunks)} chunks (a capture of N ranks has "
                               f"about N); nanhunt reads at most {MAX_CHUNKS}")
        boxes = []
        for c in md.chunks:
            off, sz = tuple(c.offsets), tuple(c.sizes)
            if any(o + s > d for o, s, d in zip(off, sz, size)):
                raise CommandError(f"{where}: a chunk of {fqn!r} lies outside its shape {size}")
            info = storage.get((fqn, off))
            if info is None:
                raise CommandError(f"{where}: a chunk of {fqn!r} at {off} is not stored; the capture is damaged")
            if math.prod(sz) * md.properties.dtype.itemsize > info.length:
                raise CommandError(f"{where}: a chunk of {fqn!r} claims more bytes than are stored for it; "
                                   "nanhunt refuses it")
            boxes.append((off, sz))
        if sum(math.prod(s) for _, s in boxes) != math.prod(size) or _overlap(boxes, size):
            raise CommandError(f"{where}: the chunks of {fqn!r} do not tile its shape {size}; the capture "
                               "is damaged")


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], size: tuple[int, ...]) -> bool:
    """Whether two of the chunks ``boxes`` (offsets, sizes, each inside ``size``) share an element. Only the
    dimensions along which some chunk is cut count: every chunk spans the others whole. The chunks are sorted by
    where they start along the dimension with the most distinct starts, and each is compared (on every counted
    dimension, at once) with those after it that start before it ends there: no other can share an element with
    it. A split along one dimension compares none; a grid of a x b chunks, each with the b - 1 others of its row."""
    boxes = [(o, s) for o, s in boxes if 0 not in s]  # an empty chunk holds no element
    if len(boxes) < 2:
        return False
    lo = torch.tensor([o for o, _ in boxes], dtype=torch.int64).reshape(len(boxes), len(size))
    hi = lo + torch.tensor([s for _, s in boxes], dtype=torch.int64).reshape(len(boxes), len(size))
    cut = ((lo != 0) | (hi != torch.tensor(size, dtype=torch.int64))).any(0)
    if not bool(cut.any()):
        return True  # two chunks that both span the whole tensor
    lo, hi = lo[:, cut], hi[:, cut]
    axis = max(range(lo.shape[1]), key=lambda a: torch.unique(lo[:, a]).numel())
    order = torch.argsort(lo[:, axis], stable=True)
    lo, hi = lo[order], hi[order]
    ends = torch.searchsorted(lo[:, axis].contiguous(), hi[:, axis].contiguous()).tolist()  # first to start after
    return any(end > i + 1 and bool(((lo[i + 1:end] < hi[i]) & (lo[i] < hi[i + 1:end])).all(1).any())
               for i, end in enumerate(ends))


def _load(path: str, info: Any, where: str, fqn: str) -> Any:
    """One stored entry, read with torch's weights-only unpickler."""
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    check_bytes(data, name=f"{where}: the data of {fqn!r}")  # bounded before the unpickler recurses or allocates
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CommandError(f"{where}: the data of {fqn!r} cannot be read with weights_only=True "
                           f"({_first_line(e)}); the capture is damaged or hostile") from e


def _read_tensor(fqn: str, md: Any, storage: Mapping[Any, Any], path: str, where: str) -> torch.Tensor:
    full = torch.empty(md.size, dtype=md.properties.dtype)
    for c in md.chunks:
        off, sz = tuple(c.offsets), tuple(c.sizes)
        t = _load(path, storage[(fqn, off)], where, fqn)
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta or tuple(t.shape) != sz \
                or t.dtype != full.dtype or t.untyped_storage().nbytes() < t.numel() * t.element_size():
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} {tuple(t.shape)}"
            raise CommandError(f"{where}: a chunk of {fqn!r} holds {what}, not the {full.dtype} {sz} its .metadata "
                               "says; the capture is damaged")
        full[tuple(slice(o, o + s) for o, s in zip(off, sz))] = t
    return full


def _set_nested(out: dict[Any, Any], keys: tuple[Any, ...], value: Any, where: str) -> None:
    node = out
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise CommandError(f"{where} is damaged: two entries claim the same place in the state")
    node[keys[-1]] = value


def _lists(obj: Any) -> Any:
    """DCP flattens lists into integer keys (``param_groups.0``): make them lists again."""
    if not isinstance(obj, dict):
        return obj
    if obj and all(type(k) is int for k in obj) and sorted(obj) == list(range(len(obj))):
        return [_lists(obj[i]) for i in range(len(obj))]
    return {k: _lists(v) for k, v in obj.items()}


# ------------------------------------------------------------------- words
def _short(value: Any, n: int = 80) -> str:
    s = repr(value).encode("unicode_escape").decode("ascii")
    return s if len(s) <= n else s[:n - 3] + "..."


def _few(items: list[str], n: int = 3) -> str:
    shown = ", ".join(_short(i, 60) for i in items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


