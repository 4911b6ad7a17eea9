"""What nanhunt answers a coding agent (``nanhunt mcp``, served by :mod:`._mcp`): a checkpoint inspected, a step
replayed, a saved report rendered, each run through the library as its command runs it (the comparison in
:mod:`._agent_compare`). Each answer is a short text, the headline a person reads first, and the JSON a program
reads: a replay's is its report's (``Report.to_json``, ``schema_version`` first), as ``--report x.json`` writes it.

Nothing here imports the MCP SDK or prints: a refusal is the library's :class:`InputError`, which the server
turns into the protocol's error result; the user's model failing on its batch is one too (:func:`step_failed`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._util._errors import InputError, NanhuntError, first_line, visible
from .._util._text import cut

if TYPE_CHECKING:
    from rich.console import RenderableType

    from ..capture.capture import Loaded
    from ..hunt._options import ReplayOptions
    from ..records import Report

__all__ = ["Answer", "inspect", "replay", "render_report", "headline", "replay_command", "check_report_path",
           "step_failed", "INSPECTION_SCHEMA_VERSION", "RENDER_FORMATS"]

# The layout of inspect's JSON (the fields of :class:`nanhunt.records.Inspection`); a replay's is the report's own.
INSPECTION_SCHEMA_VERSION = 1
# what render_report writes: a report's formats as ``nanhunt report --format`` names them, "text" for console
RENDER_FORMATS = ("md", "text", "json", "html")
_SHOWN_LINES = 5  # warnings and notes quoted under a headline: the rest are in the JSON


@dataclass(frozen=True)
class Answer:
    """``text``: what a person reads (the headline, a rendered report); ``data``: the JSON object a program reads,
    or None (a rendering is its text)."""

    text: str
    data: dict[str, Any] | None = None


def step_failed(what: str, e: Exception) -> InputError:
    """The user's model or loss raised on this batch (or, rarely, nanhunt did): one line, the fix to try."""
    return InputError(f"{what} raised {first_line(e)}: does the batch fit the model? (run the same with the nanhunt "
                      "command line and --debug for the traceback)")


def check_report_path(path: str) -> None:
    """Refuse, before the long part, a report path whose format is unknown or whose files cannot be written: the
    directory exists (an agent's typo does not make directories) and each file written is absent or regular."""
    from .._util._files import check_target
    from ..report import renderer_for, targets

    renderer_for(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"cannot write {path!r}: the directory {parent!r} does not exist; give a path in a directory")
    for p in targets(path):
        check_target(p)


def _plain(renderable: RenderableType, width: int = 100) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False).print(renderable)
    return buf.getvalue().rstrip() + "\n"


def inspect(checkpoint: str, *, trust_pickle: bool = False) -> Answer:
    """``nanhunt inspect CHECKPOINT``: its text, and the :class:`~nanhunt.records.Inspection` as JSON."""
    from ..capture.inspect_ckpt import inspect_checkpoint
    from ..records._serial import json_floats  # NaN and Inf as "nan"/"inf", as every file nanhunt writes
    from ..report.console import render_inspection

    found = inspect_checkpoint(checkpoint, trust_pickle=trust_pickle)
    data = {"schema_version": INSPECTION_SCHEMA_VERSION, "nonfinite": found.nonfinite,
            "scaler_nonfinite": found.scaler_nonfinite, **json_floats(dataclasses.asdict(found))}
    return Answer(_plain(render_inspection(found)), data)


def replay(checkpoint: str, batch: str | None, options: ReplayOptions, *, rank: int | None = None,
           report: str | None = None) -> Answer:
    """``nanhunt replay`` in one process: the step of ``checkpoint`` and ``batch`` (or of the capture directory
    ``checkpoint``, ``rank``'s batch) replayed and hunted; the report written to ``report`` too when given."""
    from ..capture.capture import load_replay
    from ..hunt._ranks import other_ranks, received_note
    from ..hunt.pipeline import hunt
    from ..records import Status
    from ..report import write

    if report is not None:
        check_report_path(report)
    command = replay_command(checkpoint, batch, options, rank=rank, report=report)
    said: list[str] = []
    loaded = load_replay(checkpoint, batch, options.load, rank=rank)
    # a capture directory's first note says which rank's batch is replayed; any other is a warning
    said += [n if batch is None and i == 0 else f"warning: {n}" for i, n in enumerate(loaded.step.notes)]

    def hunted(loaded: Loaded) -> Report:
        try:
            return hunt(loaded.step, level=options.level, allow=options.allow, prove=options.prove,
                        command=command, repeat=options.repeat, event=loaded.event)
        except NanhuntError:
            raise
        except Exception as e:  # the user's model failed on this batch: an input problem, not ours
            raise step_failed("replaying the step", e) from e

    found = hunted(loaded)
    if batch is None and rank is None and found.status == Status.CLEAN:
        del loaded  # one model in memory at a time
        found = other_ranks(checkpoint, found, hunted, options.load, said.append)
    elif found.status == Status.CLEAN:
        found = received_note(found, said.append)
    if report is not None:
        said.append(f"report: {', '.join(write(found, report))}")
    return Answer(headline(found, said), found.to_dict())


