"""Command line: parses, calls the library, renders. No logic of its own.

Exit codes: 0 the step is finite, 1 a non-finite value was found, 2 usage or
input error, 3 not reproducible.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

from ._errors import CommandError, NanhuntError

__all__ = ["main"]

EXIT_CLEAN, EXIT_NONFINITE, EXIT_INPUT, EXIT_NOT_REPRODUCIBLE = 0, 1, 2, 3


class Command(Protocol):
    name: str
    help: str

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _print(renderable: Any) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=120)  # pipes and logs: don't wrap tables at 80
    console.print(renderable)


class ReplayCommand:
    name = "replay"
    help = "replay one step from a checkpoint and a batch; name the op where NaN/Inf was born"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or Lightning's")
        p.add_argument("batch", help="batch.pt: a nanhunt capture, a tensor, (inputs, targets) or a dict")
        p.add_argument("--model", metavar="PKG.MOD:FACTORY", help="how to build the model (required for plain state_dicts)")
        p.add_argument("--loss", metavar="PKG.MOD:FN", help="loss function called as fn(output, targets)")
        p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="autocast dtype (default: the capture's, else float16)")
        p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default cpu)")
        p.add_argument("--level", choices=("op", "module"), default="op")
        p.add_argument("--no-scaler", action="store_true", help="ignore the GradScaler state: unscaled backward")
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--train", dest="train", action="store_const", const=True, help="replay in train mode")
        mode.add_argument("--eval", dest="train", action="store_const", const=False, help="replay in eval mode")
        p.add_argument("--allow", action="append", default=[], metavar="NAME", help="module or op whose NaN/Inf is intentional")
        p.add_argument("--no-bisect", action="store_true", help="don't confirm the culprit by local float32 replays")
        p.add_argument("--report", metavar="PATH", help="also write the report (.json)")
        p.add_argument("--trust-pickle", action="store_true", help="allow weights_only=False loads (runs code from the files!)")

    def run(self, args: argparse.Namespace) -> int:
        from .capture import load_step
        from .replay import replay
        from .report import renderer_for
        from .report.console import render

        render_file = renderer_for(args.report) if args.report else None  # fail before the long part
        if args.trust_pickle:
            print("warning: --trust-pickle loads the files with weights_only=False, which runs any code they contain",
                  file=sys.stderr)
        step = load_step(
            args.checkpoint, args.batch, model_factory=args.model, loss=args.loss, device=args.device,
            dtype=args.dtype, no_scaler=args.no_scaler, train=args.train, trust_pickle=args.trust_pickle,
        )
        for n in step.notes:
            print(f"warning: {n}", file=sys.stderr)
        try:
            with _Progress() as progress:
                report = replay(
                    step.model, (step.inputs, step.targets), loss_fn=step.loss_fn, dtype=step.dtype,
                    device_type=step.device_type, scaler=step.scaler, optimizer=step.optimizer, level=args.level,
                    rng=step.rng, allow=args.allow, command=_command_line(), notes=step.notes,
                    bisect=not args.no_bisect, progress=progress.update,
                )
        except NanhuntError:
            raise
        except Exception as e:  # the user's model failed on this batch: an input problem, not ours
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CommandError(f"replaying the step raised {type(e).__name__}: {msg} — does the batch fit the model?") from e
        _print(render(report))
        if args.report and render_file is not None:
            _write(args.report, render_file(report))
        return {"clean": EXIT_CLEAN, "not-reproducible": EXIT_NOT_REPRODUCIBLE}.get(report.status, EXIT_NONFINITE)


class _Progress:
    """A rich status line during bisection (stderr, so reports on stdout stay clean)."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True)
        self._status: Any = None

    def __enter__(self) -> _Progress:
        return self

    def update(self, n: int, label: str) -> None:
        from rich.markup import escape

        text = f"bisecting: replay {n} ({escape(label)})"
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


class InspectCommand:
    name = "inspect"
    help = "non-finite and near-overflow parameters, optimizer moments and GradScaler state of a checkpoint"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint")
        p.add_argument("--trust-pickle", action="store_true", help="allow weights_only=False loads (runs code from the file!)")

    def run(self, args: argparse.Namespace) -> int:
        from .inspect_ckpt import inspect_checkpoint
        from .report.console import render_inspection

        found = inspect_checkpoint(args.checkpoint, trust_pickle=args.trust_pickle)
        _print(render_inspection(found))
        return EXIT_NONFINITE if found.nonfinite else EXIT_CLEAN


COMMANDS: tuple[Command, ...] = (ReplayCommand(), InspectCommand())


def _command_line() -> str:
    return "nanhunt " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CommandError(f"cannot write {path!r}: {e.strerror}") from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanhunt", description="Find where a NaN or Inf is born in a PyTorch step.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        cmd.prepare_parser(p)
        p.set_defaults(_cmd=cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    debug = bool(getattr(args, "debug", False))
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.simplefilter("ignore", UserWarning)
            return int(args._cmd.run(args))
    except CommandError as e:
        if debug:
            raise
        print(f"nanhunt: error: {e}", file=sys.stderr)
        return e.exit_code
    except NanhuntError as e:
        if debug:
            raise
        print(f"nanhunt: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("nanhunt: interrupted; the model and files were left as they were", file=sys.stderr)
        return 130


