"""Private: every file nanhunt writes goes through a new file, never through what is already at the name.

A report or bundle lands in a directory someone else may write to, and so does the Guard's dump directory.
Opening ``report.html`` for writing would follow a link planted there (``report.html -> ../victim.txt``) and
overwrite its target, and would block forever on a FIFO no one reads. Instead the data goes into a file created
exclusively beside it (``O_CREAT | O_EXCL | O_NOFOLLOW``), which ``os.replace`` then renames onto the name: a
rename replaces a link, never its target, so a link that appears between the check and the write is harmless. A
link, FIFO or anything else that is not a regular file found at the name is refused (see :func:`check_target`).
An append-only log (the Guard's ``rollbacks.jsonl``) is opened with ``O_APPEND | O_NOFOLLOW | O_NONBLOCK`` and
written only once it is seen to be a regular file of one name (:func:`append_file`).

A refusal is a :class:`WriteError`: bad input to the command line (one line, exit 2), and an ``OSError`` to code
that goes on without the file (the Guard warns and the training continues).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import BinaryIO

from ._errors import InputError

__all__ = ["WriteError", "check_target", "check_directory", "new_file", "new_files", "write_file", "append_file",
           "read_own", "check_readable"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_COMMON = _NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _COMMON
# O_NONBLOCK: a FIFO opens at once (or fails, ENXIO, with no reader) instead of waiting for a reader; a regular
# file ignores it
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | _COMMON
_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _COMMON
_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"))


class WriteError(InputError, OSError):
    """A file nanhunt cannot or will not write (a link or FIFO at its name, a full disk): one line naming it and
    what to do. An ``OSError`` too, so that a caller that goes on without the file (the Guard) catches it so."""


def _link_target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_target(path: str) -> bool:
    """Raise :class:`WriteError` unless ``path`` can be replaced by a new file: it is absent or a regular
    file (then True: it will be replaced). A symbolic link there is refused, not followed nor replaced:
    nanhunt did not make it, and whoever did either means to redirect the write (hostile) or expects the
    link to survive; either way the user decides. A FIFO, socket or device is refused alike."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise WriteError(f"cannot write {path!r}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(path, st.st_mode)
    return True


def _refusal(path: str, mode: int) -> WriteError:
    """Why nothing is written at ``path``, which is not a regular file (``mode``: what it is)."""
    if stat.S_ISLNK(mode):
        return WriteError(f"refusing to write {path!r}: it is a symbolic link (to {_link_target(path)!r}) and "
                          "nanhunt never writes through a link; remove it or give another path")
    if stat.S_ISDIR(mode):
        return WriteError(f"cannot write {path!r}: it is a directory; give a file name")
    return WriteError(f"refusing to write {path!r}: it is {_kind(mode)}, not a regular file, and nanhunt writes "
                      "only regular files; remove it or give another path")


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
            f, tmp = _create_beside(os.path.join(directory, "probe"))
        except OSError as e:
            raise InputError(f"cannot write into {label}: {e.strerror}; give another directory") from e
        f.close()
        os.unlink(tmp)
        return
    parent = os.path.dirname(os.path.abspath(directory))
    while not os.path.lexists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InputError(f"cannot create {label}: {parent!r} is a file, not a directory; give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot create {label}: the directory {parent!r} is not writable; give another path")


def _create_beside(path: str) -> tuple[BinaryIO, str]:
    """A new, empty file in the directory of ``path`` under a hidden random name: (the file, its name). Made and
    returned in one line: an interrupt lands before it exists or after the caller holds it."""
    directory, name = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.fdopen(os.open(tmp, _FLAGS, 0o666), "wb"), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path!r}")


