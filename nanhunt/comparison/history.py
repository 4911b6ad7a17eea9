"""The rule's history beside the reports of a directory: the runs compared, the warnings when a rule changed after a failure."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._util._errors import InputError
from .._util._files import append_file, read_own
from ..records import Comparison, Report


# ------------------------------------------------------------------ the rule's history


HISTORY_FILE = "nanhunt-compare-history.jsonl"
_WARNED = 5  # earlier rules a report names
_FIX = "move it away to start a new one"


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(functools.partial(f.read, 1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise InputError(f"cannot read {path!r} to identify it in the compare history: {e.strerror}") from e
    return h.hexdigest()


def _failed_clauses(c: Comparison) -> list[str]:
    """``clause (autocast dtype)`` for every clause a candidate failed, in order, each once."""
    return list(dict.fromkeys(f"{f.clause} ({x.run_name()})" for x in c.candidates() for f in x.failures))


@dataclass(frozen=True)
class History:
    """The compare runs recorded beside the reports of one directory (``nanhunt-compare-history.jsonl``, one
    JSON object per run): which checkpoint (its sha256), under which rule (its sha256), and whether the rule
    held. Kept so that a rule widened after a failing run shows: a report of a later run of the same
    checkpoint under another rule says which rule failed before, and on which clause.

    Example::

        history = History.beside("reports/run.json", "checkpoint.pt")
        print(history.warnings(rule.sha256()))          # before the run
        report = history.record(nanhunt.compare(...))   # after it: the warnings in the report, the run appended
    """

    path: str
    checkpoint: str
    checkpoint_sha256: str
    batches: tuple[str, ...] = ()
    report: str = ""

    @classmethod
    def beside(cls, report_path: str, checkpoint: str, batches: Sequence[str] = ()) -> History:
        """The history of the directory ``report_path`` is written to, for the checkpoint file ``checkpoint``."""
        where = os.path.join(os.path.dirname(os.path.abspath(report_path)), HISTORY_FILE)
        return cls(where, checkpoint, _file_sha256(checkpoint), tuple(batches), report_path)

    def runs(self) -> list[dict[str, Any]]:
        """The recorded runs of this checkpoint, oldest first (lines that are not a run's JSON are skipped)."""
        out: list[dict[str, Any]] = []
        # a link or a FIFO at its name is refused (read through a link, appended through it after the run; a FIFO
        # would block): said before the compare runs
        data = read_own(self.path, "the compare history", _FIX)
        if data is None:
            return out
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise InputError(f"cannot read the compare history {self.path!r}: {e}; {_FIX}") from e
        for line in lines:
            try:
                run = json.loads(line)
            except ValueError:
                continue
            if isinstance(run, dict) and run.get("checkpoint_sha256") == self.checkpoint_sha256 \
                    and isinstance(run.get("rule_sha256"), str):
                out.append(run)
        return out

    def warnings(self, rule_sha256: str) -> tuple[str, ...]:
        """One line per earlier rule (newest first) under which this checkpoint failed, when it is not
        ``rule_sha256``: the rule changed after a failing run."""
        latest: dict[str, dict[str, Any]] = {}
        for run in self.runs():
            if run.get("accepted") is False and run["rule_sha256"] != rule_sha256:
                latest.pop(run["rule_sha256"], None)
                latest[run["rule_sha256"]] = run  # the newest failing run of each rule, in time order
        out: list[str] = []
        for digest, run in reversed(list(latest.items())):
            failed = [str(x) for x in run.get("failed", ())] or ["unknown"]
            clause = f"clause{'s' if len(failed) != 1 else ''} {', '.join(failed)}"
            when = f"; {run['time']}" if isinstance(run.get("time"), str) else ""
            out.append(f"the rule changed after a failing run (was {digest[:12]} failing {clause}, now "
                       f"{rule_sha256[:12]}{when}, {HISTORY_FILE})")
        if len(out) > _WARNED:
            out = out[:_WARNED] + [f"... and {len(out) - _WARNED} earlier failing rules in {HISTORY_FILE}"]
        return tuple(out)

    def record(self, report: Report) -> Report:
        """``report`` with the warnings of its rule (``comparison.rule_warnings``); this run appended."""
        c = report.comparison
        assert c is not None, "not a comparison report"
        warned = self.warnings(c.rule_sha256)
        run = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checkpoint": self.checkpoint, "checkpoint_sha256": self.checkpoint_sha256, "batches": list(self.batches),
            "dtype": ",".join(x.dtype for x in c.candidates()), "rule_sha256": c.rule_sha256,
            "rule": c.acceptance.canonical() if c.acceptance is not None else None,
            "accepted": all(x.accepted for x in c.candidates()), "failed": _failed_clauses(c), "report": self.report,
        }
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)  # the report's, made if missing
        except OSError as e:
            raise InputError(f"cannot append to the compare history {self.path!r}: {e.strerror}") from e
        append_file(self.path, (json.dumps(run, allow_nan=False) + "\n").encode("utf-8"))  # no link, no FIFO
        return dataclasses.replace(report, comparison=dataclasses.replace(c, rule_warnings=warned))
