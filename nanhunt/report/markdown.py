"""Markdown for a bug ticket (GitHub, GitLab): a summary that fits a screen, the rest folded in ``<details>``.

Every user string (module paths, op names, source lines, notes) is escaped: its
control characters are written as visible escapes (``\\n``, ``\\x1b``); as text,
Markdown's punctuation is backslash-escaped; as code, the span's backtick fence is
longer than any backtick run inside it; in a table, pipes are escaped too (GFM
splits cells before it reads code spans); a code block keeps its line breaks only.
As text, a mention (``@everyone``, ``@org/team``) gets a zero-width space after its ``@`` and a URL
(``https://...``, ``www.``) is put in a code span: a hostile file neither pings people nor plants a link
in the ticket (code spans and blocks are neither).
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Sequence

from .._util._errors import visible
from .._util._text import cut
from ..records import Comparison, HeadroomHistory, Occurrence, Report, Status, TensorDiff
from . import _common as c
from . import _compare_text as ct
from ._common import Span

__all__ = ["render", "escape", "code", "fence", "command"]

_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&#!])")
_PATH_SHOWN = 40
_LIST_SHOWN = 50
_RANK_SHOWN = 10  # module calls in the ranking table
_CALLS_SHOWN = 100  # module calls in the folded table of all calls


# What GitHub and GitLab turn into a ping or a link in text: an @ before a name (a user, @org/team; an e-mail
# address's too), and an autolink: scheme://... (with whatever letters run before it), www. (not inside a dotted
# name), mailto: / xmpp:. A URL ends at a space, a table pipe, a backtick or an angle bracket, and leaves its
# trailing punctuation to the sentence.
_MENTION = re.compile(r"@(?=[\w-])")
_URL = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*://|(?<![\w.])www\.|(?:mailto|xmpp):)(?P<rest>[^\s<>`|]+)")
_URL_TAIL = ".,:;!?*_~'\")]"


def escape(s: str) -> str:
    """``s`` as literal inline text: no emphasis, link, HTML, table cell break or heading, mention or URL."""
    s = visible(s)
    out: list[str] = []
    at = 0
    for m in _URL.finditer(s):
        url = _url_end(m.group())
        if len(url) <= m.start("rest") - m.start():
            continue  # a scheme alone links nowhere
        out += [_text(s[at:m.start()]), f"`{url}`"]
        at = m.start() + len(url)
    out.append(_text(s[at:]))
    return "".join(out)


def _url_end(url: str) -> str:
    """``url`` without the punctuation that ends the sentence around it; a ``)`` closing one of its own stays."""
    while url and url[-1] in _URL_TAIL and not (url[-1] == ")" and url.count("(") >= url.count(")")):
        url = url[:-1]
    return url


def _text(s: str) -> str:
    return _unmention(_SPECIAL.sub(r"\\\1", s))


def _unmention(s: str) -> str:
    return _MENTION.sub("@\u200b", s)


def code(s: str, *, table: bool = False) -> str:
    """``s`` as an inline code span, whatever backticks it holds."""
    s = visible(s)
    if not s:
        return ""
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s[0] == "`" or s[-1] == "`" or (s[0] == " " and s[-1] == " " and s.strip()) else ""
    out = f"{ticks}{pad}{s}{pad}{ticks}"
    return out.replace("|", "\\|") if table else out


def fence(text: str, lang: str = "") -> str:
    """A fenced code block whose fence no line of ``text`` can close."""
    text = visible(text, multiline=True)
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`{3,}", text)), default=0) + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def command(text: str) -> str:
    """A shell command to paste, as a code block of one line: a line break read from a file is written as
    ``\\n``, so that the block runs what its one line shows, nothing more."""
    return fence(visible(text), "sh")


def _spans(spans: list[Span], *, table: bool = False) -> str:
    """User names (cut past ``NAME_SHOWN`` characters) as code spans, the rest as text."""
    return "".join(code(cut(s.text), table=table) if s.code else escape(s.text) for s in spans)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], *, right_from: int = 0) -> str:
    align = ["---:" if i >= right_from > 0 else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _details(summary: str, body: str) -> str:
    # A blank line after <summary> and before </details>: GitHub then reads the body as Markdown.
    return f"<details>\n<summary>{html.escape(_unmention(visible(summary)))}</summary>\n\n{body.strip()}\n\n</details>"


def _occurrence_line(o: Occurrence) -> str:
    return _spans(c.occurrence_spans(o))


def _headroom(h: HeadroomHistory) -> list[str]:
    """The Guard's headroom history: the table of its series, its warnings folded."""
    out = ["", f"#### {escape(c.HEADROOM_TITLE)}", "", escape(c.headroom_intro(h))]
    if h.series:
        rows = [(code(cut(row[0]), table=True), *(escape(x) for x in row[1:])) for row in c.headroom_rows(h)]
        out += ["", _cells_table(c.HEADROOM_COLUMNS, rows, right_from=2)]
    if h.warnings:
        out += ["", _details(f"Warnings ({len(h.warnings)})", "\n".join(f"- {escape(w)}" for w in
                                                                      c.headroom_warnings(h)))]
    return out


