"""Private: load a ``.pt`` or JSON file that may be damaged or hostile, with one error line per failure.

Before torch reads a zip archive, every member's CRC-32 is checked (torch does not: a flipped bit
in a tensor's data would load as different numbers), after its directory: members may not overlap,
nor inflate far beyond the file. A file that is not a zip archive must start with a valid pickle, as
torch's legacy format does. Before torch unpickles anything, the pickle's opcodes are scanned,
building nothing: a damaged pickle, one nesting containers too deep or one too long to unpickle in
bounded memory is refused. When torch's weights-only unpickler refuses a file, the scan says why:
a damaged file, or a valid pickle naming globals that only a full (code-running) unpickle can load.
What loads is checked for what later code could not handle: containers nested deeper than any real
batch, and tensors that are not dense data on the CPU or whose strides make them far larger than
the bytes they hold (a stride-0 view of 2**40 elements). A JSON file (a report, an acceptance rule)
is read bounded in size and depth by :func:`._json.read_json`; a ``.safetensors`` file by :mod:`._safetensors`.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import importlib.util
import io
import os
import pickle
import pickletools
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, cast

import torch

from ._errors import InputError, first_line as _first_line
from ._files import check_readable
from ._safetensors import is_safetensors, read_safetensors
from ._text import escaped, few

__all__ = ["load_file", "check_bytes"]

MAX_DEPTH = 64  # containers inside containers; real checkpoints and batches nest a handful
MAX_ITEMS = 10_000_000  # values visited, shared references counted each time they are reached
MAX_VIEW_BYTES = 1 << 30  # a view may span at most this much more than the bytes it holds
MAX_OPS = 2_000_000  # pickle opcodes: some 40,000 tensors; unpickled, the worst (empty sets) take 0.5 GiB
# torch.save's data.pkl of MAX_OPS opcodes is some 7 MiB; JSON text in it (a model's config) is a few kB and,
# parsed, stays under half a GiB at this size (see _json.MAX_JSON_BYTES)
MAX_PICKLE_BYTES = 16 << 20
MAX_RATIO = 64  # a deflated member growing more than this is mostly zeros: real weights deflate by some 10%
MAX_INFLATED = 64 << 20  # what such members may hold together: zero biases and masks of a re-packed archive
_CHUNK = 8 << 20  # CRC-32 is computed in chunks: bounded memory on any file size
_PICKLE_BUFFER = 1 << 20  # data.pkl is scanned through a buffer: one read(1) an opcode costs a call into zipfile
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a local file header; an empty archive's end record
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header: 30 bytes


def load_file(path: str, *, what: str, trust_pickle: bool = False, safe_globals: Sequence[Any] = ()) -> Any:
    """``torch.load`` with ``weights_only=True`` and one clear error per failure; a ``.safetensors`` file is read
    as what it is (:func:`load_safetensors`). ``safe_globals``: classes and functions the weights-only unpickler
    may also build for this file (NumPy's array reconstruction for an RNG state)."""
    name = f"{what} {path!r}"
    size = check_readable(path, name)
    if is_safetensors(path, size):
        return read_safetensors(path, name, size)
    is_zip = _check_format(path, name, size)
    try:
        with torch.serialization.safe_globals(list(safe_globals)) if safe_globals else contextlib.nullcontext():
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the weights-only unpickler runs no code from the file: any error means a bad file
        dtensor = _dtensor_line(path, name, is_zip, e)
        if dtensor is not None:  # one rank's shards: no flag loads them into something a replay can use
            raise InputError(dtensor) from e
        if not (trust_pickle and _pickled_objects(path, is_zip, e)):
            raise InputError(_explain(path, name, is_zip, e)) from e
        warnings.warn(f"nanhunt: loading {path} with weights_only=False (--trust-pickle): this runs code from "
                      "the file", stacklevel=2)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e2:
            raise InputError(f"{name} could not be unpickled: {_first_line(e2)}") from e2
    _check_loaded(obj, name)
    return obj


# ------------------------------------------------------------ before torch
def check_bytes(data: bytes, *, name: str) -> None:
    """The checks :func:`load_file` makes before torch reads a file, for a torch file held in memory (an entry
    of a DCP checkpoint, for ``torch.load(io.BytesIO(data))``): its format, zip directory, CRCs and pickle."""
    if not data:
        raise InputError(f"{name} is empty; the job that wrote it probably died while saving")
    _check_stream(io.BytesIO(data), name, len(data))


def _check_format(path: str, name: str, size: int) -> bool:
    """Whether the file is a zip archive (checked whole); a file that is not must begin with a pickle. Either
    way, the pickle torch would read is scanned (:func:`_scan_pickle`) and refused when too deep or long."""
    with open(path, "rb") as f:
        return _check_stream(f, name, size)


def _check_stream(f: io.BufferedIOBase, name: str, size: int) -> bool:
    """:func:`_check_format` of an open file."""
    head = f.read(1024)
    if head[:4] in _ZIP_MAGIC:
        _check_zip(f, name, size)
        return True
    try:
        f.seek(0)
        _scan_pickle(f)
    except _PickleTooBig as e:
        raise InputError(f"{name} {e}; nanhunt refuses it unread") from e
    except Exception as e:  # the scan builds nothing: any error means no valid pickle
        if head[:1] == b"\x80":  # pickle protocol 2+, which torch's legacy format starts with
            raise InputError(f"{name} is a corrupt or truncated pickle, not a readable torch file "
                               f"({_reason(e)})") from e
        kind = "text" if _is_text(head) else "binary data"
        raise InputError(f"{name} is not a torch file: it holds {kind}, neither a zip archive (torch.save) "
                           "nor a pickle (older torch.save)") from e
    f.seek(0)
    if not _legacy_magic(f):
        # torch would unpickle it whole before finding no magic number: with --trust-pickle, run its code
        f.seek(0)
        bad = _forbidden(_scan_pickle(f))
        runs = f" (it names {few(bad, show=escaped)}, which would run code if unpickled)" if bad else ""
        raise InputError(f"{name} is a pickle that torch.save did not write (pickle.dump?), not a torch "
                           f"file{runs}; save it with torch.save")
    _check_pickles(f, name, legacy=True)
    return False


def _legacy_magic(f: io.BufferedIOBase) -> bool:
    """Whether the first pickle is torch's legacy-format magic number (a lone integer)."""
    ops = []
    for op, arg, _ in pickletools.genops(cast(IO[bytes], f)):
        ops.append((op.name, arg))
        if len(ops) > 4:
            return False
    return any(arg == torch.serialization.MAGIC_NUMBER for name, arg in ops if name.startswith(("LONG", "INT")))


def _is_text(head: bytes) -> bool:
    try:
        s = head.decode("utf-8")
    except UnicodeDecodeError as e:
        s = head[:e.start].decode("utf-8")  # the buffer may end inside a character
        if e.start < len(head) - 3:
            return False
    return all(c.isprintable() or c in "\t\r\n" for c in s)


def _check_zip(f: io.BufferedIOBase, name: str, size: int) -> None:
    """The archive's directory, that it holds a torch pickle, every member's CRC-32, then that pickle's opcodes."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except Exception as e:  # zipfile parses the bytes, running nothing: any error means a damaged archive
        raise InputError(f"{name} is a damaged zip archive (corrupt or truncated): {_first_line(e)}") from e
    if not infos:
        raise InputError(f"{name} is an empty zip archive, not a torch file")
    seen: set[str] = set()
    for info in infos:  # which of two a reader takes is its own choice: the one checked may not be the one read
        if info.filename in seen:
            raise InputError(f"{name} is not a valid zip archive: it lists two members named {info.filename!r}")
        seen.add(info.filename)
    pkl = _torch_pickle(infos)
    if pkl is None:
        raise InputError(f"{name} is a zip archive but not a torch file: it has no data.pkl")
    starts: dict[zipfile.ZipInfo, int] = {}
    for info in infos:
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InputError(f"{name} is not a torch file: its member {info.filename!r} uses compression method "
                               f"{info.compress_type}, which torch does not read")
        try:
            start = _member_start(f, info, size)
        except (OSError, ValueError, struct.error):
            start = None
        if start is None:
            raise _cut_short(name, info)
        starts[info] = start
    _check_overlap(starts, name)
    _check_sizes(infos, pkl, name)
    buf = bytearray(_CHUNK)
    for info in infos:
        try:
            crc = _member_crc(f, info, starts[info], buf)
        except (OSError, ValueError, zlib.error):
            crc = None
        if crc is None:
            raise _cut_short(name, info)
        if crc != info.CRC:
            raise InputError(f"{name} is corrupt: its member {info.filename!r} fails its CRC-32 check (the "
                               "file changed after it was written); copy it again from its source")
    f.seek(starts[pkl])
    data = f.read(pkl.compress_size)  # at most MAX_PICKLE_BYTES, inflated: torch reads it whole too
    if pkl.compress_type == zipfile.ZIP_DEFLATED:
        data = zlib.decompressobj(-15).decompress(data, MAX_PICKLE_BYTES)
    _check_pickles(io.BytesIO(data), name, legacy=False)


def _torch_pickle(infos: list[zipfile.ZipInfo]) -> zipfile.ZipInfo | None:
    """The pickle torch reads: ``data.pkl`` in the directory of the archive's first member."""
    want = infos[0].filename.partition("/")[0] + "/data.pkl"
    return next((i for i in infos if i.filename == want), None)


def _cut_short(name: str, info: zipfile.ZipInfo) -> InputError:
    return InputError(f"{name} is corrupt or truncated: its member {info.filename!r} is cut short or damaged")


def _check_sizes(infos: list[zipfile.ZipInfo], pkl: zipfile.ZipInfo, name: str) -> None:
    """Refuse members that would grow far beyond the file once read, from what the directory declares.

    torch.save stores every member as it is; an archive re-packed by a zip tool deflates them, which
    torch reads too: weights shrink little (float data deflates by some 10%), zeros a thousandfold.
    So members deflated beyond ``MAX_RATIO`` (a zero bias, a mask) may hold ``MAX_INFLATED`` together:
    a 1 MB member declaring a GiB of zeros is refused before anything inflates it (torch would
    allocate it whole). data.pkl is read whole by torch: at most ``MAX_PICKLE_BYTES``."""
    inflated = 0
    for info in infos:
        if info is pkl and info.file_size > MAX_PICKLE_BYTES:
            raise InputError(f"{name} holds a pickle ({info.filename!r}) of {info.file_size / 2**20:,.1f} MiB; "
                               f"torch.save writes some 100 bytes a tensor, and nanhunt reads at most "
                               f"{MAX_PICKLE_BYTES >> 20} MiB")
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > MAX_RATIO * info.compress_size:
            inflated += info.file_size
            if inflated > MAX_INFLATED:
                raise InputError(f"{name} is not as torch.save writes it: its member {info.filename!r} inflates "
                                   f"{info.compress_size:,} bytes to {info.file_size / 2**20:,.1f} MiB, and "
                                   f"nanhunt reads at most {MAX_INFLATED >> 20} MiB of members deflated over "
                                   f"{MAX_RATIO}-fold; save it again with torch.save, which stores them as they are")


def _member_start(f: io.BufferedIOBase, info: zipfile.ZipInfo, size: int) -> int | None:
    """Where a member's bytes begin, after its local header; None if they are not all in the file."""
    if info.header_offset < 0:  # zipfile's offset, corrected by the archive's; a damaged one can go below 0
        return None
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        return None
    fields = _LOCAL_HEADER.unpack(header)
    start: int = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]  # + name + extra field
    if start + info.compress_size > size:
        return None
    return start


