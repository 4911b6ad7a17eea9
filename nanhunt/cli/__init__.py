"""Command line: parses, calls the library, renders. No logic of its own: one module per command
(:mod:`.replay`, :mod:`.inspect`, :mod:`.report`, :mod:`.compare`, :mod:`.run`, :mod:`.mcp`), what a replay shows
and writes in :mod:`._output`, what they share in :mod:`._common`.

Exit codes: 0 the step is finite, 1 a non-finite value was found, 2 usage or
input error, 3 not reproducible (two replays disagree, or a Guard's capture of a failed step replays finite);
130 interrupted (Ctrl-C), 143 terminated (SIGTERM), having put everything back.
``compare``: 0 the acceptance rule held, 1 it was violated, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .._util._errors import InputError, NanhuntError, visible
from .._util._interrupt import Terminated, terminate_raises
from ._common import ARGV, EXIT_INPUT, WRITTEN, Command, interrupted
from .compare import CompareCommand
from .inspect import InspectCommand
from .mcp import McpCommand
from .replay import ReplayCommand
from .report import ReportCommand
from .run import RunCommand

__all__ = ["main", "build_parser", "COMMANDS", "ReplayCommand", "InspectCommand", "ReportCommand", "CompareCommand"]

COMMANDS: tuple[Command, ...] = (ReplayCommand(), InspectCommand(), ReportCommand(), CompareCommand(), RunCommand(),
                                 McpCommand())


def _error(e: BaseException) -> None:
    # The one place errors are printed: a message may quote a file's content (a key, a module name), whose
    # control characters would otherwise end the line, forge another or recolour the terminal.
    print("nanhunt: error: " + visible(str(e)), file=sys.stderr)


def _version() -> str:
    """nanhunt's, torch's and CUDA's versions (this imports torch: only --version pays for it)."""
    from .._util._version import __version__

    try:
        import torch

        cuda = torch.version.cuda or "none"
        torch_v = str(torch.__version__)
    except ImportError:
        torch_v, cuda = "not installed", "none"
    return f"nanhunt {__version__} (torch {torch_v}, CUDA {cuda}, Python {sys.version.split()[0]})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print nanhunt's, torch's and CUDA's versions")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanhunt", description="Find where a NaN or Inf is born in a PyTorch step.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        cmd.prepare_parser(p)
        p.set_defaults(_cmd=cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ARGV[:] = list(sys.argv[1:] if argv is None else argv)
    WRITTEN.clear()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    debug = bool(getattr(args, "debug", False))
    try:
        with warnings.catch_warnings(), terminate_raises():  # SIGTERM: `finally` blocks put everything back
            if not debug and not getattr(args._cmd, "runs_user_code", False):  # a script's warnings stay its own
                warnings.simplefilter("ignore", UserWarning)
            return int(args._cmd.run(args))
    except InputError as e:
        if debug:
            raise
        _error(e)
        return e.exit_code
    except NanhuntError as e:
        if debug:
            raise
        _error(e)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(interrupted("interrupted"), file=sys.stderr)
        return 130
    except Terminated:
        print(interrupted("terminated (SIGTERM)"), file=sys.stderr)
        return 143


