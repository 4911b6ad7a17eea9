"""Command line: parses, calls the library, renders. No logic of its own.

Exit codes: 0 the step is finite, 1 a non-finite value was found, 2 usage or
input error, 3 not reproducible (two replays disagree, or a Guard's capture of a failed step replays finite);
130 interrupted (Ctrl-C), 143 terminated (SIGTERM), having put everything back.
``compare``: 0 the acceptance rule held, 1 it was violated, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._util._errors import CommandError, NanhuntError, visible, first_line as _first_line
from .._util._interrupt import Terminated, atomic, terminate_raises

if TYPE_CHECKING:
    from .._util._bundle import Staging

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
    help = "replay one step from a checkpoint and a batch (or a capture directory); name the op where NaN/Inf was born"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or "
                       "Lightning's; or a capture directory the Guard wrote under FSDP2 (DIR, alone)")
        p.add_argument("batch", nargs="?", help="batch.pt: a nanhunt capture, a tensor, (inputs, targets) or a dict")
        p.add_argument("--rank", type=int, metavar="R", help="with a capture directory: replay rank R's batch "
                       "(default: the first rank that saw the failure)")
        p.add_argument("--model", metavar="PKG.MOD:FACTORY", help="how to build the model (required for plain state_dicts)")
        p.add_argument("--loss", metavar="PKG.MOD:FN", help="loss function called as fn(output, targets)")
        _name_options(p)
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
            _check_writable(args.report)
        if args.bundle and speaks:
            _check_bundle(args.bundle, args.report)
        if args.trust_pickle and speaks:
            print("warning: --trust-pickle loads the files with weights_only=False, which runs any code they contain",
                  file=sys.stderr)
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
        from ..capture.capture import load_capture_dir, load_step
        from ..hunt.pipeline import hunt
        from ..report import write, write_bundle
        from ..report.console import render

        bundle = staged.path if staged is not None else args.bundle  # under torchrun, rank 0 alone writes it

        def show(report: Any) -> int:
            _print(render(report))
            if args.report and render_file is not None:
                _put(args.report, lambda: write(report, args.report))
            if staged is not None:
                names = [os.path.basename(p) for p in write_bundle(report, staged.path)]
                rp = report.repro
                names += list(rp.files) if rp is not None else []
                _put(args.bundle, staged.commit)
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
                                        command=_command_line(_dist_launcher()), show=show_ranks,
                                        bundle=bundle, **options)
            except NanhuntError:
                raise
            except Exception as e:  # the user's model failed on this batch: an input problem, not ours
                raise _step_failed("replaying the step", e) from e
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
                                progress=progress.update, bundle=bundle, command=_command_line(), repeat=args.repeat)
            except NanhuntError:
                raise
            except Exception as e:  # the user's model failed on this batch: an input problem, not ours
                raise _step_failed("replaying the step", e) from e

        report = hunted(step)
        if directory and args.rank is None and report.status == "clean":
            del step  # one model in memory at a time
            report = _other_ranks(args.checkpoint, report, hunted, options)
        elif report.status == "clean":
            report = _received_note(report)
        return show(report)


MAX_OTHER_RANKS = 8  # replayed in turn when the first rank that saw a failure replays finite


def _other_ranks(path: str, report: Any, hunted: Callable[[Any], Any], options: dict[str, Any]) -> Any:
    """A capture directory whose first rank that saw the failure replays finite: under DDP / FSDP every rank's
    gradients go non-finite through the collective when one rank's backward overflows, so every rank saw it. The
    other ranks' batches are replayed in turn (those that saw it first), up to :data:`MAX_OTHER_RANKS`; the first
    that is not clean is reported, with a first note saying which replayed finite. None: the first report, noted."""
    from ..distributed import _dcp
    from ..capture.capture import load_capture_dir

    man = _dcp.read_manifest(path)
    first = _dcp.pick_rank(man, None, path)
    seen = sorted(set(man["ranks_seen"]) - {first})
    order = seen + [r for r in range(man["world_size"]) if r != first and r not in seen]
    finite = [first]
    head = f"capture of {man['world_size']} ranks ({man['wrapper']})"
    for r in order[:MAX_OTHER_RANKS]:
        done = f"rank {finite[0]}'s batch replays" if len(finite) == 1 else f"ranks {_few_ranks(finite)} replay"
        print(visible(f"{done} finite; replaying rank {r}'s"), file=sys.stderr)
        step = load_capture_dir(path, rank=r, **options)
        got = hunted(step)
        del step
        if got.status != "clean":
            who = (f"rank {finite[0]}'s replays finite: the failure it saw" if len(finite) == 1 else
                   f"ranks {_few_ranks(finite)} replay finite: the failure they saw")
            note = f"{head}: rank {r}'s batch replayed ({who} came from another rank)"
            print(visible(note), file=sys.stderr)
            return dataclasses.replace(got, notes=(note, *got.notes[1:]))
        finite.append(r)
    left = order[MAX_OTHER_RANKS:]
    note = (f"every rank's batch replays finite ({_few_ranks(finite)})" if not left else
            f"rank(s) {_few_ranks(finite)} replay finite; {len(left)} more not replayed: pass --rank R, or replay "
            f"under torchrun")
    print(visible(note), file=sys.stderr)
    return dataclasses.replace(report, notes=(*report.notes, note))


def _received_note(report: Any) -> Any:
    """A rank's capture files (DDP given unwrapped, FSDP1) that replay finite although the Guard saw the failure on
    that rank and others: its non-finite values came through a collective; say whose capture to replay."""
    ev = report.guard_event
    others = [] if ev is None or ev.rank is None else [r for r in ev.ranks if r != ev.rank]
    if not others:
        return report
    note = (f"the Guard saw the failure at step {ev.step} on rank(s) {_few_ranks(list(ev.ranks))}; this capture's "
            f"batch (rank {ev.rank}'s) replays finite: what it saw arrived from another rank through a collective; "
            f"replay the capture of rank {_few_ranks(others)}")
    print(visible(note), file=sys.stderr)
    return dataclasses.replace(report, notes=(*report.notes, note))


def _few_ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


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


class InspectCommand:
    name = "inspect"
    help = "non-finite and near-overflow parameters, optimizer moments and GradScaler state of a checkpoint"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or Lightning's")
        p.add_argument("--trust-pickle", action="store_true", help="allow weights_only=False loads (runs code from the file!)")

    def run(self, args: argparse.Namespace) -> int:
        from ..capture.inspect_ckpt import inspect_checkpoint
        from ..report.console import render_inspection

        if args.trust_pickle:
            print("warning: --trust-pickle loads the file with weights_only=False, which runs any code it contains",
                  file=sys.stderr)
        found = inspect_checkpoint(args.checkpoint, trust_pickle=args.trust_pickle)
        _print(render_inspection(found))
        return EXIT_NONFINITE if found.nonfinite else EXIT_CLEAN


class ReportCommand:
    name = "report"
    help = "render a saved JSON report again: Markdown, HTML (with its picture) or console text"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("input", metavar="IN.json", help="a report written by nanhunt replay --report x.json or --bundle")
        p.add_argument("--format", choices=("md", "html", "console", "json"),
                       help="default: from the suffix of -o, else console")
        p.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout (beside an .html: its .png)")

    def run(self, args: argparse.Namespace) -> int:
        from .._util._safeload import read_json
        from ..records import Report
        from ..report import FORMATS, render_for_format, write
        from ..report.console import render

        # bounded in size and depth: a report is tens of kB, a file from a ticket may be anything
        data = read_json(args.input, what="a nanhunt JSON report",
                         fix="write it again with nanhunt replay --report x.json")
        fmt = args.format
        if fmt is None:
            fmt = FORMATS.get(os.path.splitext(args.output)[1].lower(), "console") if args.output else "console"
        if args.output:
            _check_writable(args.output, fmt)
        # A hand-edited file can hold any type in any field: the renderers trust a Report, so whatever
        # loading or rendering it raises means the file is not a valid report.
        try:
            report = Report.from_dict(data)
            if args.output:
                write(report, args.output, fmt)
            elif fmt == "console":
                _print(render(report))
            else:
                sys.stdout.write(render_for_format(fmt)(report))
        except NanhuntError:
            raise
        except Exception as e:
            raise CommandError(f"{args.input!r} is not a nanhunt JSON report ({_first_line(e)}); write it again "
                               "with nanhunt replay --report x.json") from e
        return EXIT_CLEAN


class CompareCommand:
    name = "compare"
    help = ("run one step in float32 and under autocast; rank module calls by the error they introduce and "
            "compare the decisions; on a fixed set of batches, validate autocast against an acceptance rule")

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="checkpoint.pt: a nanhunt capture, a state_dict, {'model': ...} or Lightning's")
        p.add_argument("batch", nargs="+", metavar="SET",
                       help="batch.pt: a nanhunt capture, a tensor, (inputs, targets) or a dict; several files or a "
                            "directory of them (*.pt, *.pth) make a set, each batch named by its file and each "
                            "sample FILE:INDEX")
        p.add_argument("--model", metavar="PKG.MOD:FACTORY", help="how to build the model (required for plain state_dicts)")
        p.add_argument("--loss", metavar="PKG.MOD:FN", help="loss function called as fn(output, targets)")
        _name_options(p)
        p.add_argument("--dtype", type=_dtypes, metavar="float16[,bfloat16]",
                       help="autocast dtype(s), comma-separated: each is compared against one float32 reference "
                            "(default: the capture's, else float16)")
        p.add_argument("--task", choices=("classify", "regress", "none"),
                       help="classify: top-1 class per sample, flips, near-boundary samples, accuracy; regress: error "
                            "per sample, extremes, mse and max error (default none)")
        p.add_argument("--metric", metavar="PKG.MOD:FN", help="your quality metric, fn(outputs, targets) -> float, on "
                       "both runs (higher is better unless fn.higher_is_better is False); confirms a rule file's")
        rule = p.add_argument_group("the acceptance rule, fixed before the run (printed and hashed)")
        rule.add_argument("--rule", metavar="RULE.json", help="the rule as a JSON object: task, metric, "
                          "higher_is_better, rtol, atol, fail_on_tolerance, max_flips, max_quality_drop, min_quality, "
                          "allow_nonfinite (instead of the flags below)")
        rule.add_argument("--rtol", type=float, help="relative tolerance (default: float16 1e-3, bfloat16 1e-2)")
        rule.add_argument("--atol", type=float, help="absolute tolerance (default 1e-5)")
        rule.add_argument("--max-flips", type=int, metavar="N", help="decision flips allowed (default 0)")
        rule.add_argument("--fail-on-tolerance", action="store_true",
                          help="also fail when the output or the loss is out of tolerance (default: tolerances only rank)")
        rule.add_argument("--max-quality-drop", type=float, metavar="D",
                          help="the autocast run's quality may be at most D worse than float32's")
        rule.add_argument("--min-quality", type=float, metavar="Q",
                          help="the autocast run's quality must be at least Q (at most, where lower is better)")
        rule.add_argument("--allow-nonfinite", action="append", metavar="NAME",
                          help="non-finite values introduced inside module NAME (its subtree; <root>: the model's "
                               "own code, <input>: the batch) are explained, if they reach neither loss nor gradient")
        p.add_argument("--speed", type=int, nargs="?", const=10, metavar="N",
                       help="after validation, time the plain step (no nanhunt hook) of each passing candidate against "
                            "float32, N interleaved repetitions (default 10); peak memory (CUDA: allocated bytes, "
                            "Linux CPU: peak RSS growth) in one more untimed pass each")
        p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default cpu)")
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--train", dest="train", action="store_const", const=True, help="run in train mode")
        mode.add_argument("--eval", dest="train", action="store_const", const=False,
                          help="run in eval mode (--speed then times inference: forward and loss, no gradients)")
        p.add_argument("--report", metavar="PATH",
                       help="also write the report (.json, .md, .html + .png beside, .txt); each run is recorded in "
                            "nanhunt-compare-history.jsonl beside it, and a rule changed after a failing run of the "
                            "same checkpoint is a warning in the report")
        p.add_argument("--trust-pickle", action="store_true", help="allow weights_only=False loads (runs code from the files!)")

    def run(self, args: argparse.Namespace) -> int:
        from ..capture.capture import load_step
        from ..comparison.engine import History, compare, settle_rule
        from ..report import renderer_for, write
        from ..report.console import render_comparison

        if args.report:
            renderer_for(args.report)  # fail on a bad suffix or an unwritable path before the long part
            _check_writable(args.report)
        if args.speed is not None and args.speed < 1:
            raise CommandError("--speed needs at least 1 repetition")
        files, is_set = _batch_files(args.batch)
        rule = _rule_of(args)
        if args.trust_pickle:
            print("warning: --trust-pickle loads the files with weights_only=False, which runs any code they contain",
                  file=sys.stderr)
        rule, _ = settle_rule(rule, args.metric)
        step = load_step(
            args.checkpoint, files[0][1], model_factory=args.model, loss=args.loss, optimizer=args.optimizer,
            trust_names=tuple(args.trust_names), device=args.device,
            dtype=args.dtype[0] if args.dtype else None, train=args.train, trust_pickle=args.trust_pickle,
        )
        for n in step.notes:
            print(visible(f"warning: {n}"), file=sys.stderr)
        # A capture taken in float32 has no autocast dtype to compare: float16 then.
        dtype = args.dtype or ["float16" if str(step.dtype) == "torch.float32" else str(step.dtype)]
        batches = _load_set(files, step, trust_pickle=args.trust_pickle) if is_set else None
        # Fixed before the run: printed (stderr: stdout starts with the verdict) and hashed into the report.
        print(visible(f"rule (fixed before the run): {rule.canonical()}"), file=sys.stderr)
        print(f"rule sha256: {rule.sha256()}", file=sys.stderr)
        history = History.beside(args.report, args.checkpoint, [n for n, _ in files]) if args.report else None
        for w in history.warnings(rule.sha256()) if history is not None else ():
            print(visible(f"warning: {w}"), file=sys.stderr)
        try:
            report = compare(
                step.model, None if is_set else (step.inputs, step.targets), batches=batches, loss_fn=step.loss_fn,
                dtype=dtype, device_type=step.device_type, rule=rule, metric=args.metric, speed=args.speed or 0,
                scaler=step.scaler, train=args.train, rng=step.rng, command=_command_line(), notes=step.notes,
            )
        except NanhuntError:
            raise
        except Exception as e:  # the user's model failed on this batch: an input problem, not ours
            raise _step_failed("running the step", e) from e
        if history is not None:
            report = history.record(report)
        _print(render_comparison(report))
        if args.report:
            write(report, args.report)
        assert report.comparison is not None
        return EXIT_CLEAN if all(c.accepted for c in report.comparison.candidates()) else EXIT_NONFINITE


def _name_options(p: argparse.ArgumentParser) -> None:
    """The flags that confirm names a capture suggests, beside --model and --loss."""
    p.add_argument("--optimizer", metavar="PKG.MOD:CLASS", help="optimizer class, built on the model's parameters "
                   "with the file's groups and state (confirms one the file names)")
    p.add_argument("--trust-names", action="append", default=[], metavar="PKG",
                   help="use the model, loss and optimizer names the file gives inside package PKG (and its "
                        "submodules) without --model/--loss/--optimizer; repeatable; also NANHUNT_TRUST_NAMES=a,b")


def _dtypes(text: str) -> list[str]:
    """``--dtype float16,bfloat16``: one or more autocast dtypes, each once."""
    names = [t.strip().replace("torch.", "") for t in text.split(",")]
    if not names or any(n not in ("float16", "bfloat16") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give float16, bfloat16 or both (float16,bfloat16)")
    return names


_BATCH_SUFFIXES = (".pt", ".pth")


def _batch_files(paths: Sequence[str]) -> tuple[list[tuple[str, str]], bool]:
    """(name, path) of every batch file SET names, and whether it is a set (several files or a directory).
    A directory gives its *.pt and *.pth files in name order; a batch is named by its file name, or by the
    path as given when two files share a name."""
    found: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            inside = sorted(f for f in os.listdir(p) if f.endswith(_BATCH_SUFFIXES) and not f.startswith("."))
            inside = [f for f in inside if os.path.isfile(os.path.join(p, f))]
            if not inside:
                raise CommandError(f"the directory {p!r} holds no batch file (*.pt, *.pth)")
            found += [os.path.join(p, f) for f in inside]
        else:
            found.append(p)
    if len(set(found)) != len(found):
        raise CommandError("a batch file is named twice in the set")
    base = [os.path.basename(f) for f in found]
    names = base if len(set(base)) == len(base) else found
    return list(zip(names, found)), len(found) > 1 or any(os.path.isdir(p) for p in paths)


_RULE_FLAGS = ("rtol", "atol", "max_flips", "max_quality_drop", "min_quality", "allow_nonfinite")


def _rule_of(args: argparse.Namespace) -> Any:
    """The acceptance rule from --rule or the flags (not both); --task and --metric fill in what the file leaves
    out. A metric function a file names is imported only when --metric confirms it, like a file's loss."""
    from .._util._safeload import read_json
    from ..comparison.engine import rule_from

    flags = {k: getattr(args, k) for k in _RULE_FLAGS if getattr(args, k) is not None}
    if args.fail_on_tolerance:
        flags["fail_on_tolerance"] = True
    if args.rule is None:
        d: dict[str, Any] = {**flags, "task": args.task or "none"}
        if args.metric is not None:
            d["metric"] = args.metric
        return rule_from(d, where="the rule flags")
    if flags:
        given = ", ".join("--" + k.replace("_", "-") for k in flags)
        raise CommandError(f"--rule fixes the acceptance rule; {given} would change it: put the clause in "
                           f"{args.rule!r} or drop --rule")
    where = f"the rule {args.rule!r}"
    d = read_json(args.rule, what="an acceptance rule (JSON)", label=where,
                  fix="give a JSON object of the rule's clauses (task, metric, rtol, ...)")
    if not isinstance(d, dict):
        raise CommandError(f"{where} is a JSON {type(d).__name__}, not an object of the rule's clauses")
    for key, flag in (("task", args.task), ("metric", args.metric)):
        if flag is not None and d.get(key, flag) != flag:
            raise CommandError(f"{where} says {key} {d[key]!r} but --{key} says {flag!r}; give one")
    metric = d.get("metric")
    if isinstance(metric, str) and ":" in metric and args.metric != metric:
        raise CommandError(f"{where} names the metric function {metric!r}, which nanhunt does not import "
                           f"unconfirmed; if you trust it, pass --metric {metric} to confirm")
    if args.task is not None:
        d.setdefault("task", args.task)
    if args.metric is not None:
        d.setdefault("metric", args.metric)
    return rule_from(d, where=where)


