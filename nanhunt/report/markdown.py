"""Markdown for a bug ticket (GitHub, GitLab): a summary that fits a screen, the rest folded in ``<details>``.

Every user string (module paths, op names, source lines, notes) is escaped: as
text, Markdown's punctuation is backslash-escaped; as code, the span's backtick
fence is longer than any backtick run inside it; in a table, pipes are escaped
too (GFM splits cells before it reads code spans).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from ..records import Occurrence, Report
from . import _common as c
from ._common import Span

__all__ = ["render", "escape", "code", "fence"]

_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&#!])")
_PATH_SHOWN = 40
_LIST_SHOWN = 50


def escape(s: str) -> str:
    """``s`` as literal inline text: no emphasis, link, HTML, table cell break or heading."""
    return _SPECIAL.sub(r"\\\1", " ".join(s.splitlines()))


def code(s: str, *, table: bool = False) -> str:
    """``s`` as an inline code span, whatever backticks it holds."""
    s = " ".join(s.splitlines())
    if not s:
        return ""
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s[0] == "`" or s[-1] == "`" or (s[0] == " " and s[-1] == " " and s.strip()) else ""
    out = f"{ticks}{pad}{s}{pad}{ticks}"
    return out.replace("|", "\\|") if table else out


def fence(text: str, lang: str = "") -> str:
    """A fenced code block whose fence no line of ``text`` can close."""
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`{3,}", text)), default=0) + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def _spans(spans: list[Span], *, table: bool = False) -> str:
    return "".join(code(s.text, table=table) if s.code else escape(s.text) for s in spans)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], *, right_from: int = 0) -> str:
    align = ["---:" if i >= right_from > 0 else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _details(summary: str, body: str) -> str:
    # A blank line after <summary> and before </details>: GitHub then reads the body as Markdown.
    return f"<details>\n<summary>{html.escape(summary)}</summary>\n\n{body.strip()}\n\n</details>"


def _occurrence_line(o: Occurrence) -> str:
    spans = [Span(f"{'NaN' if o.kind == 'nan' else 'Inf'} in phase {o.phase.value}, ")]
    spans += [Span(c.label(o.module), o.module is not None)]
    if o.op:
        spans += [Span(" at "), Span(o.op, True)]
    if o.allowed:
        spans.append(Span(" (allowed)"))
    if o.silent:
        spans.append(Span(" (silent)"))
    return _spans(spans)


def _title(report: Report) -> str:
    if report.status == "clean":
        return "nanhunt: the step is finite"
    if report.status == "not-reproducible":
        return "nanhunt: not reproducible"
    return "nanhunt: non-finite step"


def render(report: Report) -> str:
    out: list[str] = [f"## {_title(report)}", "", f"**{_spans(c.sentence(report))}**"]
    rp = report.repro
    if rp is not None:
        mark = "**Repro verified**" if rp.verified else "**Repro not verified**"
        detail = f"a fresh process reproduced the {'NaN' if rp.result == 'nan' else 'Inf'}" if rp.verified \
            else (rp.result or "not run")
        out += ["", f"{mark}: {escape(detail)} with {code(rp.command)} (see *Reproduce*)."]
    occ = report.first
    if occ is not None:
        out += ["", "#### Where it was born", ""]
        out += [f"- **{escape(k)}:** {_spans(v)}" for k, v in c.birth_rows(occ)]
        out += ["", "#### The op's tensors against their dtype's limits", ""]
        out.append(_table(c.TENSOR_COLUMNS, c.tensor_rows(occ), right_from=3))
    if report.path:
        items = [f"{i + 1}. {_spans(c.path_label(r))}" for i, r in enumerate(report.path[:_PATH_SHOWN])]
        if len(report.path) > _PATH_SHOWN:
            items.append(f"{_PATH_SHOWN + 1}. ... and {len(report.path) - _PATH_SHOWN} more")
        out += ["", "#### Propagation path", "", _details(f"{len(report.path)} records, from the origin to the "
                                                           "loss and the gradients", "\n".join(items))]
    if report.status != "clean" or report.verdict is not None:
        out += ["", "#### Bisection by local float32", "", _spans(c.verdict_text(report))]
        v = report.verdict
        if v is not None and v.origin_alone_fixes is not None:
            out += ["", f"The origin's module alone in float32 fixes the step: {'yes' if v.origin_alone_fixes else 'no'}."]
        alts = c.alternatives(report)
        if alts:
            out += ["", "Whole step instead: " + "; ".join(f"{escape(k)}: {escape(s)}" for k, s in alts) + "."]
        if v is not None and v.fix:
            out += ["", "Suggested fix:", "", fence(v.fix, "python")]
    out += ["", "#### GradScaler", "", escape(c.scaler_text(report.config))]
    env = c.environment_rows(report)
    if env:
        out += ["", "#### Environment", "", _details("nanhunt, torch, Python, OS, device, autocast",
                                                      _table(("", ""), env))]
    out += ["", "#### Reproduce", ""]
    if report.command:
        out += ["Replay the step:", "", fence(report.command, "sh")]
    if rp is not None:
        out += ["", _spans(c.repro_text(report)), "", "Run the op alone (needs only torch; exit status 1 when the "
                "output is non-finite):", "", fence(rp.command, "sh")]
    elif not report.command:
        out.append("No command was recorded.")
    others = [o for o in report.origins if o is not occ and o != occ]
    if others:
        body = "\n".join(f"- {_occurrence_line(o)}" for o in others[:_LIST_SHOWN])
        out += ["", _details(f"Other origins ({len(others)})", body)]
    if report.status == "not-reproducible" and report.runs:
        body = "\n".join(f"- run {i + 1}: " + (_occurrence_line(o) if o is not None else "finite")
                         for i, o in enumerate(report.runs))
        out += ["", _details("The two replays", body)]
    bad = [(m, s) for m, s in report.modules.items() if s != "finite"]
    if bad:
        body = "\n".join(
            f"- {code(c.label(m))} ({escape(report.module_classes.get(m, '?'))}): {escape(s)}" for m, s in bad[:_LIST_SHOWN]
        )
        if len(bad) > _LIST_SHOWN:
            body += f"\n- ... and {len(bad) - _LIST_SHOWN} more"
        out += ["", _details(f"Modules that saw non-finite values ({len(bad)} of {len(report.modules)})", body)]
    if report.notes:
        out += ["", _details(f"Notes ({len(report.notes)})", "\n".join(f"- {escape(n)}" for n in report.notes))]
    out += ["", f"<sub>nanhunt report, schema {report.schema_version}, {report.n_records} recorded tensors</sub>"]
    return "\n".join(out) + "\n"
