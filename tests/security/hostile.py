"""Generators of small hostile files: each returns the bytes of one file a stranger could attach to a ticket.

Torch files are zip archives laid out as ``torch.save`` lays them out (``archive/data.pkl``, ``archive/byteorder``,
``archive/data/<key>``, ``archive/version``); what makes them hostile is their pickle or their zip directory, not
their names. Zeros are deflated a MiB at a time, so a file that inflates to a GiB costs a few MB to make.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib
from typing import Any

import torch

__all__ = ["torch_zip", "deep_pickle", "decoy_pickle", "many_lists", "zero_storage_batch", "overlapping_zip",
           "big_json"]

_PROTO = b"\x80\x02"  # torch.save's pickle protocol
_STORED, _DEFLATED = 0, 8
_LOCAL = struct.Struct("<4s5H3L2H")  # signature, version, flags, method, time, date, crc, sizes, name and extra lengths
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # the same and comment, disk, attributes, the local header's offset
_END = struct.Struct("<4s4H2LH")  # entries on this disk and in all, the directory's size and offset, comment


class _Member:
    """One member as the archive holds it: its bytes (deflated or not), method, CRC-32 and inflated size."""

    def __init__(self, name: str, data: bytes, *, deflate: bool = False, size: int | None = None,
                 crc: int | None = None) -> None:
        self.name = name.encode()
        self.method = _DEFLATED if deflate else _STORED
        if deflate and size is None:  # plain bytes to deflate here
            self.size, self.crc = len(data), zlib.crc32(data)
            c = zlib.compressobj(9, zlib.DEFLATED, -15)
            data = c.compress(data) + c.flush()
        else:
            self.size = len(data) if size is None else size
            self.crc = zlib.crc32(data) if crc is None else crc
        self.data = data


def _zip(members: list[_Member], directory: list[tuple[str, int]] | None = None) -> bytes:
    """A zip archive of ``members``; its central directory lists ``directory`` (a name and the index of the
    member whose local header it points at), by default each member once under its own name."""
    out = io.BytesIO()
    offsets = []
    for m in members:
        offsets.append(out.tell())
        out.write(_LOCAL.pack(b"PK\x03\x04", 20, 0, m.method, 0, 0x21, m.crc, len(m.data), m.size, len(m.name), 0))
        out.write(m.name + m.data)
    start = out.tell()
    entries = directory if directory is not None else [(m.name.decode(), i) for i, m in enumerate(members)]
    for name, i in entries:
        m, raw = members[i], name.encode()
        out.write(_CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, m.method, 0, 0x21, m.crc, len(m.data), m.size, len(raw),
                                0, 0, 0, 0, 0, offsets[i]))
        out.write(raw)
    out.write(_END.pack(b"PK\x05\x06", 0, 0, len(entries), len(entries), out.tell() - start, start, 0))
    return out.getvalue()


def _zeros(size: int) -> _Member:
    """``size`` zero bytes, deflated a MiB at a time at zlib's fastest level (a GiB in 1.3 s, to 4.5 MB: 230-fold)."""
    c = zlib.compressobj(1, zlib.DEFLATED, -15)
    chunk, parts, crc, left = bytes(1 << 20), [], 0, size
    while left:
        piece = chunk[:min(left, len(chunk))]
        parts.append(c.compress(piece))
        crc = zlib.crc32(piece, crc)
        left -= len(piece)
    parts.append(c.flush())
    return _Member("", b"".join(parts), deflate=True, size=size, crc=crc)


def _named(m: _Member, name: str) -> _Member:
    m.name = name.encode()
    return m


def torch_zip(pkl: bytes, storages: dict[str, bytes] | None = None, *, deflate: bool = False) -> bytes:
    """A torch zip archive holding ``pkl`` as its data.pkl (deflated if asked) and the given storages, stored."""
    return _zip([_Member("archive/data.pkl", pkl, deflate=deflate), _Member("archive/byteorder", b"little"),
                 *(_Member(f"archive/data/{k}", v) for k, v in (storages or {}).items()),
                 _Member("archive/version", b"3\n")])


