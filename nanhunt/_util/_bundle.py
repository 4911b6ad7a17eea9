"""Private: a bundle directory holds nanhunt's files alone, and changes whole or not at all.

``--bundle DIR`` writes several files (the reports, the picture, the repro) into a directory a user may have
made or used before. nanhunt never deletes or replaces a file it did not write: DIR must be new, empty, or an
earlier bundle, told by the marker file every bundle holds (:data:`MARKER`, naming the format) and holding a
bundle's files alone. The command line writes the bundle into a new hidden directory beside DIR (the same
parent: the same file system, so a rename is atomic) and swaps it in at the end: the earlier bundle renamed
aside, the new one renamed in, the earlier one removed, with Ctrl-C and SIGTERM held meanwhile. An error or an
interrupt before the swap removes the new directory: DIR is as it was.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat

from ._errors import InputError
from ._files import check_target, write_file
from ._interrupt import atomic
from ._text import few

__all__ = ["MARKER", "claim", "earlier_bundle", "Staging"]

MARKER = ".nanhunt-bundle"
FORMAT = 1
_MARK = f"nanhunt bundle, format {FORMAT}\n"
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


# The files a bundle holds: the report's (written by nanhunt.report) and the repro's (nanhunt.hunt.repro). Named
# here, the bottom of both, so that this module imports neither.
BUNDLE_FILES = ("report.md", "report.json", "report.html", "report.png")
SCRIPT = "repro.py"
INPUTS = "repro_inputs.pt"


def _names() -> tuple[str, ...]:
    """Every file a bundle may hold, the marker aside."""
    return (*BUNDLE_FILES, SCRIPT, INPUTS)


def _marked(directory: str) -> bool:
    """``directory`` holds nanhunt's marker: a regular file (not a link) that says so."""
    try:
        fd = os.open(os.path.join(directory, MARKER), _FLAGS)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 64).startswith(b"nanhunt bundle")
    finally:
        os.close(fd)


def earlier_bundle(directory: str) -> list[str]:
    """The files of an earlier bundle in ``directory``: none when it is absent or empty. Raises a one-line
    :class:`InputError` when it holds anything nanhunt did not write: a file at a bundle's name that is not a
    regular one (a link is never written through nor removed), no marker, or a name no bundle has."""
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise InputError(f"cannot read the bundle directory {directory!r}: {e.strerror}; give another "
                           "directory") from e
    names = _names()
    for name in entries:
        if name in names:
            check_target(os.path.join(directory, name))
    if entries and not _marked(directory):
        raise InputError(f"refusing to write a bundle into {directory!r}: it holds files nanhunt did not write "
                           f"({few(entries)}), which the bundle would replace or delete; give a new or empty "
                           "directory, or remove them")
    foreign = [e for e in entries if e not in names and e != MARKER]
    if foreign:
        raise InputError(f"refusing to replace the bundle in {directory!r}: it also holds files nanhunt did not "
                           f"write ({few(foreign)}), which replacing it would delete; move them out, or give "
                           "another directory")
    return [n for n in names if n in entries]


def claim(directory: str) -> None:
    """Make ``directory`` (made if missing) a bundle that files may be written into, one by one: refused in one
    line when it holds files nanhunt did not write (:func:`earlier_bundle`); the marker written if missing."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create {directory!r}: {e.strerror}") from e
    earlier_bundle(directory)
    if not _marked(directory):
        write_file(os.path.join(directory, MARKER), _MARK)


class Staging:
    """The bundle for ``directory``, written into :attr:`path` (a new directory beside it, made by
    :meth:`create`) and swapped in whole by :meth:`commit`; :meth:`discard` (in a ``finally``) removes it when
    it was not. A link to a directory stays: the directory it names is swapped."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.target = os.path.realpath(directory)
        self.path = ""  # "" before create() and after commit()
        self.earlier: list[str] = []  # after commit(): the earlier bundle's files, now removed
        self.kept = ""  # after commit(): where the earlier bundle was left, when files appeared in it meanwhile

    @atomic  # an interrupt waits until the new directory has its name: discard() then finds it
    def create(self) -> None:
        """Make the new directory, or refuse in one line a ``directory`` that cannot be swapped: a mount point,
        one holding the current directory, or one in a directory nanhunt cannot write into."""
        if os.path.isdir(self.target):
            if os.path.ismount(self.target):
                raise InputError(f"cannot use {self.directory!r} as the bundle directory: it is a mount point, "
                                   "which nanhunt cannot swap for the new bundle; give a directory inside it")
            if os.path.commonpath([os.path.realpath(os.getcwd()), self.target]) == self.target:
                raise InputError(f"cannot use {self.directory!r} as the bundle directory: it holds the current "
                                   "directory, and nanhunt swaps the bundle directory whole; give another directory")
        home = os.path.dirname(self.target)
        while not os.path.isdir(home):  # the parents missing are made at the swap
            home = os.path.dirname(home)
        for _ in range(100):
            path = self._hidden(home, "new")
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            except OSError as e:
                raise InputError(f"cannot write the bundle beside {self.directory!r} (in {home!r}): {e.strerror}; "
                                   "give another directory") from e
            self.path = path
            write_file(os.path.join(path, MARKER), _MARK)  # a bundle from the start: every writer may add to it
            return
        raise InputError(f"no free name for the new bundle in {home!r}; give another directory")

    def _hidden(self, home: str, what: str) -> str:
        """A hidden name in ``home`` for the new or the earlier bundle, random: none other has it."""
        return os.path.join(home, f".{os.path.basename(self.target)}.nanhunt-{what}-{secrets.token_hex(8)}")

    @atomic  # no interrupt between the renames: DIR is the earlier bundle or the new one, never neither nor a mix
    def commit(self) -> None:
        """Swap the new bundle in, once more refusing a directory that meanwhile got files nanhunt did not
        write; the earlier bundle's files are removed, and any other file is left where it is."""
        earlier = earlier_bundle(self.directory)
        try:
            try:
                mode = stat.S_IMODE(os.stat(self.target).st_mode)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(self.target), exist_ok=True)
                os.rename(self.path, self.target)
                self.path = ""
                return
            os.chmod(self.path, mode)  # an existing directory keeps its permissions
            aside = self._hidden(os.path.dirname(self.target), "old")
            os.rename(self.target, aside)
            try:
                os.rename(self.path, self.target)
            except BaseException:
                os.rename(aside, self.target)
                raise
        except OSError as e:
            raise InputError(f"cannot put the bundle in place at {self.directory!r}: {e.strerror}; give "
                               "another directory") from e
        self.path, self.earlier = "", earlier
        for name in (*earlier, MARKER):
            try:
                os.unlink(os.path.join(aside, name))
            except OSError:
                continue
        try:
            os.rmdir(aside)
        except OSError:
            self.kept = aside

    @atomic
    def discard(self) -> None:
        """Remove the new directory unless it was swapped in (after an error or an interrupt)."""
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = ""