def _check_overlap(starts: Mapping[zipfile.ZipInfo, int], name: str) -> None:
    """Refuse members sharing bytes: a directory listing one deflated GiB ten thousand times would have it
    inflated ten thousand times. Sorted by where they begin, each must end before the next begins."""
    spans = sorted((info.header_offset, start + info.compress_size, info.filename)
                   for info, start in starts.items())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise InputError(f"{name} is not a valid zip archive: its members {first!r} and {second!r} overlap "
                               "(a zip bomb's trick: nanhunt would inflate the same bytes once for each)")


def _member_crc(f: io.BufferedIOBase, info: zipfile.ZipInfo, start: int, buf: bytearray) -> int | None:
    """The CRC-32 of a member's content (its bytes begin at ``start``), read in chunks; None if they are cut
    short. torch.save stores members as they are; a re-packed archive may deflate them (torch reads that too)."""
    left = info.compress_size
    inflate = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
    if inflate is None and info.file_size != left:
        return None
    f.seek(start)
    view = memoryview(buf)
    crc = out = 0
    while left:
        n = f.readinto(view[:min(left, len(buf))])
        if not n:
            return None
        left -= n
        if inflate is None:
            crc = zlib.crc32(view[:n], crc)
            continue
        data = inflate.decompress(view[:n], _CHUNK)  # at most a chunk at a time: bounded memory
        while data:
            crc, out = zlib.crc32(data, crc), out + len(data)
            if out > info.file_size:
                return None
            data = inflate.decompress(inflate.unconsumed_tail, _CHUNK) if inflate.unconsumed_tail else b""
    if inflate is not None:
        out += len(rest := inflate.flush())
        crc = zlib.crc32(rest, crc)
        if out != info.file_size:
            return None
    return crc