def _load_set(files: Sequence[tuple[str, str]], step: Any, *, trust_pickle: bool) -> dict[str, Any]:
    """Every batch of the set, by name, on the model's device (the first is the step's, loaded already)."""
    from torch import nn

    from ..capture.capture import load_file, to_device
    from ..step.step import split_batch

    device = next((p.device for p in step.model.parameters()), None)
    out: dict[str, Any] = {files[0][0]: (step.inputs, step.targets)}
    for name, path in files[1:]:
        bt = load_file(path, what="batch", trust_pickle=trust_pickle)
        if isinstance(bt, nn.Module):
            raise CommandError(f"the batch file {path!r} holds a model, not a batch")
        inputs, targets = split_batch(bt)
        out[name] = (inputs, targets) if device is None else (to_device(inputs, device), to_device(targets, device))
    return out


COMMANDS: tuple[Command, ...] = (ReplayCommand(), InspectCommand(), ReportCommand(), CompareCommand())


def _step_failed(what: str, e: Exception) -> CommandError:
    """The step raised: the user's code (model, loss) on this batch, or nanhunt's own, told by the last
    frame of the traceback outside torch and the standard library."""
    if _raised_by_nanhunt(e):
        return CommandError(f"{what} failed inside nanhunt ({_first_line(e)}): a nanhunt bug, not your model; "
                            "rerun with --debug and report the traceback")
    return CommandError(f"{what} raised {_first_line(e)} — does the batch fit the model?")


