"""Private: load a ``.pt`` file that may be damaged or hostile, with one error line per failure.

Before torch reads a zip archive, every member's CRC-32 is checked (torch does not: a flipped bit
in a tensor's data would load as different numbers). A file that is not a zip archive must start
with a valid pickle, as torch's legacy format does. When torch's weights-only unpickler refuses a
file, its pickle opcodes are scanned, without building anything, to say which: a damaged file, or
a valid pickle naming globals that only a full (code-running) unpickle can load. What loads is
checked for what later code could not handle: containers nested deeper than any real batch, and
tensors that are not dense data on the CPU or whose strides make them far larger than the bytes
they hold (a stride-0 view of 2**40 elements).
"""

from __future__ import annotations

import _compat_pickle
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
from collections.abc import Iterable, Mapping
from typing import IO, Any

import torch

from ._errors import CommandError, first_line as _first_line

__all__ = ["load_file"]

MAX_DEPTH = 64  # containers inside containers; real checkpoints and batches nest a handful
MAX_ITEMS = 10_000_000  # values visited, shared references counted each time they are reached
MAX_VIEW_BYTES = 1 << 30  # a view may span at most this much more than the bytes it holds
MAX_OPS = 1_000_000  # pickle opcodes scanned to explain a refusal
_CHUNK = 8 << 20  # CRC-32 is computed in chunks: bounded memory on any file size
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a local file header; an empty archive's end record
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header: 30 bytes


