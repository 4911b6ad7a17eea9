"""Private: a file of a directory someone else wrote (a Trainer checkpoint), read only when the directory holds it.

A checkpoint directory is an input like a file: a ``model.safetensors`` inside it that is a symbolic link to
``/etc/shadow`` or ``~/.ssh/id_rsa`` would have nanhunt read that file and show what it could not parse of it, and
a link to a FIFO or a device would have it wait forever. A file of the directory is its own regular file, looked at
without following a link (``lstat``), or refused in one line; a link is never followed, wherever it points, as in a
capture directory (``distributed._dcp_metadata.not_linked``).
"""

from __future__ import annotations

import os
import stat

from ._errors import InputError

__all__ = ["own_file"]


def own_file(directory: str, name: str, what: str, *, holder: str = "a checkpoint directory") -> str | None:
    """The path of ``name`` in ``directory`` when the directory holds it as a regular file; None when there is
    nothing at that name. ``what``: how an error names the file; ``holder``: what the directory is."""
    path = os.path.join(directory, name)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"{what} cannot be read ({e.strerror}); check its permissions") from e
    if stat.S_ISLNK(mode):
        raise InputError(f"{what} is a symbolic link; nanhunt reads only the files {holder} holds, never one a "
                         "link points to: copy the real files into it")
    if not stat.S_ISREG(mode):
        raise InputError(f"{what} is not a regular file; copy the checkpoint's real files")
    return path