@contextmanager
def new_files(*paths: str) -> Iterator[tuple[BinaryIO, ...]]:
    """Binary files to write the new content of ``paths`` into, which belong together (a capture's checkpoint
    and batch): once every one is written they replace their names, the first path last (its presence says the
    others are there); on any error or interrupt before then none does and every new file is removed, and one
    already renamed in is removed again, so no name is left with only part of the set. OSErrors become one-line
    :class:`WriteError`\\ s."""
    for path in paths:
        check_target(path)
    made: list[tuple[BinaryIO, str]] = []
    renaming = False
    try:
        for path in paths:
            made.append(_create_beside(path))
        yield tuple(f for f, _ in made)
        for f, _ in made:
            f.close()  # flushed here: a full disk raises now, before any name changes
        for path in paths:
            check_target(path)  # a link planted during the write: refuse; one planted after this is replaced
        renaming = True  # set first: an interrupt between two renames must take the first one away again
        for (_, tmp), path in reversed(list(zip(made, paths))):
            os.replace(tmp, path)
    except BaseException as e:
        _undo(made, paths, renaming)
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            # the file it names (by its temporary name), else the one being made when it failed
            name = next((p for (_, t), p in zip(made, paths) if e.filename in (t, p)),
                        paths[min(len(made), len(paths) - 1)])
            raise WriteError(f"cannot write {name!r}: {e.strerror or e}") from e
        raise


def _undo(made: list[tuple[BinaryIO, str]], paths: tuple[str, ...], renaming: bool) -> None:
    """:func:`new_files`' clean-up: every new file closed and removed, under its temporary name or, once it was
    renamed in (``renaming``, and its temporary name is gone), under its own."""
    for f, _ in made:
        with suppress(OSError):
            f.close()
    for (_, tmp), path in zip(made, paths):
        with suppress(OSError):
            os.unlink(path if renaming and not os.path.lexists(tmp) else tmp)


@contextmanager
def new_file(path: str) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; on success it replaces ``path``, on any error it is
    removed and ``path`` is left as it was (:func:`new_files` of one)."""
    with new_files(path) as (f,):
        yield f


def write_file(path: str, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a new file (:func:`new_file`)."""
    with new_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def append_file(path: str, data: bytes) -> None:
    """Append ``data`` to the log ``path`` (made if missing). Opened without following a link and without
    waiting on a FIFO, and written only once it is seen to be a regular file of one name: a hard link would
    append to the other file too. A log is appended to, not rewritten: its earlier lines stay as they are
    whatever happens to this write, and a long run's log is not copied at every line."""
    fd = -1
    try:
        fd = os.open(path, _APPEND, 0o666)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO someone reads (it opened at once): what it is, as opened
            raise _refusal(path, st.st_mode)
        if st.st_nlink != 1:
            raise WriteError(f"refusing to append to {path!r}: it is also another file's name ({st.st_nlink} "
                             "names), and nanhunt appends only to a file of its own; move it away")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if isinstance(e, WriteError):
            raise
        check_target(path)  # a link (ELOOP), a FIFO no one reads (ENXIO): said as what it is
        raise WriteError(f"cannot write {path!r}: {e.strerror or e}") from e
    finally:
        if fd >= 0:
            os.close(fd)


def read_own(path: str, what: str, fix: str) -> bytes | None:
    """The content of a file nanhunt keeps and appends to (``what``: how errors call it), None when there is none
    yet; opened as :func:`append_file` opens it. A link, a FIFO or any other file that is not regular is refused
    in one line ending with ``fix``: neither read (a FIFO would block) nor written through later."""
    def refused(reason: str) -> InputError:
        return InputError(f"cannot read {what} {path!r}: {reason}; {fix}")

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise refused(str(e.strerror)) from e
    if stat.S_ISLNK(st.st_mode):
        raise refused(f"it is a symbolic link (to {_link_target(path)!r}) and nanhunt never reads or writes "
                      "through a link")
    if not stat.S_ISREG(st.st_mode):
        raise refused(f"it is {_kind(st.st_mode)}, not a regular file, and nanhunt reads and writes only "
                      "regular files")
    try:
        fd = os.open(path, _READ)
    except OSError as e:  # replaced by a link since: ELOOP
        raise refused(str(e.strerror)) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused("it is not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise refused(str(e.strerror)) from e
    finally:
        os.close(fd)


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