# ---------------------------------------------------------- pickle opcodes
class _PickleTooBig(ValueError):
    """A valid pickle beyond what nanhunt unpickles: nested too deep, or too many opcodes."""


_PUT = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
_GET = ("GET", "BINGET", "LONG_BINGET")
_BUILDS = ("EMPTY_LIST", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "DICT",
           "EMPTY_SET", "FROZENSET")  # a container of the items they pop
_ADDS = ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS")  # put items into the container below them
_CALLS = ("REDUCE", "NEWOBJ", "NEWOBJ_EX")  # a callable and its argument tuple: what it makes holds the arguments
_STRINGS = ("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
            "BINUNICODE8")  # kept on the stack as they are: STACK_GLOBAL's module and name
_KINDS = (_PUT, _GET, ("MARK",), ("POP",), _BUILDS, _ADDS, _CALLS, _STRINGS, ("GLOBAL", "INST"), ("STACK_GLOBAL",),
          ("STOP",))
_K_PUT, _K_GET, _K_MARK, _K_POP, _K_BUILDS, _K_ADDS, _K_CALLS, _K_STRING, _K_GLOBAL, _K_STACK_GLOBAL, _K_STOP = \
    range(len(_KINDS))
_K_OTHER = len(_KINDS)
# each opcode: its kind, the items it pops (below its MARK if it has one), whether it pops to a MARK, and pushes
_OPS = {op: (next((k for k, names in enumerate(_KINDS) if op.name in names), _K_OTHER),
             op.stack_before.index(pickletools.markobject) if pickletools.markobject in op.stack_before
             else len(op.stack_before), pickletools.markobject in op.stack_before, len(op.stack_after))
        for op in pickletools.opcodes}
