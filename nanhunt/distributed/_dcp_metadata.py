"""DCP's metadata read bounded: its pickle scanned before a restricted unpickler makes only DCP's own classes, every field checked, the storage and its budget, each tensor read; a capture directory's files never links."""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import pickletools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._util._errors import InputError, first_line as _first_line
from .._util import _dispatch
from .._util._safeload import check_bytes
from .._util._text import few


# a .metadata holds a few kB per tensor; a tensor is stored in about as many chunks as ranks wrote it
MAX_METADATA_BYTES = 64 << 20
MAX_CHUNKS = 4096
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file in state/, never a path


def not_linked(path: str, what: str) -> str:
    """``path`` (a file or directory inside a capture directory, called ``what``), refused when it is a symbolic
    link: the Guard writes none, and one in a capture from someone else could put any file of this machine in
    the report, or make nanhunt read a device forever."""
    if os.path.islink(path):
        raise InputError(f"{what} is a symbolic link; nanhunt reads only the files a capture directory holds, "
                           "never one a link points to: copy the real files into it")
    return path


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
    writes. Its opcodes are followed on a model of the unpickler's stack, marks and memo (:class:`_Scan`);
    nothing is built."""
    scan = _Scan(where)
    ops: Iterable[tuple[Any, Any, Any]] = pickletools.genops(io.BytesIO(data))  # an argument's type is its opcode's
    try:
        for op, arg, _ in ops:
            if scan.cost > MAX_METADATA_MEMORY:
                break
            scan.step(op.name, arg)
    except ValueError as e:  # pickletools: a bad opcode or argument, no STOP
        raise InputError(f"{where}: its .metadata is damaged ({_first_line(e)})") from e
    if scan.cost > MAX_METADATA_MEMORY:
        raise InputError(f"{where}: its .metadata would take more than {MAX_METADATA_MEMORY >> 20} MiB of memory "
                           "to unpickle, which no DCP checkpoint nanhunt reads needs; nanhunt refuses it")


class _Scan:
    """The unpickler's stack, marks and memo as :func:`_scan_metadata` follows the opcodes, and what unpickling
    would cost so far (bytes, estimated)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.table = _opcodes()
        self.stack: list[_Made] = []
        self.marks: list[int] = []  # the stack's length at each MARK, as the unpickler keeps them
        self.memo: list[_Made] = []
        self.cost = 0

    def odd(self, why: str) -> InputError:
        return InputError(f"{self.where}: its .metadata is not a pickle as pickle.dump writes it ({why}); nanhunt "
                            "refuses it")

    def step(self, name: str, arg: Any) -> None:
        """One opcode: what it takes from the stack and leaves there."""
        stack, marks, memo = self.stack, self.marks, self.memo
        kind, base, below, marked, each, leaves = self.table[name]
        self.cost += base
        if arg.__class__ in (str, bytes, bytearray):
            self.cost += len(arg) if arg.__class__ is not str or arg.isascii() else 4 * len(arg)
        if kind == _GETS:
            if not 0 <= arg < len(memo):
                raise self.odd(f"memo key {arg} read before it was stored")
            stack.append(memo[arg])
        elif kind == _PUTS:
            key = len(memo) if name == "MEMOIZE" else arg
            if len(stack) <= (marks[-1] if marks else 0):
                raise self.odd(f"{name} with nothing to store")
            if key > len(memo):  # the unpickler sizes its memo table by the largest key
                raise self.odd(f"memo key {key} skips past the {len(memo)} values stored so far")
            memo[key:key + 1] = [stack[-1]]
        elif kind == _MARKS:
            marks.append(len(stack))
        elif name == "POP" and marks and len(stack) == marks[-1]:
            marks.pop()
        else:
            if marked and not marks:
                raise self.odd(f"{name} without a MARK")
            first = (marks.pop() if marked else len(stack)) - below
            if first < (marks[-1] if marks else 0):  # the unpickler takes no value from below a MARK
                raise self.odd(f"{name} takes more values than the stack holds")
            items = stack[first:]
            del stack[first:]
            if kind != _LEAVES:
                self.make(name, kind, each, items)
            elif arg.__class__ is int:
                self.cost += arg.bit_length() >> 3
            if kind == _LEAVES and name == "DUP":  # the value itself, twice
                stack += items * 2
            elif kind == _LEAVES and leaves:
                stack.append(_LEAF)

    def make(self, name: str, kind: int, each: int, items: list[_Made]) -> None:
        """An opcode that makes a container or object, or puts ``items`` into one (``_CHANGE``: the first)."""
        self.cost += each * len(items)
        made = items[0] if kind == _CHANGE else None
        if made is not None:
            items = items[1:]
            if made is _LEAF or (name == "BUILD" and not made.instance):
                raise self.odd(f"{name} on a value that is no container it made")
        depth = 0
        for i in items:
            i.inside = True
            if i.depth > depth:
                depth = i.depth
            if name in _CALLS or name == "BUILD":  # a call may copy what its arguments hold (torch.Size),
                self.cost += 40 * i.items  # BUILD copies the state's items into the instance
        if made is None:
            made = _Made(depth + 1, len(items), name.startswith("NEWOBJ"))
        elif made.inside:  # its own item, too: a cycle
            raise self.odd("a list, dict or object changes after it was put in another")
        else:
            made.items += len(items)
            made.depth = max(made.depth, depth + 1)
        self.stack.append(made)
        if made.depth > MAX_METADATA_DEPTH:
            raise InputError(f"{self.where}: its .metadata nests values more than {MAX_METADATA_DEPTH} deep (DCP's "
                               "own nest 11); nanhunt refuses it")