def load_file(path: str, *, what: str, trust_pickle: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True`` and one clear error per failure."""
    name = f"{what} {path!r}"
    size = _check_path(path, name)
    is_zip = _check_format(path, name, size)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the weights-only unpickler runs no code from the file: any error means a bad file
        dtensor = _dtensor_line(path, name, is_zip, e)
        if dtensor is not None:  # one rank's shards: no flag loads them into something a replay can use
            raise CommandError(dtensor) from e
        if not (trust_pickle and _pickled_objects(path, is_zip, e)):
            raise CommandError(_explain(path, name, is_zip, e)) from e
        warnings.warn(f"nanhunt: loading {path} with weights_only=False (--trust-pickle): this runs code from "
                      "the file", stacklevel=2)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e2:
            raise CommandError(f"{name} could not be unpickled: {_first_line(e2)}") from e2
    _check_loaded(obj, name)
    return obj


# ------------------------------------------------------------ before torch
def _check_path(path: str, name: str) -> int:
    if not os.path.exists(path):
        raise CommandError(f"{name} does not exist; check the path")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "manifest.json")):
            raise CommandError(f"{name} is a nanhunt capture directory (written by the Guard under FSDP2), not a "
                               f"file; replay it alone: nanhunt replay {path} [--rank R]")
        if os.path.isfile(os.path.join(path, ".metadata")):
            raise CommandError(f"{name} is a torch.distributed.checkpoint (DCP) directory, not a file; the Guard's "
                               "capture directory holds one beside its batches (nanhunt replay DIR), or convert it "
                               "with python -m torch.distributed.checkpoint.format_utils dcp_to_torch DIR model.pt "
                               "and give that file with --model (it unpickles the directory's metadata: only "
                               "for one you trust)")
        raise CommandError(f"{name} is a directory; give the .pt file")
    if not os.access(path, os.R_OK):
        raise CommandError(f"{name} is not readable; check its permissions")
    size = os.path.getsize(path)
    if size == 0:
        raise CommandError(f"{name} is empty; the job that wrote it probably died while saving")
    return size


def _check_format(path: str, name: str, size: int) -> bool:
    """Whether the file is a zip archive (checked whole); a file that is not must begin with a pickle."""
    with open(path, "rb") as f:
        head = f.read(1024)
        if head[:4] in _ZIP_MAGIC:
            _check_zip(f, name, size)
            return True
        try:
            f.seek(0)
            _scan_pickle(f)
        except Exception as e:  # the scan builds nothing: any error means no valid pickle
            if head[:1] == b"\x80":  # pickle protocol 2+, which torch's legacy format starts with
                raise CommandError(f"{name} is a corrupt or truncated pickle, not a readable torch file "
                                   f"({_reason(e)})") from e
            kind = "text" if _is_text(head) else "binary data"
            raise CommandError(f"{name} is not a torch file: it holds {kind}, neither a zip archive (torch.save) "
                               "nor a pickle (older torch.save)") from e
        f.seek(0)
        if not _legacy_magic(f):
            # torch would unpickle it whole before finding no magic number: with --trust-pickle, run its code
            f.seek(0)
            bad = _forbidden(_scan_pickle(f))
            runs = f" (it names {_few(bad)}, which would run code if unpickled)" if bad else ""
            raise CommandError(f"{name} is a pickle that torch.save did not write (pickle.dump?), not a torch "
                               f"file{runs}; save it with torch.save")
    return False


def _legacy_magic(f: IO[bytes]) -> bool:
    """Whether the first pickle is torch's legacy-format magic number (a lone integer)."""
    ops = []
    for op, arg, _ in pickletools.genops(f):
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


def _check_zip(f: io.BufferedReader, name: str, size: int) -> None:
    """The archive's directory, that it holds a torch pickle, and every member's CRC-32."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except Exception as e:  # zipfile parses the bytes, running nothing: any error means a damaged archive
        raise CommandError(f"{name} is a damaged zip archive (corrupt or truncated): {_first_line(e)}") from e
    if not infos:
        raise CommandError(f"{name} is an empty zip archive, not a torch file")
    if not any(_is_pickle(i.filename) for i in infos):
        raise CommandError(f"{name} is a zip archive but not a torch file: it has no data.pkl")
    buf = bytearray(_CHUNK)
    for info in infos:
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CommandError(f"{name} is not a torch file: its member {info.filename!r} uses compression method "
                               f"{info.compress_type}, which torch does not read")
        try:
            crc = _member_crc(f, info, size, buf)
        except (OSError, ValueError, struct.error, zlib.error):
            crc = None
        if crc is None:
            raise CommandError(f"{name} is corrupt or truncated: its member {info.filename!r} is cut short or "
                               "damaged")
        if crc != info.CRC:
            raise CommandError(f"{name} is corrupt: its member {info.filename!r} fails its CRC-32 check (the "
                               "file changed after it was written); copy it again from its source")


def _is_pickle(member: str) -> bool:
    return member == "data.pkl" or member.endswith("/data.pkl")


def _member_crc(f: io.BufferedReader, info: zipfile.ZipInfo, size: int, buf: bytearray) -> int | None:
    """The CRC-32 of a member's content, read in chunks; None if its bytes are not all in the file.
    torch.save stores members as they are; a re-packed archive may deflate them (torch reads that too)."""
    if info.header_offset < 0:  # zipfile's offset, corrected by the archive's; a damaged one can go below 0
        return None
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        return None
    fields = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]  # + name + extra field
    left = info.compress_size
    inflate = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
    if start + left > size or (inflate is None and info.file_size != left):
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
_MARK = object()
_PUT = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
_GET = ("GET", "BINGET", "LONG_BINGET")


def _scan_pickle(f: IO[bytes]) -> list[str]:
    """The globals one pickle names (``module.name``), from its opcodes: nothing is imported or built.

    Raises ValueError when the bytes are not one valid pickle: a bad opcode or argument, a pop from
    an empty stack, a missing MARK or memo entry, no STOP (the checks of ``pickletools.dis``)."""
    stack: list[object] = []
    memo: dict[object, object] = {}
    names: list[str] = []
    for n, (op, arg, _) in enumerate(pickletools.genops(f)):
        if n >= MAX_OPS:
            break  # enough to judge by; a real torch pickle has a few opcodes per tensor
        if op.name in _PUT:  # stores the top of the stack, which stays
            if not stack or stack[-1] is _MARK:
                raise ValueError(f"{op.name} with nothing to store")
            memo[len(memo) if op.name == "MEMOIZE" else arg] = stack[-1]
            continue
        if op.name in _GET:
            if arg not in memo:
                raise ValueError(f"memo key {arg!r} used before it was stored")
            stack.append(memo[arg])
            continue
        before, after = op.stack_before, op.stack_after
        npop = len(before)
        if pickletools.markobject in before or (op.name == "POP" and stack and stack[-1] is _MARK):
            if _MARK not in stack:
                raise ValueError(f"{op.name} without a MARK")
            while stack.pop() is not _MARK:
                pass
            npop = before.index(pickletools.markobject) if pickletools.markobject in before else 0
        if len(stack) < npop:
            raise ValueError(f"{op.name} pops {npop} items from a stack of {len(stack)}")
        popped = stack[len(stack) - npop:]
        del stack[len(stack) - npop:]
        if op.name in ("GLOBAL", "INST"):
            names.append(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            mod, qual = popped[-2:]
            names.append(f"{mod}.{qual}" if isinstance(mod, str) and isinstance(qual, str) else "<computed name>")
        for item in after:
            if item is pickletools.markobject:
                stack.append(_MARK)
            elif isinstance(arg, str) and op.name not in ("GLOBAL", "INST"):
                stack.append(arg)  # a string: STACK_GLOBAL's module or name
            else:
                stack.append(None)
        if op.name == "STOP" and stack:
            raise ValueError("items left on the stack at STOP")
    return names


def _forbidden(names: Iterable[str]) -> list[str]:
    """The globals torch's weights-only unpickler refuses, in order, once each."""
    allowed: set[str] = set()
    try:
        from torch import _weights_only_unpickler as wou  # private: its allowlist has no public name

        allowed = set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except Exception:  # another torch: name every global that is not torch's own
        pass
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


def _pickles(path: str, is_zip: bool) -> tuple[list[str], str | None]:
    """Globals named by the file's pickle(s), and why scanning stopped early (a damaged pickle) or None.
    A zip archive holds one (data.pkl); the legacy format a few in a row before the raw storages."""
    names: list[str] = []
    try:
        if is_zip:
            with zipfile.ZipFile(path) as z:
                member = next(i for i in z.infolist() if _is_pickle(i.filename))
                names += _scan_pickle(io.BytesIO(z.read(member)))
        else:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for _ in range(5):  # magic number, protocol, system info, the object, storage keys
                    names += _scan_pickle(f)
                    if f.tell() >= size:  # a plain pickle.dump: one pickle
                        break
    except ValueError as e:
        return names, _reason(e)
    except Exception as e:  # the archive was checked already; report, don't crash
        return names, _first_line(e)
    return names, None


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
        return f"{name} is corrupt: its pickle names {_few(missing)}, which does not exist"
    if bad:
        return (f"{name} holds pickled Python objects ({_few(bad)}), which run code when loaded; "
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
    """Refuse what later code would choke on: deep nesting, huge expanded views, sparse/meta tensors."""
    todo: list[tuple[Any, int, tuple[object, ...]]] = [(obj, 0, ())]
    seen = 0
    while todo:
        o, depth, where = todo.pop()
        seen += 1
        if seen > MAX_ITEMS:
            raise CommandError(f"{name} holds more than {MAX_ITEMS:,} values (counting each shared one every "
                               "time it is reached); nanhunt refuses it")
        if isinstance(o, torch.Tensor):
            _check_tensor(o, name, where)
            continue
        if isinstance(o, Mapping):
            children: Iterable[tuple[object, Any]] = o.items()
        elif isinstance(o, (list, tuple, set, frozenset)):
            children = enumerate(o)
        else:
            continue
        if depth >= MAX_DEPTH:
            raise CommandError(f"{name} nests containers more than {MAX_DEPTH} levels deep (at {_at(where)}); "
                               "a real checkpoint or batch nests a few: nanhunt refuses it")
        for k, v in children:
            if isinstance(v, (torch.Tensor, Mapping, list, tuple, set, frozenset)):
                todo.append((v, depth + 1, (*where, k) if depth < 8 else where if depth > 8 else (*where, ...)))
            else:
                seen += 1


def _check_tensor(t: torch.Tensor, name: str, where: tuple[object, ...]) -> None:
    if type(t).__module__.startswith("torch.distributed."):  # a DTensor: torch loads it weights-only once
        raise CommandError(_dtensor_message(name))  # torch.distributed.tensor is imported
    if t.is_meta or t.layout != torch.strided or t.is_nested:
        kind = "a meta tensor (no data)" if t.is_meta else f"a {t.layout} tensor".replace("torch.", "")
        raise CommandError(f"{name} holds {kind} at {_at(where)}; nanhunt reads dense tensors only")
    if t.is_quantized:
        return
    logical = t.numel() * t.element_size()
    held = t.untyped_storage().nbytes()
    if logical > held + MAX_VIEW_BYTES:
        raise CommandError(f"{name} holds a tensor at {_at(where)} of shape {tuple(t.shape)} whose strides "
                           f"{t.stride()} repeat {held:,} bytes of data as {logical:,}; nanhunt refuses views more "
                           f"than {MAX_VIEW_BYTES >> 30} GiB larger than their data")


def _at(where: tuple[object, ...]) -> str:
    s = "".join("..." if k is ... else f"[{k!r}]" for k in where) or "the top level"
    return s if len(s) <= 200 else s[:197] + "..."


def _few(names: list[str], n: int = 3) -> str:
    """The first names, control characters escaped: they come from the file."""
    shown = [s.encode("unicode_escape").decode("ascii") for s in names[:n]]
    return ", ".join(shown) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _reason(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