_PICKLE_DEPTH = MAX_DEPTH + 2  # a tensor's own pickle nests its arguments two deep below what holds it


class _Reader:
    """A stream's read and readline alone: without ``tell``, genops asks for no position each opcode (a call
    into zipfile, or a seek, each time)."""

    def __init__(self, f: io.BufferedIOBase) -> None:
        self.read = f.read
        self.readline = f.readline


def _scan_pickle(f: io.BufferedIOBase) -> list[str]:
    """The globals one pickle names (``module.name``), from its opcodes: nothing is imported or built.

    Raises ValueError when the bytes are not one valid pickle: a bad opcode or argument, a pop from
    below the last MARK, a missing MARK or memo entry, no STOP (the checks of ``pickletools.dis``);
    :class:`_PickleTooBig` when unpickling it would nest containers deeper than ``MAX_DEPTH`` (a tuple
    key nested a million deep crashes the process when hashed) or it has more than ``MAX_OPS``
    opcodes (each builds up to some 250 bytes: 8 M empty lists take 3 GB). The stack holds how deep
    each item nests (a string stays itself); memory is a few bytes an opcode."""
    stack: list[int | str] = []
    marks: list[int] = []  # where on the stack each open MARK sits
    memo: dict[object, int | str] = {}
    names: list[str] = []
    n = 0
    for op, arg, _ in pickletools.genops(cast(IO[bytes], _Reader(f))):
        n += 1
        if n > MAX_OPS:
            raise _PickleTooBig(f"is a pickle of more than {MAX_OPS:,} opcodes (torch.save writes about 45 a tensor)")
        kind, npop, marked, npush = _OPS[op]
        floor = marks[-1] if marks else 0
        if kind == _K_PUT:  # stores the top of the stack, which stays
            if len(stack) <= floor:
                raise ValueError(f"{op.name} with nothing to store")
            memo[len(memo) if op.name == "MEMOIZE" else arg] = stack[-1]
            continue
        if kind == _K_GET:
            if arg not in memo:
                raise ValueError(f"memo key {arg!r} used before it was stored")
            stack.append(memo[arg])
            continue
        if kind == _K_MARK:
            marks.append(len(stack))
            if len(marks) > MAX_DEPTH:
                raise _PickleTooBig(f"nests containers more than {MAX_DEPTH} levels deep")
            continue
        if not (npop or marked or npush):  # PROTO, FRAME
            continue
        if not (npop or marked):  # a value: a string, a number, an empty container, a global
            if kind == _K_GLOBAL:
                names.append(str(arg).replace(" ", "."))
            stack.append(arg if kind == _K_STRING and isinstance(arg, str) else 1 if kind == _K_BUILDS else 0)
            continue
        items: list[int | str] = []
        if marked or (kind == _K_POP and marks and len(stack) == floor):  # POP of a MARK on top pops the MARK
            if not marks:
                raise ValueError(f"{op.name} without a MARK")
            del marks[-1]
            items, stack[floor:] = stack[floor:], []
            floor = marks[-1] if marks else 0
        if len(stack) - floor < npop:
            raise ValueError(f"{op.name} pops {npop} items from a stack of {len(stack) - floor}")
        popped = stack[len(stack) - npop:]
        del stack[len(stack) - npop:]
        depth = 0
        for item in popped[1:] if kind == _K_ADDS else popped:
            if type(item) is int and item > depth:
                depth = item
        for item in items:
            if type(item) is int and item > depth:
                depth = item
        if kind == _K_BUILDS:
            depth += 1
        elif kind == _K_ADDS:  # the container is as deep as it was, or one more than what it now holds
            depth = max(popped[0] if type(popped[0]) is int else 0, depth + 1)
        elif kind == _K_CALLS:
            depth = max(depth - 1, 0)
        elif kind == _K_GLOBAL:
            names.append(str(arg).replace(" ", "."))
        elif kind == _K_STACK_GLOBAL:
            mod, qual = popped
            names.append(f"{mod}.{qual}" if isinstance(mod, str) and isinstance(qual, str) else "<computed name>")
        elif kind == _K_STOP and (stack or marks):
            raise ValueError("items left on the stack at STOP")
        if depth > _PICKLE_DEPTH:
            raise _PickleTooBig(f"nests containers more than {MAX_DEPTH} levels deep")
        stack += [depth] * npush
    return names


