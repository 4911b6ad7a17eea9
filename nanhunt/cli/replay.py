"""``nanhunt replay``: one step replayed from a checkpoint and a batch, or from a capture directory (in one
process, or every rank under torchrun); the report shown, and written where asked."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._util._errors import CommandError, NanhuntError, visible
from ._common import (EXIT_CLEAN, EXIT_NONFINITE, EXIT_NOT_REPRODUCIBLE, check_writable, command_line, name_options,
                      print_rich, put, step_failed, warn_trust_pickle)

if TYPE_CHECKING:
    from .._util._bundle import Staging


class ReplayCommand:
    name = "replay"
    help = "replay one step from a checkpoint and a batch (or a capture directory); name the op where NaN/Inf was born"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or "
                       "Lightning's; or a capture directory the Guard wrote under FSDP2 (DIR, alone)")
        p.add_argument("batch", nargs="?", help="batch.pt: a nanhunt capture, a tensor, (inputs, targets) or a dict")
        p.add_argument("--rank", type=int, metavar="R", help="with a capture directory: replay rank R's batch "
                       "(default: the first rank that saw the failure)")
        p.add_argument("--model", metavar="PKG.MOD:FACTORY", help="how to build the model (required for plain state_dicts)")
        p.add_argument("--loss", metavar="PKG.MOD:FN", help="loss function called as fn(output, targets)")
        name_options(p)
        p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="autocast dtype (default: the capture's, else float16)")
        p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default cpu)")
        p.add_argument("--level", choices=("op", "module"), default="op",
                       help="op (default): name the aten op and its source line; module: only the module, cheaper")
        p.add_argument("--no-scaler", action="store_true", help="ignore the GradScaler state: unscaled backward")
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--train", dest="train", action="store_const", const=True, help="replay in train mode")
        mode.add_argument("--eval", dest="train", action="store_const", const=False, help="replay in eval mode")
        p.add_argument("--allow", action="append", default=[], metavar="NAME", help="module or op whose NaN/Inf is intentional")
        p.add_argument("--no-bisect", action="store_true", help="don't confirm the culprit by local float32 replays")
        p.add_argument("--report", metavar="PATH", help="also write the report (.json, .md, .html + .png beside, .txt)")
        p.add_argument("--bundle", metavar="DIR", help="write report.md/.json/.html/.png and a verified repro of the "
                       "origin op (repro.py, repro_inputs.pt) into DIR")
        p.add_argument("--trust-pickle", action="store_true", help="allow weights_only=False loads (runs code from the files!)")
        p.add_argument("--snapshot", choices=("auto", "memory", "disk"), default="auto",
                       help="where the copy of the weights and optimizer state restored between runs lives: memory, "
                       "or disk (a temporary file in TMPDIR, mapped: a model that fills the RAM replays); auto "
                       "(default): disk for a CPU model whose copy would take over half the free memory")
        p.add_argument("--repeat", type=int, default=1, metavar="N",
                       help="replay up to N times while the step stays finite (default 1): a failure that comes "
                       "only now and then (non-deterministic kernels, state outside the capture) shows in one of them")

    def run(self, args: argparse.Namespace) -> int:
        from .._util._bundle import Staging
        from ..hunt._dist_replay import under_torchrun
        from ..report import renderer_for

        torchrun = under_torchrun()  # every rank replays its own batch (_dist_replay); rank 0 alone shows it
        speaks = not torchrun or os.environ.get("RANK", "0") == "0"
        render_file = renderer_for(args.report) if args.report and speaks else None  # fail before the long part
        if args.report and speaks:
            check_writable(args.report)
        if args.bundle and speaks:
            _check_bundle(args.bundle, args.report)
        if args.trust_pickle and speaks:
            warn_trust_pickle("the files")
        options = dict(model_factory=args.model, loss=args.loss, optimizer=args.optimizer,
                       trust_names=tuple(args.trust_names), device=args.device, dtype=args.dtype,
                       no_scaler=args.no_scaler, train=args.train, trust_pickle=args.trust_pickle)
        # The bundle is written beside its directory and swapped in at the end; removed on an error or interrupt
        staged = Staging(args.bundle) if args.bundle and speaks else None
        try:
            if staged is not None:
                staged.create()
            return self._replay(args, options, torchrun=torchrun, render_file=render_file, staged=staged)
        finally:
            if staged is not None:
                staged.discard()

    def _replay(self, args: argparse.Namespace, options: dict[str, Any], *, torchrun: bool,
                render_file: Callable[[Any], str] | None, staged: Staging | None) -> int:
        from ..hunt._dist_replay import replay_ranks
        from ..hunt._ranks import other_ranks, received_note
        from ..capture.capture import load_capture_dir, load_step
        from ..hunt.pipeline import hunt
        from ..report import write, write_bundle
        from ..report.console import render

        bundle = staged.path if staged is not None else args.bundle  # under torchrun, rank 0 alone writes it

        def show(report: Any) -> int:
            print_rich(render(report))
            if args.report and render_file is not None:
                put(args.report, lambda: write(report, args.report))
            if staged is not None:
                names = [os.path.basename(p) for p in write_bundle(report, staged.path)]
                rp = report.repro
                names += list(rp.files) if rp is not None else []
                put(args.bundle, staged.commit)
                state = "no op to reproduce" if rp is None else ("repro verified" if rp.verified else f"repro NOT verified: {rp.result}")
                print(visible(f"bundle: {', '.join(os.path.join(args.bundle, n) for n in names)} ({state})"),
                      file=sys.stderr)
                if staged.earlier or staged.kept:
                    _replaced_line(args.bundle, staged.earlier, names, staged.kept)
            return {"clean": EXIT_CLEAN, "not-reproducible": EXIT_NOT_REPRODUCIBLE}.get(report.status, EXIT_NONFINITE)

        def show_ranks(report: Any) -> int:
            for n in report.notes[:2]:  # how it was replayed, and which rank went first
                print(visible(n), file=sys.stderr)
            return show(report)

        directory = args.batch is None
        if torchrun and args.snapshot != "auto":
            raise CommandError("--snapshot applies to a replay in one process; under torchrun leave it out")
        if args.repeat < 1:
            raise CommandError(f"--repeat {args.repeat}: replay at least once (--repeat 1, the default)")
        if torchrun and args.repeat != 1:
            raise CommandError("--repeat applies to a replay in one process; under torchrun leave it out")
        if torchrun:
            try:
                with _Progress() as progress:
                    return replay_ranks(args.checkpoint, batch=args.batch, rank=args.rank, level=args.level,
                                        allow=args.allow, prove=not args.no_bisect, progress=progress.update,
                                        command=command_line(_dist_launcher()), show=show_ranks,
                                        bundle=bundle, **options)
            except NanhuntError:
                raise
            except Exception as e:  # the user's model failed on this batch: an input problem, not ours
                raise step_failed("replaying the step", e) from e
        if directory:  # a capture directory; its first note says which rank's batch is replayed
            step = load_capture_dir(args.checkpoint, rank=args.rank, **options)
        elif args.rank is not None:
            raise CommandError("--rank picks a batch of a capture directory; with a checkpoint and a batch file, "
                               "leave it out")
        else:
            step = load_step(args.checkpoint, args.batch, **options)
        for i, n in enumerate(step.notes):
            print(visible(n if directory and i == 0 else f"warning: {n}"), file=sys.stderr)

        def hunted(step: Any) -> Any:
            step.snapshot = "disk" if args.snapshot == "disk" else "memory" if args.snapshot == "memory" else None
            try:
                with _Progress() as progress:
                    return hunt(step, level=args.level, allow=args.allow, prove=not args.no_bisect,
                                progress=progress.update, bundle=bundle, command=command_line(), repeat=args.repeat)
            except NanhuntError:
                raise
            except Exception as e:  # the user's model failed on this batch: an input problem, not ours
                raise step_failed("replaying the step", e) from e

        report = hunted(step)
        if directory and args.rank is None and report.status == "clean":
            del step  # one model in memory at a time
            report = other_ranks(args.checkpoint, report, hunted, options, _say)
        elif report.status == "clean":
            report = received_note(report, _say)
        return show(report)


def _say(line: str) -> None:
    print(visible(line), file=sys.stderr)


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


def _dist_launcher() -> str:
    """How the replay under torchrun is started again: every rank replays its own batch."""
    return f"torchrun --nproc-per-node {os.environ.get('WORLD_SIZE', '1')} -m"


def _check_bundle(directory: str, report: str | None) -> None:
    """Fail before the replay on a bundle directory nanhunt cannot write, or one holding files it did not write
    (it is new, empty, or an earlier bundle), or ``--report`` inside it (the bundle replaces its directory)."""
    from .._util._bundle import earlier_bundle
    from .._util._files import check_directory

    if report is not None and os.path.realpath(os.path.dirname(os.path.abspath(report))) == os.path.realpath(directory):
        raise CommandError(f"--report {report!r} is inside the bundle directory {directory!r}, which holds the reports "
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