def deep_pickle(depth: int) -> bytes:
    """A torch zip whose data.pkl is ``{((((),),),): None}``, the key a tuple nested ``depth`` deep (one opcode a
    level, deflated: a million levels take 1.8 kB). Hashing the key recurses once a level, in C."""
    return torch_zip(_deep_key(depth), deflate=True)


def _deep_key(depth: int) -> bytes:
    return _PROTO + b"})" + b"\x85" * depth + b"Ns."  # {}, (), TUPLE1 x depth, None, SETITEM


def decoy_pickle(depth: int, *, same_name: bool = False) -> bytes:
    """A torch zip holding a harmless data.pkl (``{}``) and the one torch reads, :func:`deep_pickle`'s: torch
    reads ``<dir>/data.pkl`` of the directory of the archive's first member, here ``archive/version``, and the
    decoy is ``archive/decoy/data.pkl`` listed before it; ``same_name``: the decoy is ``archive/data.pkl`` too
    (torch reads the last of the two)."""
    decoy = "archive/data.pkl" if same_name else "archive/decoy/data.pkl"
    return _zip([_Member("archive/version", b"3\n"), _Member(decoy, _PROTO + b"}."),
                 _Member("archive/data.pkl", _deep_key(depth), deflate=True), _Member("archive/byteorder", b"little")])


def many_lists(n: int) -> bytes:
    """A torch zip whose data.pkl is one list of ``n`` empty lists (one opcode each, deflated: 8 M take 8.6 kB)."""
    return torch_zip(_PROTO + b"](" + b"]" * n + b"e.", deflate=True)  # [], MARK, [] x n, APPENDS


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    """Pickles as torch.save pickles a float32 tensor of ``shape`` over a storage of its own."""

    def __init__(self, key: str, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
        self.storage = _Storage(key, int(torch.tensor(shape).prod()))

    def __reduce__(self) -> tuple[Any, ...]:
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, self.stride, False,
                                                 collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return "storage", torch.FloatStorage, obj.key, "cpu", obj.numel
        return None


def zero_storage_batch(mib: int) -> bytes:
    """A torch zip of a batch ``(inputs, targets)``: the inputs a float32 tensor over ``mib`` MiB of zeros, its
    storage deflated (a GiB of it takes 4.5 MB), the targets a (2, 4) tensor stored as torch.save stores it."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump((_Tensor("0", ((mib << 20) // 64, 16)), _Tensor("1", (2, 4))))
    return _zip([_Member("archive/data.pkl", buf.getvalue()), _Member("archive/byteorder", b"little"),
                 _named(_zeros(mib << 20), "archive/data/0"), _Member("archive/data/1", bytes(32)),
                 _Member("archive/version", b"3\n")])


def overlapping_zip(n: int, mib: int = 1024) -> bytes:
    """A torch zip of a tensor whose directory lists ``n`` more members that all point at its one storage of
    ``mib`` MiB of deflated zeros: a reader checking every member inflates the same bytes ``n`` + 1 times."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump({"w": _Tensor("0", ((mib << 20) // 4,))})
    members = [_Member("archive/data.pkl", buf.getvalue()), _Member("archive/byteorder", b"little"),
               _named(_zeros(mib << 20), "archive/data/0"), _Member("archive/version", b"3\n")]
    directory = [(m.name.decode(), i) for i, m in enumerate(members)] + [(f"archive/data/{k}", 2)
                                                                          for k in range(1, n + 1)]
    return _zip(members, directory)


def big_json(mib: int) -> bytes:
    """A JSON array of empty arrays, ``mib`` MiB of it: three bytes each, and some 80 bytes each once parsed."""
    n = max((mib << 20) // 3, 1)
    return b"[" + b"[]," * (n - 1) + b"[]]"
