"""``nanhunt replay``: one step replayed from a checkpoint and a batch, or from a capture directory (in one
process, or every rank under torchrun); the report shown, and written where asked."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from .._util._errors import NanhuntError, visible
from ._common import command_line, name_options, step_failed, warn_trust_pickle
from ._output import Progress, ReplayOutput

if TYPE_CHECKING:
    from ..capture.capture import Loaded
    from ..hunt._options import ReplayOptions
    from ..records import Report


class ReplayCommand:
    name = "replay"
    help = "replay one step from a checkpoint and a batch (or a capture directory); name the op where NaN/Inf was born"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or "
                       "Lightning's, or a .safetensors file; a Trainer's checkpoint-N/ directory (with its batch); "
                       "or a capture directory the Guard wrote under FSDP2 (DIR, alone)")
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
        p.add_argument("--compile", metavar="BACKEND",
                       help="when the eager replay is finite, replay the step compiled too: aot_eager, then BACKEND "
                       "(inductor, aot_eager, eager, or package.module:function; default: the backend the capture "
                       "recorded), each --repeat times; a BACKEND you name runs with torch's default settings")
        p.add_argument("--trust-compile-options", action="store_true", help="use the compile options and mode the "
                       "capture recorded, all of them (inductor's can name the C++ compiler and its flags: they run); "
                       "default: only those that change nothing but the numbers")

    def run(self, args: argparse.Namespace) -> int:
        from ..capture._options import LoadOptions
        from ..hunt._dist_replay import under_torchrun
        from ..hunt._options import ReplayOptions

        torchrun = under_torchrun()  # every rank replays its own batch (_dist_replay); rank 0 alone shows it
        output = ReplayOutput(args.report, args.bundle, speaks=not torchrun or os.environ.get("RANK", "0") == "0")
        if args.trust_pickle and output.speaks:
            warn_trust_pickle()
        load = LoadOptions(model_factory=args.model, loss=args.loss, optimizer=args.optimizer,
                           trust_names=tuple(args.trust_names), device=args.device, dtype=args.dtype,
                           no_scaler=args.no_scaler, train=args.train, trust_pickle=args.trust_pickle,
                           snapshot=None if args.snapshot == "auto" else args.snapshot, compile=args.compile,
                           trust_compile_options=args.trust_compile_options)
        options = ReplayOptions(load, level=args.level, allow=tuple(args.allow), prove=not args.no_bisect,
                                repeat=args.repeat)
        with output.staging():
            return self._replay(args, options, torchrun=torchrun, output=output)

    def _replay(self, args: argparse.Namespace, options: ReplayOptions, *, torchrun: bool,
                output: ReplayOutput) -> int:
        from ..capture.capture import load_replay
        from ..hunt._dist_replay import replay_ranks
        from ..hunt._ranks import other_ranks, received_note
        from ..hunt.pipeline import hunt
        from ..records import Status

        def show_ranks(report: Report) -> int:
            for n in report.notes[:2]:  # how it was replayed, and which rank went first
                print(visible(n), file=sys.stderr)
            return output.show(report)

        if torchrun:
            try:
                with Progress() as progress:
                    return replay_ranks(args.checkpoint, batch=args.batch, rank=args.rank, options=options,
                                        progress=progress.update, command=command_line(_dist_launcher()),
                                        show=show_ranks, bundle=output.bundle_dir)
            except NanhuntError:
                raise
            except Exception as e:  # the user's model failed on this batch: an input problem, not ours
                raise step_failed("replaying the step", e) from e
        directory = args.batch is None  # a capture directory; its first note says which rank's batch is replayed
        loaded = load_replay(args.checkpoint, args.batch, options.load, rank=args.rank)
        for i, n in enumerate(loaded.step.notes):
            print(visible(n if directory and i == 0 else f"warning: {n}"), file=sys.stderr)

        def hunted(loaded: Loaded) -> Report:
            try:
                with Progress() as progress:
                    return hunt(loaded.step, level=options.level, allow=options.allow, prove=options.prove,
                                progress=progress.update, bundle=output.bundle_dir, command=command_line(),
                                repeat=options.repeat, event=loaded.event)
            except NanhuntError:
                raise
            except Exception as e:  # the user's model failed on this batch: an input problem, not ours
                raise step_failed("replaying the step", e) from e

        report = hunted(loaded)
        if directory and args.rank is None and report.status == Status.CLEAN:
            del loaded  # one model in memory at a time
            report = other_ranks(args.checkpoint, report, hunted, options.load, _say)
        elif report.status == Status.CLEAN:
            report = received_note(report, _say)
        return output.show(report)


def _say(line: str) -> None:
    print(visible(line), file=sys.stderr)


def _dist_launcher() -> str:
    """How the replay under torchrun is started again: every rank replays its own batch."""
    return f"torchrun --nproc-per-node {os.environ.get('WORLD_SIZE', '1')} -m"