def _forbidden(names: Iterable[str]) -> list[str]:
    """The globals torch's weights-only unpickler refuses, in order, once each."""
    from ._dispatch import weights_only_allowed

    allowed = weights_only_allowed()
    out: list[str] = []
    for full in names:
        mod, _, qual = full.rpartition(".")
        mod, qual = _compat_pickle.NAME_MAPPING.get((mod, qual), (_compat_pickle.IMPORT_MAPPING.get(mod, mod), qual))
        ok = f"{mod}.{qual}" in allowed if allowed else mod.partition(".")[0] in ("torch", "collections")
        if not ok and full not in out:
            out.append(full)
    return out


def _exists(full: str) -> bool:
    """Whether a global's module could hold it, judged without importing or running anything: a loaded
    module's own namespace, else whether its top-level package is installed at all."""
    mod, _, qual = full.rpartition(".")
    loaded = sys.modules.get(mod)
    if loaded is not None:
        if qual in vars(loaded):
            return True
        # a module __getattr__ (torch has one) may make more: torch's own is asked, another's is trusted
        return hasattr(loaded, qual) if mod.partition(".")[0] == "torch" else "__getattr__" in vars(loaded)
    top = mod.partition(".")[0]
    if not top.isidentifier():
        return False
    try:
        return top in sys.modules or importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _pickles(source: str | io.BufferedIOBase, is_zip: bool) -> tuple[list[str], str | None]:
    """Globals named by the file's pickle(s) (a path or an open file), and why scanning stopped early (a damaged
    pickle) or None; :class:`_PickleTooBig` when one is beyond what nanhunt unpickles. A zip archive holds one
    (data.pkl, read as a stream: it is never held whole); the legacy format a few in a row before the storages."""
    names: list[str] = []
    try:
        if is_zip:
            with zipfile.ZipFile(source) as z:
                member = _torch_pickle(z.infolist())
                if member is None:
                    raise ValueError("no data.pkl")
                with z.open(member) as m:
                    names += _scan_pickle(io.BufferedReader(m, _PICKLE_BUFFER))  # type: ignore[type-var]
        else:
            with open(source, "rb") if isinstance(source, str) else contextlib.nullcontext(source) as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                for _ in range(5):  # magic number, protocol, system info, the object, storage keys
                    names += _scan_pickle(f)
                    if f.tell() >= size:  # a plain pickle.dump: one pickle
                        break
    except _PickleTooBig:
        raise
    except ValueError as e:
        return names, _reason(e)
    except Exception as e:  # the archive was checked already; report, don't crash
        return names, _first_line(e)
    return names, None