def headline(report: Report, said: Sequence[str] = ()) -> str:
    """The answer in a few lines: the report's sentence; status, phase, module, op and verdict as ``key: value``;
    then the lines the replay said (warnings, notes, files written), a few at most."""
    from ..report.console import compare_summary, summary_line

    if report.comparison is not None:
        lines = [compare_summary(report)]
    else:
        occ, v = report.first, report.verdict
        fields = [("status", report.status.value)]
        if occ is not None:
            fields += [("phase", occ.phase.value), ("module", "(outside the model)" if occ.module is None
                                                     else occ.module), ("op", occ.op or "(none: a module's value)")]
        fields.append(("verdict", "(not bisected)" if v is None else v.kind.value))
        if v is not None and v.culprits:
            fields.append(("float32 fix", ", ".join(v.culprits)))
        lines = [summary_line(report), "; ".join(f"{k}: {visible(cut(x))}" for k, x in fields)]
    lines += [visible(cut(s, 1000)) for s in said[:_SHOWN_LINES]]
    if len(said) > _SHOWN_LINES:
        lines.append(f"(+{len(said) - _SHOWN_LINES} more lines: see the JSON's notes)")
    return "\n".join(lines) + "\n"


def render_report(path: str, fmt: str = "md", output: str | None = None) -> Answer:
    """``nanhunt report IN.json``: the saved report in ``fmt`` (md, text, json, html), or written to ``output``."""
    from .._util._json import read_json
    from ..records import Report
    from ..report import render_for_format, write

    if fmt not in RENDER_FORMATS:
        raise InputError(f"format {fmt!r}: name one of {', '.join(RENDER_FORMATS)}")
    if output is not None:
        check_report_path(output)
    name = "console" if fmt == "text" else fmt
    # bounded in size and depth: a report is tens of kB, a file from a ticket may be anything
    data = read_json(path, what="a nanhunt JSON report", fix="write it again with nanhunt replay --report x.json")
    try:  # a hand-edited file can hold any type in any field: whatever fails means it is not a valid report
        report = Report.from_dict(data)
        if output is not None:
            return Answer(f"wrote {', '.join(write(report, output, name))}\n")
        return Answer(render_for_format(name)(report))
    except NanhuntError:
        raise
    except Exception as e:
        raise InputError(f"{path!r} is not a nanhunt JSON report ({first_line(e)}); write it again with nanhunt "
                         "replay --report x.json") from e


def replay_command(checkpoint: str, batch: str | None, options: ReplayOptions, *, rank: int | None = None,
                   report: str | None = None) -> str:
    """The ``nanhunt replay`` command that replays as the agent's call did (the report's "replay again" line):
    paths absolute, since the server's directory is not the reader's."""
    load = options.load
    argv = [os.path.abspath(checkpoint)] + ([os.path.abspath(batch)] if batch is not None else [])
    named: list[tuple[str, object]] = [
        ("--rank", rank), ("--model", load.model_factory), ("--loss", load.loss), ("--optimizer", load.optimizer),
        *(("--trust-names", t) for t in load.trust_names), ("--dtype", load.dtype), ("--device", load.device),
        ("--level", None if options.level.value == "op" else options.level.value),
        *(("--allow", a) for a in options.allow), ("--snapshot", load.snapshot),
        ("--repeat", None if options.repeat == 1 else options.repeat), ("--compile", load.compile),
        ("--report", None if report is None else os.path.abspath(report))]
    argv += [a for flag, value in named if value is not None for a in (flag, str(value))]
    switches = [("--no-scaler", load.no_scaler), ("--train", load.train is True), ("--eval", load.train is False),
                ("--no-bisect", not options.prove), ("--trust-pickle", load.trust_pickle),
                ("--trust-compile-options", load.trust_compile_options)]
    argv += [flag for flag, on in switches if on]
    return "nanhunt replay " + " ".join(shlex.quote(a) for a in argv)
