"""``nanhunt compare`` for a coding agent (:mod:`._mcp`): one step, or a fixed set of batches, in float32 and under
autocast, judged against an acceptance rule fixed before the run; the answer is the verdict and the comparison's
report as JSON (the report's schema, with its ``comparison``)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Any

from .._util._errors import InputError
from .._util._text import dtype_name
from ._agent import Answer, check_report_path, headline, step_failed

__all__ = ["CompareArgs", "compare"]

# the rule's clauses as their own arguments (``--rtol`` ...), which rule_given reads by these names
_RULE_FLAGS = ("rtol", "atol", "max_flips", "max_quality_drop", "min_quality", "allow_nonfinite")


@dataclass(frozen=True)
class CompareArgs:
    """What ``nanhunt compare`` takes, by its flags' names: ``batches`` one file, or several files or a directory
    of them (a set); the names you confirm (``model``, ``loss``, ``optimizer``, ``trust_names``, ``metric``); the
    acceptance rule from a JSON file (``rule``) or clause by clause; ``speed``: time the passing candidates."""

    checkpoint: str
    batches: tuple[str, ...]
    model: str | None = None
    loss: str | None = None
    optimizer: str | None = None
    trust_names: tuple[str, ...] = ()
    dtype: tuple[str, ...] = ()
    task: str | None = None
    metric: str | None = None
    rule: str | None = None
    rtol: float | None = None
    atol: float | None = None
    max_flips: int | None = None
    fail_on_tolerance: bool = False
    max_quality_drop: float | None = None
    min_quality: float | None = None
    allow_nonfinite: tuple[str, ...] = ()
    speed: int | None = None
    device: str | None = None
    train: bool | None = None
    report: str | None = None
    trust_pickle: bool = False

    def __post_init__(self) -> None:
        for name in ("batches", "trust_names", "dtype", "allow_nonfinite"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # a list from a caller: still frozen
        if not self.batches:
            raise InputError("compare needs at least one batch file (or a directory of them)")
        names = [d if d == "float8" else dtype_name(d) for d in self.dtype]
        if any(n not in ("float16", "bfloat16", "float8") for n in names) or len(set(names)) != len(names):
            raise InputError(f"dtype {list(self.dtype)}: give float16, bfloat16, float8 (the model's float8 layers "
                             "as they ran) or several, each once")
        object.__setattr__(self, "dtype", tuple(names))
        if self.speed is not None and self.speed < 1:
            raise InputError("--speed needs at least 1 repetition")

    def rule_flags(self) -> dict[str, Any]:
        """The clauses given one by one, as rule_given reads them."""
        flags: dict[str, Any] = {k: getattr(self, k) for k in _RULE_FLAGS if getattr(self, k) not in (None, ())}
        if "allow_nonfinite" in flags:
            flags["allow_nonfinite"] = list(flags["allow_nonfinite"])
        if self.fail_on_tolerance:
            flags["fail_on_tolerance"] = True
        return flags

    def command(self) -> str:
        """The ``nanhunt compare`` command that runs as this call did (paths absolute)."""
        argv = [os.path.abspath(self.checkpoint), *(os.path.abspath(b) for b in self.batches)]
        named: list[tuple[str, object]] = [
            ("--model", self.model), ("--loss", self.loss), ("--optimizer", self.optimizer),
            *(("--trust-names", t) for t in self.trust_names), ("--dtype", ",".join(self.dtype) or None),
            ("--task", self.task), ("--metric", self.metric),
            ("--rule", None if self.rule is None else os.path.abspath(self.rule)), ("--rtol", self.rtol),
            ("--atol", self.atol), ("--max-flips", self.max_flips), ("--max-quality-drop", self.max_quality_drop),
            ("--min-quality", self.min_quality), *(("--allow-nonfinite", a) for a in self.allow_nonfinite),
            ("--speed", self.speed), ("--device", self.device),
            ("--report", None if self.report is None else os.path.abspath(self.report))]
        argv += [a for flag, value in named if value is not None for a in (flag, str(value))]
        switches = [("--fail-on-tolerance", self.fail_on_tolerance), ("--train", self.train is True),
                    ("--eval", self.train is False), ("--trust-pickle", self.trust_pickle)]
        argv += [flag for flag, on in switches if on]
        return "nanhunt compare " + " ".join(shlex.quote(a) for a in argv)


def compare(args: CompareArgs) -> Answer:
    """``nanhunt compare``: the verdict of each run (autocast dtype, float8) against float32 under the rule, as its
    report."""
    from ..comparison._files import compare_files
    from ..report import write

    if args.report is not None:
        check_report_path(args.report)
    said: list[str] = []
    report = compare_files(
        args.checkpoint, args.batches, model=args.model, loss=args.loss, optimizer=args.optimizer,
        trust_names=args.trust_names, device=args.device, dtype=args.dtype or None, train=args.train,
        trust_pickle=args.trust_pickle, rule_file=args.rule, rule_flags=args.rule_flags(), task=args.task,
        metric=args.metric, speed=args.speed or 0, report=args.report, command=args.command(), say=said.append,
        failed=step_failed)
    if args.report is not None:
        said.append(f"report: {', '.join(write(report, args.report))}")
    assert report.comparison is not None
    accepted = all(c.accepted for c in report.comparison.candidates())
    said.insert(0, "accepted: the rule held" if accepted else "violated: the rule did not hold")
    return Answer(headline(report, said), report.to_dict())
