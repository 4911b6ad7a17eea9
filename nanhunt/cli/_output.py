"""What a replay shows: a status line while it bisects, then the report, whose places are checked before the
long part and written last: the console, ``--report PATH`` and ``--bundle DIR`` (written beside its directory
and swapped in at the end, removed on an error or interrupt)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._util._errors import InputError, visible
from ._common import EXIT_CLEAN, EXIT_NONFINITE, EXIT_NOT_REPRODUCIBLE, check_writable, print_rich, put

if TYPE_CHECKING:
    from ..records import Report


class ReplayOutput:
    """Where a replay's report goes: ``report`` and ``bundle`` as the flags give them; ``speaks``: this process
    shows and writes the report (under torchrun, rank 0 alone). Every check runs when it is made: a bad suffix or
    a path that cannot be written fails before the replay, not after it."""

    def __init__(self, report: str | None, bundle: str | None, *, speaks: bool) -> None:
        from .._util._bundle import Staging
        from ..report import renderer_for

        self.speaks = speaks
        self.report = report if speaks else None
        self.bundle = bundle
        if self.report:
            renderer_for(self.report)
            check_writable(self.report)
        if bundle and speaks:
            _check_bundle(bundle, report)
        self._staged = Staging(bundle) if bundle and speaks else None

    @property
    def bundle_dir(self) -> str | None:
        """Where the replay writes the bundle's repro: the new directory while staged (under torchrun the other
        ranks get the bundle as given: rank 0 alone writes it)."""
        return self._staged.path if self._staged is not None else self.bundle

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """The bundle's new directory, made first and removed unless :meth:`show` swapped it in."""
        try:
            if self._staged is not None:
                self._staged.create()
            yield
        finally:
            if self._staged is not None:
                self._staged.discard()

    def show(self, report: Report) -> int:
        """The report on the console, then written to ``--report`` and the bundle; the exit code of its status."""
        from ..records import Status
        from ..report import write, write_bundle
        from ..report.console import render

        staged = self._staged
        print_rich(render(report))
        if self.report:
            path = self.report
            put(path, lambda: write(report, path))
        if staged is not None and self.bundle:
            names = [os.path.basename(p) for p in write_bundle(report, staged.path)]
            rp = report.repro
            names += list(rp.files) if rp is not None else []
            put(self.bundle, staged.commit)
            state = "no op to reproduce" if rp is None else ("repro verified" if rp.verified else f"repro NOT verified: {rp.result}")
            print(visible(f"bundle: {', '.join(os.path.join(self.bundle, n) for n in names)} ({state})"),
                  file=sys.stderr)
            if staged.earlier or staged.kept:
                _replaced_line(self.bundle, staged.earlier, names, staged.kept)
        codes = {Status.CLEAN: EXIT_CLEAN, Status.NOT_REPRODUCIBLE: EXIT_NOT_REPRODUCIBLE}
        return codes.get(report.status, EXIT_NONFINITE)


class Progress:
    """A rich status line during bisection (stderr, so reports on stdout stay clean)."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True)
        self._status: Any = None

    def __enter__(self) -> Progress:
        return self

    def update(self, n: int, label: str) -> None:
        from rich.markup import escape

        text = f"bisecting: replay {n} ({escape(visible(label))})"
        if not self._console.is_terminal:
            return
        if self._status is None:
            self._status = self._console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _check_bundle(directory: str, report: str | None) -> None:
    """Fail before the replay on a bundle directory nanhunt cannot write, or one holding files it did not write
    (it is new, empty, or an earlier bundle), or ``--report`` inside it (the bundle replaces its directory)."""
    from .._util._bundle import earlier_bundle
    from .._util._files import check_directory

    if report is not None and os.path.realpath(os.path.dirname(os.path.abspath(report))) == os.path.realpath(directory):
        raise InputError(f"--report {report!r} is inside the bundle directory {directory!r}, which holds the reports "
                           "already; leave --report out or give it a path outside")
    if os.path.isdir(directory):  # before the write probe: a directory of the user's own files is left untouched
        earlier_bundle(directory)
    check_directory(directory, what="the bundle directory")


def _replaced_line(directory: str, earlier: list[str], now: list[str], kept: str) -> None:
    """One stderr line: the files of the earlier bundle replaced, and those removed as not part of this one
    (a repro.py left beside a report that has none would reproduce the old bug); where the earlier bundle was
    left when files nanhunt did not write appeared in it during the swap."""
    replaced = [n for n in earlier if n in now]
    removed = [n for n in earlier if n not in now]
    line = f"bundle: replaced an earlier bundle in {directory!r}: {', '.join(replaced) or 'no file'} rewritten"
    if removed:
        line += f"; {', '.join(removed)} removed (not part of this bundle)"
    if kept:
        line += f"; the earlier bundle got other files meanwhile: left, with them, in {kept!r}"
    print(visible(line), file=sys.stderr)
