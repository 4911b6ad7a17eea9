"""``nanhunt compare``: one step in float32 and under autocast, or a fixed set of batches validated against an
acceptance rule fixed before the run."""

from __future__ import annotations

import argparse
import sys

from .._util._errors import InputError, visible
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
        p.add_argument("--dtype", type=_dtypes, metavar="float16[,bfloat16][,float8]",
                       help="autocast dtype(s), comma-separated: each is compared against one float32 reference; "
                            "float8: the model's torchao float8 layers in float8, as they ran (the other runs take "
                            "them out of float8) (default: float8,bfloat16 for a model with float8 layers, else the "
                            "capture's dtype, else float16)")
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
        from ..comparison._files import compare_files
        from ..report import renderer_for, write
        from ..report.console import render_comparison

        if args.report:
            renderer_for(args.report)  # fail on a bad suffix or an unwritable path before the long part
            check_writable(args.report)
        if args.speed is not None and args.speed < 1:
            raise InputError("--speed needs at least 1 repetition")
        flags = {k: getattr(args, k) for k in _RULE_FLAGS if getattr(args, k) is not None}
        if args.fail_on_tolerance:
            flags["fail_on_tolerance"] = True
        if args.trust_pickle:
            warn_trust_pickle()
        # what it says goes to stderr: stdout starts with the verdict
        report = compare_files(
            args.checkpoint, args.batch, model=args.model, loss=args.loss, optimizer=args.optimizer,
            trust_names=args.trust_names, device=args.device, dtype=args.dtype, train=args.train,
            trust_pickle=args.trust_pickle, rule_file=args.rule, rule_flags=flags, task=args.task,
            metric=args.metric, speed=args.speed or 0, report=args.report, command=command_line(),
            say=lambda line: print(visible(line), file=sys.stderr), failed=step_failed)
        print_rich(render_comparison(report))
        if args.report:
            write(report, args.report)
        assert report.comparison is not None
        return EXIT_CLEAN if all(c.accepted for c in report.comparison.candidates()) else EXIT_NONFINITE


def _dtypes(text: str) -> list[str]:
    """``--dtype float16,bfloat16``: one or more autocast dtypes (or float8), each once."""
    names = [t.strip().lower() if t.strip().lower() == "float8" else dtype_name(t.strip()) for t in text.split(",")]
    if not names or any(n not in ("float16", "bfloat16", "float8") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give float16, bfloat16, float8 or several, each once "
                                         "(float8,bfloat16)")
    return names


_RULE_FLAGS = ("rtol", "atol", "max_flips", "max_quality_drop", "min_quality", "allow_nonfinite")
