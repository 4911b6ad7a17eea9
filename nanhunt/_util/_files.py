"""Private: every file nanhunt writes goes through a new file, never through what is already at the name.

A report or bundle lands in a directory someone else may write to. Opening ``report.html`` for
writing would follow a link planted there (``report.html -> ../victim.txt``) and overwrite its
target, and would block on a FIFO. Instead the data goes into a file created exclusively beside it
(``O_CREAT | O_EXCL | O_NOFOLLOW``), which ``os.replace`` then renames onto the name: a rename
replaces a link, never its target, so a link that appears between the check and the write is
harmless. A link found at the name is refused (see :func:`check_target`).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ._errors import InputError

__all__ = ["check_target", "check_directory", "new_file", "write_file", "check_readable"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
    | getattr(os, "O_BINARY", 0)


def check_target(path: str) -> bool:
    """Raise :class:`InputError` unless ``path`` can be replaced by a new file: it is absent or a regular
    file (then True: it will be replaced). A symbolic link there is refused, not followed nor replaced:
    nanhunt did not make it, and whoever did either means to redirect the write (hostile) or expects the
    link to survive; either way the user decides."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise InputError(f"cannot write {path!r}: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise InputError(f"refusing to write {path!r}: it is a symbolic link (to {target!r}) and nanhunt never "
                           "writes through a link; remove it or give another path")
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"cannot write {path!r}: it is a directory; give a file name")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"cannot write {path!r}: it is not a regular file; give another path")
    return True


def check_directory(directory: str, *, what: str = "") -> None:
    """Raise :class:`InputError` unless files can be created in ``directory``, or it can be made (its nearest
    existing ancestor is a writable directory). An existing directory is probed with a file created and removed
    at once: permission bits do not stop root, a read-only or immutable file system does."""
    label = f"{what} {directory!r}" if what else repr(directory)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        kind = "a symbolic link to nothing" if os.path.islink(directory) else "a file, not a directory"
        raise InputError(f"cannot write into {label}: it is {kind}; give a directory (made if missing)")
    if os.path.isdir(directory):
        try:
            fd, tmp = _create_beside(os.path.join(directory, "probe"))
        except OSError as e:
            raise InputError(f"cannot write into {label}: {e.strerror}; give another directory") from e
        os.close(fd)
        os.unlink(tmp)
        return
    parent = os.path.dirname(os.path.abspath(directory))
    while not os.path.lexists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InputError(f"cannot create {label}: {parent!r} is a file, not a directory; give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot create {label}: the directory {parent!r} is not writable; give another path")


def _create_beside(path: str) -> tuple[int, str]:
    """A new, empty file in the directory of ``path`` under a hidden random name: (descriptor, name)."""
    directory, name = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, _FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path!r}")


@contextmanager
def new_file(path: str) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; on success it replaces ``path``, on any error it is
    removed and ``path`` is left as it was. OSErrors become one-line :class:`InputError`\\ s."""
    check_target(path)
    try:
        fd, tmp = _create_beside(path)
    except OSError as e:
        raise InputError(f"cannot write {path!r}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        check_target(path)  # a link planted during the write: refuse; one planted after this is replaced, not followed
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise InputError(f"cannot write {path!r}: {e.strerror or e}") from e
        raise


def write_file(path: str, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a new file (:func:`new_file`)."""
    with new_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def check_readable(path: str, name: str) -> int:
    """The size of the file ``path`` (``name``: how errors call it), which exists, is readable and not empty; a
    directory is refused, saying what kind it is and what to give instead."""
    if not os.path.exists(path):
        raise InputError(f"{name} does not exist; check the path")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "manifest.json")):
            raise InputError(f"{name} is a nanhunt capture directory (written by the Guard under FSDP2), not a "
                               f"file; replay it alone: nanhunt replay {path} [--rank R]")
        if os.path.isfile(os.path.join(path, ".metadata")):
            raise InputError(f"{name} is a torch.distributed.checkpoint (DCP) directory, not a file; the Guard's "
                               "capture directory holds one beside its batches (nanhunt replay DIR), or convert it "
                               "with python -m torch.distributed.checkpoint.format_utils dcp_to_torch DIR model.pt "
                               "and give that file with --model (it unpickles the directory's metadata: only "
                               "for one you trust)")
        if os.path.isfile(os.path.join(path, "config.json")):
            raise InputError(f"{name} is a transformers checkpoint directory, not a file; replay it with the batch "
                               f"of its next step (nanhunt replay {path} batch.pt), or give one of its files (its "
                               "model.safetensors)")
        raise InputError(f"{name} is a directory; give the .pt file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{name} is not readable; check its permissions")
    size = os.path.getsize(path)
    if size == 0:
        raise InputError(f"{name} is empty; the job that wrote it probably died while saving")
    return size
