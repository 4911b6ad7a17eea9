"""Private: a ``.safetensors`` file read as what it is (no pickle), its header checked against the file before
any tensor is allocated."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import IO, Any

import torch

from ._errors import InputError
from ._json import MAX_JSON_BYTES, parse_json
from ._files import check_readable

__all__ = ["safetensors_header", "load_safetensors", "is_safetensors", "read_safetensors"]

# A safetensors file is 8 bytes giving its header's length (little-endian), the header (JSON: each tensor's dtype,
# shape and data_offsets into the bytes that follow it, and an optional "__metadata__" of strings), then the
# tensors' raw little-endian bytes. nanhunt reads it itself: nothing is unpickled, nothing beyond torch is needed,
# and no tensor is allocated before the whole header has been checked against the file's size.
MAX_SAFETENSORS_HEADER = MAX_JSON_BYTES  # a header spends some 100 bytes a tensor: 16 MiB lists 150,000 of them
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_SAFETENSORS_NAME_CHARS = 200  # of a tensor's name shown in an error
# torch holds each size as an int64; a real tensor has a handful of them, and nanhunt takes no more than this
_MAX_DIMS = 64


@dataclass(frozen=True)
class _Span:
    """One tensor of a safetensors header: its dtype, shape and bytes (offsets into the data after the header)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_header(path: str, *, what: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's dtype and shape in a ``.safetensors`` file, from its header alone, checked as
    :func:`load_safetensors` checks it: what a model is compared with before anything is allocated."""
    name = f"{what} {path!r}"
    size = check_readable(path, name)
    with open(path, "rb") as f:
        spans = _safetensors_spans(f, name, size)
    return {k: (s.dtype, s.shape) for k, s in spans.items()}


def load_safetensors(path: str, *, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file, on the CPU, each allocated once its header has been checked."""
    name = f"{what} {path!r}"
    return read_safetensors(path, name, check_readable(path, name))


def is_safetensors(path: str, size: int) -> bool:
    """Named ``.safetensors``, or beginning as one: a header length the file can hold, then the header's ``{``
    (a torch file begins with a zip or a pickle signature, neither of which has one there)."""
    if path.endswith(".safetensors"):
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


def read_safetensors(path: str, name: str, size: int) -> dict[str, torch.Tensor]:
    if sys.byteorder != "little":
        raise InputError(f"{name} is a safetensors file, whose little-endian bytes nanhunt reads only on a "
                           "little-endian machine")
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        spans = _safetensors_spans(f, name, size)
        data = f.tell()
        for key, s in spans.items():
            buf = bytearray(s.end - s.begin)
            f.seek(data + s.begin)
            if f.readinto(buf) != len(buf):
                raise InputError(f"{name} is truncated: it ended while its tensor {_key(key)} was read (did it "
                                   "change while nanhunt read it?)")
            t = torch.frombuffer(buf, dtype=s.dtype) if buf else torch.empty(0, dtype=s.dtype)
            out[key] = t.reshape(s.shape)
    return out


def _safetensors_spans(f: IO[bytes], name: str, size: int) -> dict[str, _Span]:
    """The header of an open safetensors file, every entry checked, the file left where the data begins."""
    head = f.read(8)
    if len(head) < 8:
        raise InputError(f"{name} is a truncated safetensors file: it ends inside its first 8 bytes (the "
                           "header's length)")
    n = int.from_bytes(head, "little")
    if n > size - 8:
        raise InputError(f"{name} is not a readable safetensors file (corrupt or truncated): its header claims "
                           f"{n:,} bytes, and the file holds {size - 8:,} after the header's length")
    if n > MAX_SAFETENSORS_HEADER:
        raise InputError(f"{name} has a safetensors header of {n / 2**20:,.1f} MiB; a header spends some 100 bytes "
                           f"a tensor, and nanhunt reads at most {MAX_SAFETENSORS_HEADER >> 20} MiB of one")
    try:
        header = parse_json(f.read(n), what="JSON", max_bytes=MAX_SAFETENSORS_HEADER)
    except ValueError as e:
        raise InputError(f"{name} is not a readable safetensors file: its header {e}") from e
    if not isinstance(header, dict):
        raise InputError(f"{name} is not a readable safetensors file: its header is a JSON "
                           f"{type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise InputError(f"{name} is not a readable safetensors file: its __metadata__ is not a map of strings")
    spans = {k: _span(k, v, name, size - 8 - n) for k, v in header.items()}
    order = sorted((s.begin, s.end, k) for k, s in spans.items())
    for (_, end, first), (begin, _, second) in zip(order, order[1:]):
        if begin < end:
            raise InputError(f"{name} is not a valid safetensors file: its tensors {_key(first)} and "
                               f"{_key(second)} share bytes")
    return spans


def _span(key: str, v: Any, name: str, held: int) -> _Span:
    """One header entry checked: a dtype nanhunt reads, a shape of sizes, and offsets spanning exactly the
    tensor's bytes inside the ``held`` bytes of data the file has."""
    bad = f"{name} is not a readable safetensors file: its tensor {_key(key)}"
    if not isinstance(v, dict):
        raise InputError(f"{bad} is a JSON {type(v).__name__}, not its dtype, shape and data_offsets")
    named = v.get("dtype")
    dtype = _SAFETENSORS_DTYPES.get(named) if isinstance(named, str) else None
    if dtype is None:
        raise InputError(f"{bad} has dtype {named!r}, none of the ones nanhunt reads "
                           f"({', '.join(_SAFETENSORS_DTYPES)})")
    shape, offsets = v.get("shape"), v.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise InputError(f"{bad} has no shape (a list of sizes)")
    if len(shape) > _MAX_DIMS or any(d >= 2**63 for d in shape):  # an empty tensor's other sizes cost no bytes
        text = repr(shape)[:200] if len(shape) <= 8 else f"of {len(shape):,} sizes"
        raise InputError(f"{bad} has a shape {text}, which torch cannot hold (at most {_MAX_DIMS} sizes, each "
                         "below 2**63)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise InputError(f"{bad} has no data_offsets (a begin and an end, in order)")
    begin, end = offsets
    need = math.prod(shape) * dtype.itemsize
    what = f"({str(dtype).replace('torch.', '')} of shape {tuple(shape)}, {need:,} bytes)"
    if end - begin != need:
        raise InputError(f"{bad} {what} has data_offsets spanning {end - begin:,} bytes")
    if end > held:
        raise InputError(f"{bad} {what} claims bytes {begin:,} to {end:,} of the data, and the file holds "
                           f"{held:,}: it is truncated or hostile; nanhunt allocates nothing for it")
    return _Span(dtype, tuple(shape), begin, end)


def _key(key: str) -> str:
    """A tensor's name from a file, shortened and quoted (control characters escaped)."""
    return repr(key if len(key) <= _SAFETENSORS_NAME_CHARS else key[:_SAFETENSORS_NAME_CHARS - 3] + "...")