def _check_pickles(f: io.BufferedIOBase, name: str, *, legacy: bool) -> None:
    """Refuse, before torch unpickles it, a pickle too deep or too large to unpickle safely, or a damaged one:
    ``f`` is a legacy-format file (a few pickles), or holds a zip archive's data.pkl."""
    try:
        if legacy:
            damaged = _pickles(f, False)[1]
        else:
            _scan_pickle(f)
            damaged = None
    except _PickleTooBig as e:
        raise InputError(f"{name} {e}; nanhunt refuses it unread") from e
    except ValueError as e:
        damaged = _reason(e)
    if damaged is not None:
        raise InputError(f"{name} is corrupt: its pickle is damaged ({damaged})")


def _pickled_objects(path: str, is_zip: bool, e: Exception) -> bool:
    """Whether torch's weights-only unpickler refused a valid pickle (one a full unpickle may load)."""
    return isinstance(e, pickle.UnpicklingError) and _pickles(path, is_zip)[1] is None


def _dtensor_line(path: str, name: str, is_zip: bool, e: Exception) -> str | None:
    """The line for a file of DTensor shards (``state_dict()`` of an FSDP2 model saved on one rank), or None."""
    if not isinstance(e, pickle.UnpicklingError):
        return None
    names, damaged = _pickles(path, is_zip)
    if damaged is not None or not any(n.startswith("torch.distributed.") and n.endswith(".DTensor") for n in names):
        return None
    return _dtensor_message(name)


def _dtensor_message(name: str) -> str:
    return (f"{name} holds DTensor shards (one rank's piece of an FSDP2 / tensor-parallel model), not full tensors: "
            "nanhunt cannot put the pieces together from one file; replay the capture directory nanhunt.Guard "
            "writes under FSDP2 (nanhunt replay DIR), or save full tensors (get_model_state_dict with "
            "StateDictOptions(full_state_dict=True))")


def _explain(path: str, name: str, is_zip: bool, e: Exception) -> str:
    names, damaged = _pickles(path, is_zip)
    if damaged is not None:
        return f"{name} is corrupt: its pickle is damaged ({damaged})"
    bad = _forbidden(names)
    missing = [n for n in bad if not _exists(n)]
    if missing:  # a name no installed code has: a damaged name, not an object to trust
        return f"{name} is corrupt: its pickle names {few(missing, show=escaped)}, which does not exist"
    if bad:
        return (f"{name} holds pickled Python objects ({few(bad, show=escaped)}), which run code when loaded; "
                "if you trust its source, rerun with --trust-pickle")
    if isinstance(e, pickle.UnpicklingError):
        # a valid pickle of allowed names that the safe loader still refuses (an opcode it lacks)
        why = _torch_reason(e)
        return f"{name} is a pickle that torch's weights-only loader cannot read ({why}); if you trust its source, " \
               "rerun with --trust-pickle"
    return f"{name} is not a readable torch file (corrupt or truncated): {_first_line(e)}"


def _torch_reason(e: Exception) -> str:
    """The line of torch's weights-only refusal that says why (the rest is generic advice)."""
    for line in str(e).splitlines()[1:]:
        why = line.rpartition("WeightsUnpickler error:")[2].strip()
        if why and not why.startswith(("Check the documentation", "Please file")):
            return why
    return _first_line(e)


# ------------------------------------------------------------- after torch
def _check_loaded(obj: Any, name: str) -> None:
    """Refuse what later code would choke on: deep nesting, huge expanded views (one alone, or all of them
    together: :class:`_Copies`), sparse/meta tensors.
    Walked depth first, one open container a level: memory stays bounded however many items there are."""
    copies = _Copies()
    _walk_loaded(obj, name, copies)
    copies.check(name)