# nanhunt's functions that run the user's step on its behalf (an op of the model under the tracer, the
# loss, the update): an error raised under them is the step's own
_CALL_THROUGH = frozenset({"_on_op", "__torch_dispatch__", "_call_model", "_loss_of", "_backward", "run_step",
                           "forward", "call"})


def _raised_by_nanhunt(e: BaseException) -> bool:
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nanhunt/, above cli/
    skipped = [os.path.dirname(os.path.abspath(os.__file__))]  # the standard library
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and torch_mod.__file__:
        skipped.append(os.path.dirname(os.path.abspath(torch_mod.__file__)))
    last = None
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        f = os.path.abspath(code.co_filename)
        if f.startswith(ours + os.sep) or not any(f.startswith(d + os.sep) for d in skipped):
            last = (f, code.co_name)
        tb = tb.tb_next
    return last is not None and last[0].startswith(ours + os.sep) and last[1] not in _CALL_THROUGH


def _check_writable(path: str, fmt: str | None = None) -> None:
    """Fail on a report path that cannot be written before the long replay, not after it: its directory,
    and every file the report writes there (an HTML page's picture too) is absent or a regular file."""
    from .._util._files import check_target
    from ..report import targets

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CommandError(f"cannot write {path!r}: it is a directory; give a file name")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise CommandError(f"cannot write {path!r}: {parent!r} {what}; give a path in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"cannot write {path!r}: the directory {parent!r} is not writable; give another path")
    for p in targets(path, fmt):
        check_target(p)


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


_WRITTEN: list[str] = []  # what this command put in the user's place (a report, a bundle): the interrupt line


@atomic  # Ctrl-C and SIGTERM wait until the files are in place and noted: the line after an interrupt is true
def _put(what: str, write: Callable[[], object]) -> None:
    """Run ``write``, which puts ``what`` in the user's place, and note it."""
    write()
    _WRITTEN.append(what)


def _interrupted(what: str) -> str:
    """The line after Ctrl-C (``what``: interrupted) or SIGTERM: what this command had written, if anything."""
    if not _WRITTEN:
        return f"nanhunt: {what}; the model and files were left as they were"
    return visible(f"nanhunt: {what} after writing {', '.join(map(repr, _WRITTEN))}; the model and other files were "
                   "left as they were")


def _error(e: BaseException) -> None:
    # The one place errors are printed: a message may quote a file's content (a key, a module name), whose
    # control characters would otherwise end the line, forge another or recolour the terminal.
    print("nanhunt: error: " + visible(str(e)), file=sys.stderr)


_ARGV: list[str] = []  # the arguments main() was given (not sys.argv: main(["replay", ...]) from Python)


def _command_line(launcher: str = "") -> str:
    """The command as given (after ``launcher``: ``torchrun --nproc-per-node N -m``); when it names files by
    relative paths, run from the directory it ran in (``cd DIR && nanhunt ...``): a report or bundle is read
    elsewhere."""
    command = (f"{launcher} " if launcher else "") + "nanhunt " + " ".join(shlex.quote(a) for a in _ARGV)
    relative = any(a and not a.startswith("-") and not os.path.isabs(a) and os.path.exists(a) for a in _ARGV)
    return f"cd {shlex.quote(os.getcwd())} && {command}" if relative else command


def _dist_launcher() -> str:
    """How the replay under torchrun is started again: every rank replays its own batch."""
    return f"torchrun --nproc-per-node {os.environ.get('WORLD_SIZE', '1')} -m"


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
    _ARGV[:] = list(sys.argv[1:] if argv is None else argv)
    _WRITTEN.clear()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    debug = bool(getattr(args, "debug", False))
    try:
        with warnings.catch_warnings(), terminate_raises():  # SIGTERM: `finally` blocks put everything back
            if not debug:
                warnings.simplefilter("ignore", UserWarning)
            return int(args._cmd.run(args))
    except CommandError as e:
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
        print(_interrupted("interrupted"), file=sys.stderr)
        return 130
    except Terminated:
        print(_interrupted("terminated (SIGTERM)"), file=sys.stderr)
        return 143