def _read_metadata(path: str, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    not_linked(path, where)
    file = not_linked(os.path.join(path, ".metadata"), f"{where}: its .metadata")
    if not os.path.isfile(file):
        raise InputError(f"{where} has no .metadata: it is not a whole torch.distributed.checkpoint; the capture "
                           "is damaged")
    if os.path.getsize(file) > MAX_METADATA_BYTES:
        raise InputError(f"{where}: its .metadata is {os.path.getsize(file)} bytes, more than the "
                           f"{MAX_METADATA_BYTES} nanhunt reads (a few kB per tensor); the capture is damaged")
    with open(file, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    _scan_metadata(data, where)
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Foreign as e:
        raise InputError(f"{where}: its .metadata names {_short(str(e))}, which is not part of a DCP checkpoint's "
                           "metadata and would run code if unpickled; nanhunt refuses it") from e
    except Exception as e:  # the unpickler builds only dataclasses: any error means a damaged file
        raise InputError(f"{where}: its .metadata is damaged ({_first_line(e)})") from e
    if not isinstance(meta, Metadata):
        raise InputError(f"{where}: its .metadata holds a {type(meta).__name__}, not DCP metadata")
    _check_metadata(meta, where)
    return meta


_MISSING = object()


def _expect(ok: bool, value: Any, what: str, expected: str, where: str) -> None:
    """Refuse ``value`` (``_MISSING``: no such field), read from the file as ``what``, unless ``ok``."""
    if not ok:
        raise InputError(f"{where}: its .metadata is damaged: {what} is {_kind(value)}, expected {expected}")


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
            raise InputError(f"{where}: its .metadata places data at {_short(rel)}, which is not a shard file "
                               "of the checkpoint; nanhunt refuses it")
        if getattr(info, "transform_descriptors", None):
            raise InputError(f"{where}: its shards are stored transformed ({_short(info.transform_descriptors)}), "
                               "which nanhunt does not read; save without storage extensions")
        if rel not in sizes:
            file = not_linked(os.path.join(path, rel), f"{where}: its shard file {rel!r}")
            if not os.path.isfile(file):
                raise InputError(f"{where}: its shard file {rel!r} is missing; copy the whole capture directory")
            sizes[rel] = os.path.getsize(file)
        if off + n > sizes[rel]:
            raise InputError(f"{where}: its shard file {rel!r} is truncated; copy the whole capture directory")
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
            raise InputError(f"{where}: two entries of its .metadata claim the same bytes of {rel!r}; nanhunt "
                               "refuses it")
    for fqn, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            if (fqn, None) not in storage:
                raise InputError(f"{where}: the data of {fqn!r} is not stored; the capture is damaged")
            continue
        size = tuple(md.size)
        if len(md.chunks) > MAX_CHUNKS:
            raise InputError(f"{where}: {fqn!r} is stored in {len(md.chunks)} chunks (a capture of N ranks has "
                               f"about N); nanhunt reads at most {MAX_CHUNKS}")
        boxes = []
        for c in md.chunks:
            off, sz = tuple(c.offsets), tuple(c.sizes)
            if any(o + s > d for o, s, d in zip(off, sz, size)):
                raise InputError(f"{where}: a chunk of {fqn!r} lies outside its shape {size}")
            info = storage.get((fqn, off))
            if info is None:
                raise InputError(f"{where}: a chunk of {fqn!r} at {off} is not stored; the capture is damaged")
            if math.prod(sz) * md.properties.dtype.itemsize > info.length:
                raise InputError(f"{where}: a chunk of {fqn!r} claims more bytes than are stored for it; "
                                   "nanhunt refuses it")
            boxes.append((off, sz))
        if sum(math.prod(s) for _, s in boxes) != math.prod(size) or _overlap(boxes, size):
            raise InputError(f"{where}: the chunks of {fqn!r} do not tile its shape {size}; the capture "
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
        raise InputError(f"{where}: the data of {fqn!r} cannot be read with weights_only=True "
                           f"({_first_line(e)}); the capture is damaged or hostile") from e


def _read_tensor(fqn: str, md: Any, storage: Mapping[Any, Any], path: str, where: str) -> torch.Tensor:
    full = torch.empty(md.size, dtype=md.properties.dtype)
    for c in md.chunks:
        off, sz = tuple(c.offsets), tuple(c.sizes)
        t = _load(path, storage[(fqn, off)], where, fqn)
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta or tuple(t.shape) != sz \
                or t.dtype != full.dtype or t.untyped_storage().nbytes() < t.numel() * t.element_size():
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} {tuple(t.shape)}"
            raise InputError(f"{where}: a chunk of {fqn!r} holds {what}, not the {full.dtype} {sz} its .metadata "
                               "says; the capture is damaged")
        full[tuple(slice(o, o + s) for o, s in zip(off, sz))] = t
    return full


def _set_nested(out: dict[Any, Any], keys: tuple[Any, ...], value: Any, where: str) -> None:
    node = out
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise InputError(f"{where} is damaged: two entries claim the same place in the state")
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
    return few(items, n, show=lambda i: _short(i, 60))