def _walk_loaded(obj: Any, name: str, copies: _Copies) -> None:
    if isinstance(obj, torch.Tensor):
        _check_tensor(obj, name, (), copies)
        return
    top = _children(obj)
    levels: list[tuple[Iterator[tuple[object, Any]], tuple[object, ...]]] = [(top, ())] if top is not None else []
    seen = 1
    while levels:
        items, where = levels[-1]
        for k, v in items:
            seen += 1
            if seen > MAX_ITEMS:
                raise InputError(f"{name} holds more than {MAX_ITEMS:,} values (counting each shared one every "
                                   "time it is reached); nanhunt refuses it")
            depth = len(levels)  # of v
            at = (*where, k) if depth <= 8 else where if depth > 9 else (*where, ...)
            if isinstance(v, torch.Tensor):
                _check_tensor(v, name, at, copies)
                continue
            inner = _children(v)
            if inner is None:
                continue
            if depth >= MAX_DEPTH:
                raise InputError(f"{name} nests containers more than {MAX_DEPTH} levels deep (at {_at(at)}); "
                                   "a real checkpoint or batch nests a few: nanhunt refuses it")
            levels.append((inner, at))
            break
        else:
            levels.pop()


def _children(o: Any) -> Iterator[tuple[object, Any]] | None:
    """A container's (key or index, value) pairs; None for anything else."""
    if isinstance(o, Mapping):
        return iter(o.items())
    if isinstance(o, (list, tuple, set, frozenset)):
        return enumerate(o)
    return None


class _Copies:
    """What a file's tensors take once each is copied, against the bytes of data they hold. A view costs nothing
    when loaded, and its copy is as large as its shape: the replay's snapshot copies every optimizer state tensor,
    so four stride-0 views of 0.7 GiB over one float (each within :data:`MAX_VIEW_BYTES` of its data) would take
    2.8 GiB from a file of kilobytes, and ten thousand views of one tensor ten thousand times its size. Each tensor
    reached counts, however often (each is copied); each storage once."""

    def __init__(self) -> None:
        self.data = 0
        self.copied = 0
        self._storages: set[tuple[int, int]] = set()

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._storages:
            self._storages.add(key)
            self.data += key[1]
        self.copied += t.numel() * t.element_size()

    def check(self, name: str) -> None:
        """Refuse copies of more than twice the data, or of more than :data:`MAX_VIEW_BYTES` beyond it, whichever
        is more: a state dict's tied weights (GPT-2's head and embedding, one tensor saved once) stay within it."""
        if self.copied > max(2 * self.data, self.data + MAX_VIEW_BYTES):
            raise InputError(f"{name} holds tensors that would take {self.copied:,} bytes once copied, from "
                             f"{self.data:,} bytes of data (views repeat their data: a stride-0 view, several views "
                             "of one tensor); nanhunt takes views up to twice their data or "
                             f"{MAX_VIEW_BYTES >> 30} GiB beyond it, whichever is more; save the tensors themselves "
                             "(.clone())")


def _check_tensor(t: torch.Tensor, name: str, where: tuple[object, ...], copies: _Copies) -> None:
    if type(t).__module__.startswith("torch.distributed."):  # a DTensor: torch loads it weights-only once
        raise InputError(_dtensor_message(name))  # torch.distributed.tensor is imported
    if t.is_meta or t.layout != torch.strided or t.is_nested:
        kind = "a meta tensor (no data)" if t.is_meta else f"a {t.layout} tensor".replace("torch.", "")
        raise InputError(f"{name} holds {kind} at {_at(where)}; nanhunt reads dense tensors only")
    if t.is_quantized:
        return
    copies.add(t)
    logical = t.numel() * t.element_size()
    held = t.untyped_storage().nbytes()
    if logical > held + MAX_VIEW_BYTES:
        raise InputError(f"{name} holds a tensor at {_at(where)} of shape {tuple(t.shape)} whose strides "
                           f"{t.stride()} repeat {held:,} bytes of data as {logical:,}; nanhunt refuses views more "
                           f"than {MAX_VIEW_BYTES >> 30} GiB larger than their data")


def _at(where: tuple[object, ...]) -> str:
    s = "".join("..." if k is ... else f"[{k!r}]" for k in where) or "the top level"
    return s if len(s) <= 200 else s[:197] + "..."


def _reason(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__
