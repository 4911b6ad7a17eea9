"""What several commands share: the exit codes, the Command protocol, printing, the checks made before the long
part, the files written (for the line after an interrupt), the command line recorded, and the step's own
failures told from nanhunt's."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any, Protocol

from .._util._errors import InputError, first_line, visible
from .._util._interrupt import atomic

EXIT_CLEAN, EXIT_NONFINITE, EXIT_INPUT, EXIT_NOT_REPRODUCIBLE = 0, 1, 2, 3


class Command(Protocol):
    name: str
    help: str

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def print_rich(renderable: Any) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=120)  # pipes and logs: don't wrap tables at 80
    console.print(renderable)


def warn_trust_pickle(*, one_file: bool = False) -> None:
    """The warning ``--trust-pickle`` prints, for the files a command loads (``one_file``: ``inspect``'s)."""
    what = "the file" if one_file else "the files"
    they = "it contains" if one_file else "they contain"
    print(f"warning: --trust-pickle loads {what} with weights_only=False, which runs any code {they}",
          file=sys.stderr)


def name_options(p: argparse.ArgumentParser) -> None:
    """The flags that confirm names a capture suggests, beside --model and --loss."""
    p.add_argument("--optimizer", metavar="PKG.MOD:CLASS", help="optimizer class, built on the model's parameters "
                   "with the file's groups and state (confirms one the file names)")
    p.add_argument("--trust-names", action="append", default=[], metavar="PKG",
                   help="use the model, loss and optimizer names the file gives inside package PKG (and its "
                        "submodules) without --model/--loss/--optimizer; repeatable; also NANHUNT_TRUST_NAMES=a,b")


def check_writable(path: str, fmt: str | None = None) -> None:
    """Fail on a report path that cannot be written before the long replay, not after it: its directory (made
    when the report is written, as a bundle's is, when missing), and every file the report writes there (an HTML
    page's picture too) is absent or a regular file."""
    from .._util._files import check_directory, check_target
    from ..report import targets

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InputError(f"cannot write {path!r}: it is a directory; give a file name")
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise InputError(f"cannot write {path!r}: {parent!r} is not a directory; give a path in a directory")
    if not os.path.isdir(parent):
        check_directory(parent, what="the report's directory")  # can be made: nothing is in it to check
        return
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {path!r}: the directory {parent!r} is not writable; give another path")
    for p in targets(path, fmt):
        check_target(p)


WRITTEN: list[str] = []  # what this command put in the user's place (a report, a bundle): the interrupt line


@atomic  # Ctrl-C and SIGTERM wait until the files are in place and noted: the line after an interrupt is true
def put(what: str, write: Callable[[], object]) -> None:
    """Run ``write``, which puts ``what`` in the user's place, and note it."""
    write()
    WRITTEN.append(what)


def interrupted(what: str) -> str:
    """The line after Ctrl-C (``what``: interrupted) or SIGTERM: what this command had written, if anything."""
    if not WRITTEN:
        return f"nanhunt: {what}; the model and files were left as they were"
    return visible(f"nanhunt: {what} after writing {', '.join(map(repr, WRITTEN))}; the model and other files were "
                   "left as they were")


ARGV: list[str] = []  # the arguments main() was given (not sys.argv: main(["replay", ...]) from Python)


def command_line(launcher: str = "") -> str:
    """The command as given (after ``launcher``: ``torchrun --nproc-per-node N -m``); when it names files by
    relative paths, run from the directory it ran in (``cd DIR && nanhunt ...``): a report or bundle is read
    elsewhere."""
    command = (f"{launcher} " if launcher else "") + "nanhunt " + " ".join(shlex.quote(a) for a in ARGV)
    relative = any(a and not a.startswith("-") and not os.path.isabs(a) and os.path.exists(a) for a in ARGV)
    return f"cd {shlex.quote(os.getcwd())} && {command}" if relative else command


def step_failed(what: str, e: Exception) -> InputError:
    """The step raised: the user's code (model, loss) on this batch, or nanhunt's own, told by the last
    frame of the traceback outside torch and the standard library."""
    if _raised_by_nanhunt(e):
        return InputError(f"{what} failed inside nanhunt ({first_line(e)}): a nanhunt bug, not your model; "
                            "rerun with --debug and report the traceback")
    return InputError(f"{what} raised {first_line(e)} — does the batch fit the model?")


# nanhunt's modules that run the user's step on its behalf (the model's ops under the tracer, the model, the
# loss, backward and the update, a float32 region): an error whose last frame is in one of them is the step's own
CALL_THROUGH = frozenset({"nanhunt.tracing._ops", "nanhunt._util._dispatch", "nanhunt.step._run",
                          "nanhunt.step.precision"})


def _raised_by_nanhunt(e: BaseException) -> bool:
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nanhunt/, above cli/
    skipped = [os.path.dirname(os.path.abspath(os.__file__))]  # the standard library
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and torch_mod.__file__:
        skipped.append(os.path.dirname(os.path.abspath(torch_mod.__file__)))
    last = None
    tb = e.__traceback__
    while tb is not None:
        f = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if f.startswith(ours + os.sep) or not any(f.startswith(d + os.sep) for d in skipped):
            last = (f, tb.tb_frame.f_globals.get("__name__"))
        tb = tb.tb_next
    return last is not None and last[0].startswith(ours + os.sep) and last[1] not in CALL_THROUGH