def _title(report: Report) -> str:
    if report.status == Status.CLEAN:
        return "nanhunt: the step is finite"
    if report.status == Status.NOT_REPRODUCIBLE:
        return "nanhunt: not reproducible"
    return "nanhunt: non-finite step"


def _birth(occ: Occurrence) -> list[str]:
    """Where the first non-finite value was born, the op's tensors against their limits, the float8 casts that
    fed it."""
    out = ["", f"#### {c.BORN_TITLE}", ""]
    out += [f"- **{escape(k)}:** {_spans(v)}" for k, v in c.birth_rows(occ)]
    out += ["", f"#### {c.TENSORS_TITLE}", ""]
    out.append(_table(c.TENSOR_COLUMNS, c.tensor_rows(occ), right_from=3))
    note = c.tensor_note(occ)
    if note is not None:
        out += ["", escape(note)]
    if occ.casts:
        out += ["", f"#### {c.CASTS_TITLE}", "", _table(c.CAST_COLUMNS, c.cast_rows(occ), right_from=4)]
    return out


def render(report: Report) -> str:
    if report.comparison is not None:
        return _render_comparison(report, report.comparison)
    out: list[str] = [f"## {_title(report)}", "", f"**{_spans(c.sentence(report))}**"]
    rp = report.repro
    if rp is not None:
        mark = "**Repro verified**" if rp.verified else "**Repro not verified**"
        detail = f"a fresh process reproduced the {'NaN' if rp.result == 'nan' else 'Inf'}" if rp.verified \
            else (rp.result or "not run")
        out += ["", f"{mark}: {escape(detail)} with {code(rp.command)} (see *Reproduce*)."]
    guard = c.guard_rows(report)
    if guard:
        out += ["", f"#### {c.GUARD_TITLE}", ""] + [f"- **{escape(k)}:** {escape(v)}" for k, v in guard]
    if report.headroom is not None:
        out += _headroom(report.headroom)
    occ = report.first
    if occ is not None:
        out += _birth(occ)
    if report.path:
        items = [f"{i + 1}. {_spans(c.path_label(r))}" for i, r in enumerate(report.path[:_PATH_SHOWN])]
        if len(report.path) > _PATH_SHOWN:
            items.append(f"{_PATH_SHOWN + 1}. ... and {len(report.path) - _PATH_SHOWN} more")
        out += ["", f"#### {c.PATH_TITLE}", "", _details(f"{len(report.path)} records, from the origin to the "
                                                           "loss and the gradients", "\n".join(items))]
    if report.status != Status.CLEAN or report.verdict is not None:
        out += ["", f"#### {c.bisection_title(report)}", "", _spans(c.verdict_text(report))]
        v = report.verdict
        alone = None if v is None else c.origin_alone(v)
        if alone is not None:
            out += ["", f"{alone[0]}: {alone[1]}."]
        alts = c.alternatives(report)
        if alts:
            out += ["", "Whole step instead: " + "; ".join(f"{escape(k)}: {escape(s)}" for k, s in alts) + "."]
        if v is not None and v.fix:
            out += ["", "Suggested fix:", "", fence(v.fix, "python")]
    if report.advice:
        out += ["", f"#### {c.ADVICE_TITLE}", "", escape(c.ADVICE_INTRO[0].upper() + c.ADVICE_INTRO[1:]) + "."]
        for a in report.advice:
            out += ["", f"- **{escape(a.advice)}**", "", f"  because: {escape(a.because)}", "",
                    "\n".join("  " + line for line in fence(a.fix, "python").splitlines())]
    out += ["", f"#### {c.SCALER_TITLE}", "", escape(c.scaler_text(report.config))]
    env = c.environment_rows(report)
    if env:
        out += ["", f"#### {c.ENVIRONMENT_TITLE}", "", _details("nanhunt, torch, Python, OS, device, autocast",
                                                      _table(("", ""), env))]
    out += ["", f"#### {c.REPRODUCE_TITLE}", ""]
    if report.command:
        out += ["Replay the step:", "", command(report.command)]
    if rp is not None:
        out += ["", _spans(c.repro_text(report)), "", "Run the op alone (needs only torch; exit status 1 when the "
                "output is non-finite):", "", command(rp.command)]
    elif not report.command:
        out.append("No command was recorded.")
    others = [o for o in report.origins if o is not occ and o != occ]
    if others:
        body = "\n".join(f"- {_occurrence_line(o)}" for o in others[:_LIST_SHOWN])
        out += ["", _details(f"Other origins ({len(others)})", body)]
    if report.status == Status.NOT_REPRODUCIBLE and report.runs:
        body = "\n".join(f"- run {i + 1}: " + (_occurrence_line(o) if o is not None else "finite")
                         for i, o in enumerate(report.runs))
        out += ["", _details("The two replays", body)]
    bad = [(m, s) for m, s in report.modules.items() if s != "finite"]
    if bad:
        body = "\n".join(
            f"- {code(cut(c.label(m)))} ({escape(cut(report.module_classes.get(m, '?')))}): {escape(s)}"
            for m, s in bad[:_LIST_SHOWN]
        )
        if len(bad) > _LIST_SHOWN:
            body += f"\n- ... and {len(bad) - _LIST_SHOWN} more"
        out += ["", _details(f"Modules that saw non-finite values ({len(bad)} of {len(report.modules)})", body)]
    if report.notes:
        out += ["", _details(f"Notes ({len(report.notes)})", "\n".join(f"- {escape(n)}" for n in report.notes))]
    out += ["", f"<sub>nanhunt report, schema {report.schema_version}, {report.n_records} recorded tensors</sub>"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ nanhunt compare


def _cells_table(header: tuple[str, ...], rows: Sequence[Sequence[str]], *, right_from: int = 0) -> str:
    """A table whose cells the caller already set (``escape`` or ``code(..., table=True)``); the header is escaped."""
    align = ["---:" if i >= right_from > 0 else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _call(d: TensorDiff) -> str:
    """A module call in a table cell: its label as code, its class as text."""
    return code(d.label(), table=True) + escape(ct.module_class_text(d))


def _ranking_table(cmp: Comparison) -> str:
    rows = [(str(rank), _call(cmp.modules[i]), *(escape(x) for x in ct.ranking_cells(cmp.modules[i])))
            for rank, i in enumerate(cmp.ranking[:_RANK_SHOWN], 1)]
    return _cells_table(ct.RANKING_COLUMNS, rows, right_from=2)


def _calls_table(cmp: Comparison) -> str:
    header = ("call", "depth", *ct.RANKING_COLUMNS[2:])
    rank_of = {i: r for r, i in enumerate(cmp.ranking, 1)}
    rows = []
    for i, d in enumerate(cmp.modules[:_CALLS_SHOWN]):
        r = rank_of.get(i)
        rows.append((_call(d) + (f" (rank {r})" if r is not None else ""), str(d.depth),
                     *(escape(x) for x in ct.ranking_cells(d))))
    table = _cells_table(header, rows, right_from=1)
    if len(cmp.modules) > _CALLS_SHOWN:
        table += f"\n\n... and {len(cmp.modules) - _CALLS_SHOWN} more"
    return table


def _diff_table(named: Sequence[tuple[str, TensorDiff]], *, names_are_code: bool = False) -> str:
    rows = [((code(name, table=True) if names_are_code else escape(name)), *(escape(x) for x in ct.diff_cells(d)))
            for name, d in named]
    return _cells_table(ct.DIFF_COLUMNS, rows, right_from=3)


def _candidate(cmp: Comparison) -> list[str]:
    """One autocast dtype: the runs, the batches of a set, the quality, where the error is introduced, the
    decisions, the output and the loss; the rest folded."""
    out = ["", f"#### {ct.RUNS_TITLE}", ""]
    out += [f"- **{escape(k)}:** {escape(v)}" for k, v in ct.run_rows(cmp)]
    if not cmp.reference_finite and not cmp.modules:
        out += ["", escape(ct.NOTHING_COMPARED.capitalize()) + "."]
    if cmp.batches:
        rows = [tuple(escape(x) for x in ct.batch_cells(b)) for b in cmp.batches]
        out += ["", f"#### {ct.BATCHES_TITLE}", "", _cells_table(ct.batch_columns(cmp), rows)]
    q = ct.quality_text(cmp)
    if q is not None:
        out += ["", f"#### {ct.QUALITY_TITLE}", "", f"**{escape(q[0].upper() + q[1:])}.**"]
    if cmp.modules:
        out += ["", f"#### {ct.INTRODUCED_TITLE}", "", f"Columns: {escape(ct.error_definition(cmp))}.", ""]
        if cmp.ranking:
            out.append(_ranking_table(cmp))
            if len(cmp.ranking) > _RANK_SHOWN:
                out += ["", f"... and {len(cmp.ranking) - _RANK_SHOWN} more module calls introduce some error"]
        else:
            out.append(escape(ct.NO_RANKING.capitalize()) + ".")
        d = ct.carrier(cmp)
        if d is not None:
            spans = ct.carrier_text(d)
            out += ["", _spans([Span(spans[0].text.capitalize()), *spans[1:]]) + "."]
        out += ["", _details(f"All {len(cmp.modules)} module calls, in the order they started", _calls_table(cmp))]
    if cmp.task == "classify" and (cmp.reference_finite or cmp.modules):
        out += ["", f"#### {ct.DECISIONS_TITLE}", "", f"**{escape(ct.decisions_counts(cmp))}.**"]
        if cmp.nonfinite:
            cats = ct.decision_categories(cmp)
            out += ["", escape(cats[0].upper() + cats[1:]) + "."]
        if cmp.decisions:
            rows = [tuple(escape(x) for x in cells) for _, cells in ct.decision_rows(cmp)]
            out += ["", _cells_table(ct.decision_columns(cmp), rows)]
    named = [(n, d) for n, d in (("model output", cmp.output), ("loss", cmp.loss)) if d is not None]
    if named or cmp.regression is not None:
        out += ["", f"#### {ct.OUTPUT_TITLE}", ""]
        if named:
            out.append(_diff_table(named))
        g = cmp.regression
        if g is not None:
            out += ["", escape(ct.extremes_text(cmp, g).capitalize()) + "."]
            if g.worst:
                out += ["", escape(ct.worst_text(cmp, g).capitalize()) + "."]
    if cmp.grads:
        grads = ct.ordered_grads(cmp)
        body = _diff_table([(d.name, d) for d in grads[:_LIST_SHOWN]], names_are_code=True)
        if len(grads) > _LIST_SHOWN:
            body += f"\n\n... and {len(grads) - _LIST_SHOWN} more"
        head = ct.gradients_head(cmp)
        out += ["", _details(f"{head[0].upper()}{head[1:]}, largest error first", body)]
    if cmp.unmatched:
        body = "\n".join(f"- {escape(u)}" for u in cmp.unmatched[:_LIST_SHOWN])
        out += ["", _details(f"Not compared: in one run only ({len(cmp.unmatched)})", body)]
    return out


def _render_comparison(report: Report, cmp: Comparison) -> str:
    """``nanhunt compare``: the status and the rule (its hash, the failed clauses), the candidates, each one's
    details, the speed; configuration and reproduction last."""
    out: list[str] = [f"## {ct.compare_title(cmp)}", "", f"**{escape(ct.compare_summary(report))}**", "",
                      f"**{escape(ct.RULE_LABEL.capitalize())}:** {escape(cmp.rule_text())}."]
    if cmp.rule_sha256:
        canonical = f" of {code(cmp.acceptance.canonical())}" if cmp.acceptance is not None else ""
        out += ["", f"**{escape(ct.RULE_HASH_LABEL.capitalize())}:** {code(cmp.rule_sha256)}{canonical}"]
    warnings = ct.rule_warning_lines(cmp)
    if warnings:
        out += [""] + [f"**Warning:** {escape(w)}." for w in warnings]
    violations = ct.violation_lines(cmp)
    if violations:
        out += ["", "Violations:", ""] + [f"- {escape(v)}" for v in violations]
    allowed = ct.allowed_lines(cmp)
    if allowed:
        out += ["", "Allowed by the rule:", ""] + [f"- {escape(a)}" for a in allowed]
    absorbed = ct.absorbed_lines(cmp)
    if absorbed:
        out += ["", f"{escape(ct.ABSORBED_HEAD.capitalize())}:", ""] + [f"- {escape(a)}" for a in absorbed]
    if cmp.alternatives:
        rows = [tuple(escape(x) for x in ct.candidate_cells(x)) for x in cmp.candidates()]
        out += ["", f"#### {ct.CANDIDATES_TITLE}", "",
                _cells_table(ct.CANDIDATE_COLUMNS, rows, right_from=4)]
    for x in cmp.candidates():
        if cmp.alternatives:
            out += ["", f"### {escape(ct.candidate_head(x))}"]
        out += _candidate(x)
    rows, untimed = ct.speed_rows(cmp)
    if rows or untimed:
        out += ["", f"#### {ct.SPEED_TITLE}", "",
                "The plain step with no nanhunt hook, float32 and autocast interleaved; ratio = autocast time / "
                "float32 time per repetition (below 1: autocast is faster)."]
        if rows:
            out += ["", _cells_table(ct.SPEED_COLUMNS, [tuple(escape(v) for v in r) for r in rows], right_from=2)]
            out += [f"\n{escape(m[0].upper() + m[1:])}." for m in ct.speed_memory_lines(cmp)]
        out += ["", *(f"- {escape(u[0].upper() + u[1:])}." for u in untimed)] if untimed else []
    cfg = [(k, str(v)) for k, v in report.config.items() if v is not None]
    env = c.environment_rows(dataclasses.replace(report, config={}))
    if cfg or env:
        out += ["", f"#### {ct.CONFIG_TITLE}", "",
                _details("Configuration, nanhunt, torch, Python, OS, device", _table(("", ""), cfg + env))]
    out += ["", f"#### {c.REPRODUCE_TITLE}", ""]
    if report.command:
        out += ["Compare again:", "", command(report.command)]
    else:
        out.append("No command was recorded.")
    if report.notes:
        out += ["", _details(f"Notes ({len(report.notes)})", "\n".join(f"- {escape(n)}" for n in report.notes))]
    out += ["", f"<sub>nanhunt compare report, schema {report.schema_version}, {len(cmp.modules)} module calls "
                f"compared</sub>"]
    return "\n".join(out) + "\n"
