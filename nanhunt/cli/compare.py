"""``nanhunt compare``: one step in float32 and under autocast, or a fixed set of batches validated against an
acceptance rule fixed before the run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._util._errors import CommandError, NanhuntError, visible
from .._util._text import dtype_name
from ._common import (EXIT_CLEAN, EXIT_NONFINITE, check_writable, command_line, name_options, print_rich,
                      step_failed, warn_trust_pickle)


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
        name_options(p)
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
            check_writable(args.report)
        if args.speed is not None and args.speed < 1:
            raise CommandError("--speed needs at least 1 repetition")
        files, is_set = _batch_files(args.batch)
        rule = _rule_of(args)
        if args.trust_pickle:
            warn_trust_pickle("the files")
        rule, _ = settle_rule(rule, args.metric)
        step = load_step(
            args.checkpoint, files[0][1], model_factory=args.model, loss=args.loss, optimizer=args.optimizer,
            trust_names=tuple(args.trust_names), device=args.device,
            dtype=args.dtype[0] if args.dtype else None, train=args.train, trust_pickle=args.trust_pickle,
        )
        for n in step.notes:
            print(visible(f"warning: {n}"), file=sys.stderr)
        # A capture taken in float32 has no autocast dtype to compare: float16 then.
        dtype = args.dtype or ["float16" if dtype_name(step.dtype) == "float32" else dtype_name(step.dtype)]
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
                scaler=step.scaler, train=args.train, rng=step.rng, command=command_line(), notes=step.notes,
            )
        except NanhuntError:
            raise
        except Exception as e:  # the user's model failed on this batch: an input problem, not ours
            raise step_failed("running the step", e) from e
        if history is not None:
            report = history.record(report)
        print_rich(render_comparison(report))
        if args.report:
            write(report, args.report)
        assert report.comparison is not None
        return EXIT_CLEAN if all(c.accepted for c in report.comparison.candidates()) else EXIT_NONFINITE



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
