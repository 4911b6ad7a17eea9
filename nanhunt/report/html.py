"""One self-contained HTML file: inline CSS, the picture inlined as a PNG data URI, no network.

Every string that came from the user's program goes through ``html.escape``, its control characters
written as visible escapes (``\\n``, ``\\x1b``; a ``<pre>`` block keeps its line breaks); the page
carries a Content-Security-Policy that forbids loading anything, so even a mistake here
cannot make a browser fetch from outside.
"""

from __future__ import annotations

import base64
import dataclasses
import html as _html

from .._util._errors import visible
from .._util._text import cut
from ..records import Comparison, HeadroomHistory, Occurrence, Report, Status, TensorDiff, VerdictKind
from . import _common as c
from . import _compare_text as ct
from ._common import Span

__all__ = ["render"]

_PATH_SHOWN = 60
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_CSS = """
:root { --bad: #c62828; --warn: #b26a00; --ok: #2e7d32; --ink: #1d1d1f; --dim: #666; --line: #ddd; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
       max-width: 1140px; margin: 0 auto; padding: 24px 28px 48px; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
code, pre { font: 13px/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
code { background: #f3f3f5; padding: 1px 4px; border-radius: 3px; overflow-wrap: anywhere; }
pre { background: #f6f8fa; border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; overflow-x: auto; }
pre code { background: none; padding: 0; }
.sentence { font-size: 17px; font-weight: 600; margin: 10px 0; }
.badge { display: inline-block; font-size: 12px; font-weight: 700; padding: 2px 8px; border-radius: 10px;
         color: #fff; margin-right: 6px; vertical-align: middle; }
.badge.b-bad { background: var(--bad); } .badge.b-ok { background: var(--ok); } .badge.b-warn { background: var(--warn); }
table { border-collapse: collapse; margin: 6px 0; font-size: 13.5px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #fafafa; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.kv th { background: none; color: var(--dim); font-weight: 500; white-space: nowrap; }
tr.out td { font-weight: 600; }
.bad { color: var(--bad); } .warn { color: var(--warn); } .ok { color: var(--ok); } .dim { color: var(--dim); }
figure { margin: 8px 0; } figure img { max-width: 100%; height: auto; border: 1px solid var(--line); }
figcaption { color: var(--dim); font-size: 13px; }
ol.path li, ul li { margin: 2px 0; }
ul.tree, ul.tree ul { list-style: none; padding-left: 18px; margin: 0; }
ul.tree { padding-left: 0; font-size: 13.5px; }
ul.tree li::before { content: "\\2514\\2500 "; color: #bbb; }
details { margin: 8px 0; } summary { cursor: pointer; font-weight: 600; }
footer { margin-top: 36px; color: var(--dim); font-size: 12px; }
"""


def _e(s: object) -> str:
    return _html.escape(visible(str(s)), quote=True)


def _pre(s: str) -> str:
    """A code block's text: line breaks kept."""
    return _html.escape(visible(s, multiline=True), quote=True)


def _command(s: str) -> str:
    """A shell command to paste, in a code block of one line (a line break read from a file as ``\\n``)."""
    return f"<pre><code>{_e(s)}</code></pre>"


def _spans(spans: list[Span]) -> str:
    """User names (cut past ``NAME_SHOWN`` characters) as code, the rest as text."""
    return "".join(f"<code>{_e(cut(s.text))}</code>" if s.code else _e(s.text) for s in spans)


def _kv(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _tensor_table(occ: Occurrence) -> str:
    head = "".join(f'<th class="{"num" if i >= 3 else ""}">{_e(h)}</th>' for i, h in enumerate(c.TENSOR_COLUMNS))
    rows = []
    for row, level in zip(c.tensor_rows(occ), c.tensor_levels(occ)):
        cells = []
        for i, cell in enumerate(row):
            cls = "num" if i >= 3 else ""
            if c.TENSOR_COLUMNS[i] == "headroom" and level:
                cls += " bad" if level == "over" else " warn"
            if c.TENSOR_COLUMNS[i] in ("min", "max", "max |x|") and cell in ("nan", "inf", "-inf"):
                cls += " bad"
            cells.append(f'<td class="{cls.strip()}">{_e(cell)}</td>')
        rows.append(f'<tr class="{"out" if row[0] == "output" else ""}">{"".join(cells)}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _status_class(status: str) -> str:
    if status == "finite":
        return "ok"
    return "bad" if status.startswith("nan") else "warn"


def _tree(report: Report) -> str:
    names = sorted(report.modules, key=lambda n: (n.count(".") + (n != ""), n))
    children: dict[str | None, list[str]] = {}
    for n in names:
        parent: str | None = None
        if n != "":
            p = n
            while True:  # the nearest recorded ancestor ("" is the root module)
                p = p.rpartition(".")[0] if "." in p else ""
                if p in report.modules:
                    parent = p
                    break
                if p == "":
                    break
        children.setdefault(parent, []).append(n)

    def item(n: str) -> str:
        st = report.modules[n]
        cls = cut(report.module_classes.get(n, ""))
        kids = children.get(n, [])
        sub = f"<ul>{''.join(item(k) for k in kids)}</ul>" if kids else ""
        return (f'<li><code>{_e(cut(c.label(n)))}</code> <span class="dim">{_e(cls)}</span> '
                f'<span class="{_status_class(st)}">{_e(st)}</span>{sub}</li>')

    return f'<ul class="tree">{"".join(item(n) for n in children.get(None, []))}</ul>'


def _close(parts: list[str], report: Report, footer: str) -> str:
    """The notes, the footer and the end of the page."""
    if report.notes:
        items = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
        parts.append(f"<details open><summary>Notes ({len(report.notes)})</summary><ul>{items}</ul></details>")
    parts.append(f"<footer>{_e(footer)}</footer></body></html>")
    return "\n".join(parts) + "\n"


def _occurrence(o: Occurrence) -> str:
    return _spans(c.occurrence_spans(o))


def _badges(report: Report) -> str:
    if report.status == Status.CLEAN:
        out = '<span class="badge b-ok">finite</span>'
    elif report.status == Status.NOT_REPRODUCIBLE:
        out = '<span class="badge b-warn">not reproducible</span>'
    else:
        out = '<span class="badge b-bad">non-finite</span>'
    rp = report.repro
    if rp is not None:
        out += ('<span class="badge b-ok">repro verified</span>' if rp.verified
                else '<span class="badge b-warn">repro not verified</span>')
    v = report.verdict
    if v is not None and v.kind != VerdictKind.CLEAN:
        out += f'<span class="badge {"b-ok" if v.confirmed else "b-warn"}">{_e(v.kind)}{" · confirmed" if v.confirmed else ""}</span>'
    return out


def render(report: Report, *, png: bytes | None = None, draw: bool = True) -> str:
    """The page. ``png`` is the picture (drawn here with :mod:`nanhunt.report.picture` when
    ``None`` and ``draw``); pass the bytes you also write beside the page to draw it once.
    A comparison report (``nanhunt compare``) gets its own page, with the picture of error by module."""
    if report.comparison is not None:
        return _render_comparison(report, report.comparison, png=png, draw=draw)
    if png is None and draw and report.timeline:
        from .picture import png as draw_png

        png = draw_png(report)
    parts = _page_head(report)
    guard = c.guard_rows(report)
    if guard:
        parts += [f"<section><h2>{c.GUARD_TITLE}</h2>", _kv([(k, _e(v)) for k, v in guard]), "</section>"]
    if report.headroom is not None:
        parts += _headroom(report.headroom)
    occ = report.first
    if occ is not None:
        parts += _birth_sections(occ)
    if png:
        parts += _step_picture(png)
    if report.path:
        items = "".join(f"<li>{_spans(c.path_label(r))}</li>" for r in report.path[:_PATH_SHOWN])
        if len(report.path) > _PATH_SHOWN:
            items += f"<li>... and {len(report.path) - _PATH_SHOWN} more</li>"
        parts += [f"<section><h2>{c.PATH_TITLE}</h2>", f'<ol class="path">{items}</ol></section>']
    if report.status != Status.CLEAN or report.verdict is not None:
        parts += _bisection(report)
    parts += _advice(report)
    parts += [f"<section><h2>{c.SCALER_TITLE}</h2>", f"<p>{_e(c.scaler_text(report.config))}</p></section>"]
    env = c.environment_rows(report)
    if env:
        parts += [f"<section><h2>{c.ENVIRONMENT_TITLE}</h2>", _kv([(k, _e(val)) for k, val in env]), "</section>"]
    parts += _reproduce(report)
    if report.modules:
        parts += ["<section><h2>Modules</h2>", _tree(report), "</section>"]
    parts += _other_origins(report, occ)
    return _close(parts, report, f"nanhunt report, schema {report.schema_version}, {report.n_records} recorded tensors.")


def _page_head(report: Report) -> list[str]:
    """The document head and the page header: badges and the one-sentence summary."""
    title = "".join(cut(s.text) if s.code else s.text for s in c.sentence(report))
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>nanhunt: {_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<header><h1>nanhunt report</h1>{_badges(report)}",
        f'<p class="sentence">{_spans(c.sentence(report))}</p></header>',
    ]


def _birth_sections(occ: Occurrence) -> list[str]:
    """Where the first non-finite value was born, and the op's tensors against their dtype's limits."""
    rows = [(k, _spans(v)) for k, v in c.birth_rows(occ)]
    note = c.tensor_note(occ)
    return [f"<section><h2>{c.BORN_TITLE}</h2>", _kv(rows), "</section>",
            f"<section><h2>{c.TENSORS_TITLE}</h2>", _tensor_table(occ),
            '<p class="dim">headroom: how many times larger the largest value could grow before its dtype '
            "overflows (65504 for float16)." + ("" if note is None else f" {_e(note)}") + "</p></section>",
            *_casts_section(occ)]


def _casts_section(occ: Occurrence) -> list[str]:
    """The float8 casts that fed the op and lost values (none: no section)."""
    if not occ.casts:
        return []
    head = "".join(f'<th class="{"num" if i >= 4 else ""}">{_e(h)}</th>' for i, h in enumerate(c.CAST_COLUMNS))
    body = "".join("<tr>" + "".join(f'<td class="{"num" if i >= 4 else ""}">{_e(cell)}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in c.cast_rows(occ))
    return [f"<section><h2>{_e(c.CASTS_TITLE)}</h2>",
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section>"]


def _headroom(h: HeadroomHistory) -> list[str]:
    """The Guard's headroom history: its chart (inline SVG), the table of its series, its warnings."""
    from ._headroom_svg import chart

    parts = [f"<section><h2>{_e(c.HEADROOM_TITLE)}</h2>", f"<p>{_e(c.headroom_intro(h))}</p>"]
    if h.series:
        rows = "".join(f"<tr><td><code>{_e(cut(row[0]))}</code></td><td>{_e(row[1])}</td>"
                       f"{''.join(_num_cell(x) for x in row[2:])}</tr>" for row in c.headroom_rows(h))
        parts += [f"<figure>{chart(h)}<figcaption>{_e(c.HEADROOM_CAPTION)}</figcaption></figure>",
                  f"<table><thead><tr>{_head_row(c.HEADROOM_COLUMNS, (0, 1))}</tr></thead><tbody>{rows}</tbody>"
                  "</table>"]
    if h.warnings:
        items = "".join(f"<li>{_e(w)}</li>" for w in c.headroom_warnings(h))
        parts.append(f"<details><summary>Warnings ({len(h.warnings)})</summary><ul>{items}</ul></details>")
    parts.append("</section>")
    return parts


def _step_picture(png: bytes) -> list[str]:
    """The step at a glance: the picture inlined as a data URI, with its caption."""
    alt = "log10 of the largest magnitude of every recorded tensor along the step"
    return ["<section><h2>The step at a glance</h2><figure>",
            f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">',
            "<figcaption>x: every recorded tensor in execution order (forward, loss, backward, update); "
            "y: log10 of its largest finite |x|. Dashed lines: float16 and bfloat16 maxima. Crosses and "
            "triangles at the top: NaN and Inf tensors. The star and the red line: the origin."
            "</figcaption></figure></section>"]


def _bisection(report: Report) -> list[str]:
    """The bisection by local float32: the verdict, the alternatives tried and the suggested fix."""
    v = report.verdict
    parts = [f"<section><h2>{c.bisection_title(report)}</h2>", f"<p>{_spans(c.verdict_text(report))}</p>"]
    alone = None if v is None else c.origin_alone(v)
    if alone is not None:
        parts.append(f"<p>{_e(alone[0])}: <b>{alone[1]}</b>.</p>")
    alts = c.alternatives(report)
    if alts:
        parts.append(_kv([(f"whole step, {k}", f'<span class="{"ok" if s == "finite" else "bad"}">{_e(s)}</span>')
                          for k, s in alts]))
    if v is not None and v.fix:
        parts.append(f"<p>Suggested fix:</p><pre><code>{_pre(v.fix)}</code></pre>")
    parts.append("</section>")
    return parts


def _advice(report: Report) -> list[str]:
    """Each fix beyond float32: the advice, the measurement that triggered it, the code."""
    if not report.advice:
        return []
    items = "".join(f"<li><p><b>{_e(a.advice)}</b></p><p class=\"dim\">because: {_e(a.because)}</p>"
                    f"<pre><code>{_pre(a.fix)}</code></pre></li>" for a in report.advice)
    return [f"<section><h2>{_e(c.ADVICE_TITLE)}</h2>", f"<p>{_e(c.ADVICE_INTRO[0].upper() + c.ADVICE_INTRO[1:])}.</p>",
            f"<ul>{items}</ul></section>"]


def _reproduce(report: Report) -> list[str]:
    """How to replay the step, and the op alone when a repro was written."""
    parts = [f"<section><h2>{c.REPRODUCE_TITLE}</h2>"]
    if report.command:
        parts.append(f"<p>Replay the step:</p>{_command(report.command)}")
    rp = report.repro
    if rp is not None:
        parts += [f"<p>{_spans(c.repro_text(report))}</p>",
                  "<p>Run the op alone (needs only torch; exit status 1 when the output is non-finite):</p>",
                  _command(rp.command)]
    elif not report.command:
        parts.append("<p>No command was recorded.</p>")
    parts.append("</section>")
    return parts


def _other_origins(report: Report, occ: Occurrence | None) -> list[str]:
    """The other origins, and the two replays of a step that did not reproduce."""
    parts = []
    others = [o for o in report.origins if o is not occ and o != occ]
    if others:
        items = "".join(f"<li>{_occurrence(o)}</li>" for o in others)
        parts.append(f"<details><summary>Other origins ({len(others)})</summary><ul>{items}</ul></details>")
    if report.status == Status.NOT_REPRODUCIBLE and report.runs:
        items = "".join(f"<li>run {i + 1}: {_occurrence(o) if o is not None else 'finite'}</li>"
                        for i, o in enumerate(report.runs))
        parts.append(f"<details open><summary>The two replays</summary><ul>{items}</ul></details>")
    return parts


# ------------------------------------------------------------------ nanhunt compare

_RANK_SHOWN = 20  # module calls in the ranking table
_CALLS_SHOWN = 200  # module calls in the folded table of all calls
_LIST_SHOWN = 100
_CMP_CSS = """
.rule { background: #f6f8fa; border-left: 4px solid #888; padding: 8px 12px; margin: 10px 0; }
ul.violations li { color: var(--bad); }
tr.flip td, tr.nonfinite td { color: var(--bad); font-weight: 600; } tr.near td { color: var(--warn); }
tr.first td { font-weight: 600; }
"""


def _num_cell(text: str, cls: str = "") -> str:
    return f'<td class="{("num " + cls).strip()}">{_e(text)}</td>'


def _headroom_class(d: TensorDiff) -> str:
    if d.headroom is None:
        return "bad"
    return "warn" if d.headroom < 16 else ""


def _call_cell(d: TensorDiff, extra: str = "", indent: int = 0) -> str:
    cls = f' <span class="dim">{_e(d.module_class)}</span>' if d.module_class else ""
    style = f' style="padding-left: {10 + 14 * indent}px"' if indent else ""
    return f"<td{style}><code>{_e(d.label())}</code>{cls}{extra}</td>"


def _error_cells(cmp: Comparison, d: TensorDiff) -> str:
    """The cells of ``ct.ranking_cells``, coloured: an introduced error above rtol, an overflowed headroom."""
    cells = ct.ranking_cells(d)
    intro = d.introduced if d.introduced is not None else 0.0
    over = not intro <= cmp.rtol  # also NaN and Inf
    classes = ["bad" if over else "", "", "", "", "", "warn" if d.out_of_tol > 0 else "", _headroom_class(d), ""]
    return "".join(_num_cell(x, k) for x, k in zip(cells, classes))


def _head_row(header: tuple[str, ...], text_columns: tuple[int, ...]) -> str:
    return "".join(f'<th class="{"" if i in text_columns else "num"}">{_e(h)}</th>' for i, h in enumerate(header))


def _ranking_table(cmp: Comparison) -> str:
    rows = []
    for rank, i in enumerate(cmp.ranking[:_RANK_SHOWN], 1):
        d = cmp.modules[i]
        rows.append(f'<tr class="{"first" if rank == 1 else ""}">{_num_cell(str(rank))}{_call_cell(d)}'
                    f"{_error_cells(cmp, d)}</tr>")
    head = _head_row(ct.RANKING_COLUMNS, (1,))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _calls_table(cmp: Comparison) -> str:
    rank_of = {i: r for r, i in enumerate(cmp.ranking, 1)}
    rows = []
    for i, d in enumerate(cmp.modules[:_CALLS_SHOWN]):
        r = rank_of.get(i)
        extra = f' <span class="dim">(rank {r})</span>' if r is not None else ""
        rows.append(f"<tr>{_call_cell(d, extra, min(d.depth, 12))}{_num_cell(str(d.depth))}"
                    f"{_error_cells(cmp, d)}</tr>")
    more = (f'<p class="dim">... and {len(cmp.modules) - _CALLS_SHOWN} more</p>'
            if len(cmp.modules) > _CALLS_SHOWN else "")
    head = _head_row(("call", "depth", *ct.RANKING_COLUMNS[2:]), (0,))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"


def _diff_table(named: list[tuple[str, TensorDiff]], *, names_are_code: bool = False) -> str:
    rows = []
    for name, d in named:
        cells = ct.diff_cells(d)
        first = f"<td><code>{_e(name)}</code></td>" if names_are_code else f"<td>{_e(name)}</td>"
        classes = ["", "", "", "", "", "warn" if d.out_of_tol > 0 else "", _headroom_class(d), ""]
        body = "".join(f"<td>{_e(x)}</td>" if i < 2 else _num_cell(x, classes[i]) for i, x in enumerate(cells))
        rows.append(f"<tr>{first}{body}</tr>")
    return f"<table><thead><tr>{_head_row(ct.DIFF_COLUMNS, (0, 1, 2))}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _decisions_table(cmp: Comparison) -> str:
    rows = []
    for kind, cells in ct.decision_rows(cmp):
        body = "".join(f"<td>{_e(x)}</td>" if i in (0, 5) else _num_cell(x) for i, x in enumerate(cells))
        rows.append(f'<tr class="{kind}">{body}</tr>')
    head = _head_row(ct.decision_columns(cmp), (0, 5))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _compare_badges(cmp: Comparison) -> str:
    verdict = ct.compare_verdict(cmp)
    out = f'<span class="badge {"b-ok" if cmp.accepted else "b-bad"}">{_e(verdict.lower())}</span>'
    if cmp.amp_finite is False:
        out += f'<span class="badge b-bad">{_e(cmp.dtype)} non-finite</span>'
    if cmp.flipped:
        out += f'<span class="badge b-bad">{len(cmp.flipped)} flipped</span>'
    if cmp.nonfinite:
        out += f'<span class="badge b-bad">{len(cmp.nonfinite)} non-finite samples</span>'
    if cmp.near_boundary:
        out += f'<span class="badge b-warn">{len(cmp.near_boundary)} near the boundary</span>'
    return out


def _plain_table(header: tuple[str, ...], rows: list[tuple[str, ...]], *, text_columns: tuple[int, ...],
                 row_class: list[str] | None = None) -> str:
    body = []
    for k, row in enumerate(rows):
        cls = f' class="{row_class[k]}"' if row_class and row_class[k] else ""
        cells = "".join(f"<td>{_e(x)}</td>" if i in text_columns else _num_cell(x) for i, x in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{_head_row(header, text_columns)}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _candidate(cmp: Comparison, *, png: bytes | None) -> list[str]:
    """One autocast dtype: the runs, the batches of a set, the quality, the picture (the first candidate's),
    where the error is introduced, the decisions, the output and the loss, the gradients."""
    parts: list[str] = []
    runs = []
    for k, v in ct.run_rows(cmp):
        state = "ok" if v.startswith("finite") else ("dim" if v == "not run" else "bad")
        runs.append((k, f'<span class="{state}">{_e(v)}</span>'))
    parts += [f"<section><h2>{ct.RUNS_TITLE}</h2>", _kv(runs)]
    if not cmp.reference_finite and not cmp.modules:
        parts.append(f'<p class="bad">{_e(ct.NOTHING_COMPARED.capitalize())}.</p>')
    parts.append("</section>")
    if cmp.batches:
        rows = [ct.batch_cells(b) for b in cmp.batches]
        parts += [f"<section><h2>{ct.BATCHES_TITLE}</h2>",
                  _plain_table(ct.batch_columns(cmp), rows, text_columns=(0, 2, 3, 4, 7, 8),
                               row_class=["" if b.accepted else "flip" for b in cmp.batches]), "</section>"]
    q = ct.quality_text(cmp)
    if q is not None:
        worse = cmp.quality is not None and cmp.quality.drop() > 0
        parts.append(f'<section><h2>{ct.QUALITY_TITLE}</h2><p class="{"bad" if worse else ""}">'
                     f"<b>{_e(q[0].upper() + q[1:])}.</b></p></section>")
    if png:
        alt = "error by module call: the error each call introduces (bars) and the error of its output (dots)"
        parts += ["<section><h2>Error by module</h2><figure>",
                  f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">',
                  "<figcaption>One row per module call, in the order the calls started. Bars: the error the call "
                  "introduces (red above the relative tolerance); dots: the error of its output; both as a fraction "
                  f"of {_e(ct.error_scale(cmp))}, on a log scale. Dashed line: rtol. Infinite errors sit "
                  "in a column of their own at the right.</figcaption></figure></section>"]
    if cmp.modules:
        parts += [f"<section><h2>{ct.INTRODUCED_TITLE}</h2>",
                  f'<p class="dim">{_e(ct.error_definition(cmp))}.</p>']
        if cmp.ranking:
            parts.append(_ranking_table(cmp))
            if len(cmp.ranking) > _RANK_SHOWN:
                parts.append(f"<p>... and {len(cmp.ranking) - _RANK_SHOWN} more module calls introduce some error</p>")
        else:
            parts.append(f"<p>{_e(ct.NO_RANKING.capitalize())}.</p>")
        d = ct.carrier(cmp)
        if d is not None:
            spans = ct.carrier_text(d)
            parts.append(f"<p>{_spans([Span(spans[0].text.capitalize()), *spans[1:]])}.</p>")
        parts.append(f"<details><summary>All {len(cmp.modules)} module calls, in the order they started</summary>"
                     f"{_calls_table(cmp)}</details></section>")
    if cmp.task == "classify" and (cmp.reference_finite or cmp.modules):
        parts += [f"<section><h2>{ct.DECISIONS_TITLE}</h2>",
                  f'<p class="{"bad" if cmp.flipped or cmp.nonfinite else ""}"><b>{_e(ct.decisions_counts(cmp))}.</b></p>']
        if cmp.nonfinite:
            cats = ct.decision_categories(cmp)
            parts.append(f"<p>{_e(cats[0].upper() + cats[1:])}.</p>")
        if cmp.decisions:
            parts.append(_decisions_table(cmp))
        parts.append("</section>")
    named = [(n, d) for n, d in (("model output", cmp.output), ("loss", cmp.loss)) if d is not None]
    g = cmp.regression
    if named or g is not None:
        parts.append(f"<section><h2>{ct.OUTPUT_TITLE}</h2>")
        if named:
            parts.append(_diff_table(named))
        if g is not None:
            parts.append(f"<p>{_e(ct.extremes_text(cmp, g).capitalize())}.</p>")
            if g.worst:
                parts.append(f"<p>{_e(ct.worst_text(cmp, g).capitalize())}.</p>")
        parts.append("</section>")
    if cmp.grads:
        grads = ct.ordered_grads(cmp)
        head = ct.gradients_head(cmp)
        more = f'<p class="dim">... and {len(grads) - _LIST_SHOWN} more</p>' if len(grads) > _LIST_SHOWN else ""
        parts.append(f"<details><summary>{_e(head[0].upper() + head[1:])}, largest error first</summary>"
                     f"{_diff_table([(x.name, x) for x in grads[:_LIST_SHOWN]], names_are_code=True)}{more}</details>")
    if cmp.unmatched:
        items = "".join(f"<li>{_e(u)}</li>" for u in cmp.unmatched[:_LIST_SHOWN])
        parts.append(f"<details><summary>Not compared: in one run only ({len(cmp.unmatched)})</summary>"
                     f"<ul>{items}</ul></details>")
    return parts


def _render_comparison(report: Report, cmp: Comparison, *, png: bytes | None, draw: bool) -> str:
    if png is None and draw and cmp.modules:
        from .picture import png as draw_png

        png = draw_png(report)
    summary = ct.compare_summary(report)
    ok = all(x.accepted for x in cmp.candidates())
    parts: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>nanhunt compare: {_e(summary)}</title>",
        f"<style>{_CSS}{_CMP_CSS}</style></head><body>",
        f"<header><h1>nanhunt compare</h1>{_compare_badges(cmp)}",
        f'<p class="sentence {"ok" if ok else "bad"}">{_e(summary)}</p>',
        f'<p class="rule"><b>{_e(ct.RULE_LABEL.capitalize())}:</b> {_e(cmp.rule_text())}.</p>',
    ]
    if cmp.rule_sha256:
        canonical = f" of <code>{_e(cmp.acceptance.canonical())}</code>" if cmp.acceptance is not None else ""
        parts.append(f'<p class="dim"><b>{_e(ct.RULE_HASH_LABEL.capitalize())}:</b> <code>{_e(cmp.rule_sha256)}'
                     f"</code>{canonical}</p>")
    parts += [f'<p class="warn"><b>Warning:</b> {_e(w)}.</p>' for w in ct.rule_warning_lines(cmp)]
    violations = ct.violation_lines(cmp)
    if violations:
        items = "".join(f"<li>{_e(v)}</li>" for v in violations)
        parts.append(f'<ul class="violations">{items}</ul>')
    allowed = ct.allowed_lines(cmp)
    if allowed:
        items = "".join(f"<li>{_e(a)}</li>" for a in allowed)
        parts.append(f'<p>Allowed by the rule:</p><ul class="allowed">{items}</ul>')
    absorbed = ct.absorbed_lines(cmp)
    if absorbed:
        items = "".join(f"<li>{_e(a)}</li>" for a in absorbed)
        parts.append(f'<p>{_e(ct.ABSORBED_HEAD.capitalize())}:</p><ul class="allowed">{items}</ul>')
    parts.append("</header>")
    if cmp.alternatives:
        rows = [ct.candidate_cells(x) for x in cmp.candidates()]
        parts += [f"<section><h2>{ct.CANDIDATES_TITLE}</h2>",
                  _plain_table(ct.CANDIDATE_COLUMNS, rows, text_columns=(0, 1, 2, 3),
                               row_class=["" if x.accepted else "flip" for x in cmp.candidates()]), "</section>"]
    for i, x in enumerate(cmp.candidates()):
        if cmp.alternatives:
            parts.append(f'<h2 class="{"ok" if x.accepted else "bad"}">{_e(ct.candidate_head(x))}</h2>')
        parts += _candidate(x, png=png if i == 0 else None)
    rows, untimed = ct.speed_rows(cmp)
    if rows or untimed:
        parts += [f"<section><h2>{ct.SPEED_TITLE}</h2>",
                  "<p>The plain step with no nanhunt hook, float32 and autocast interleaved; ratio = autocast time / "
                  "float32 time per repetition (below 1: autocast is faster).</p>"]
        if rows:
            parts.append(_plain_table(ct.SPEED_COLUMNS, rows, text_columns=(0, 1)))
            parts += [f"<p>{_e(m[0].upper() + m[1:])}.</p>" for m in ct.speed_memory_lines(cmp)]
        parts += [f'<p class="warn">{_e(u[0].upper() + u[1:])}.</p>' for u in untimed]
        parts.append("</section>")
    cfg = [(k, _e(v)) for k, v in report.config.items() if v is not None]
    env = [(k, _e(v)) for k, v in c.environment_rows(dataclasses.replace(report, config={}))]
    if cfg or env:
        parts += [f"<section><h2>{ct.CONFIG_TITLE}</h2>", _kv(cfg + env), "</section>"]
    parts.append(f"<section><h2>{c.REPRODUCE_TITLE}</h2>")
    if report.command:
        parts.append(f"<p>Compare again:</p>{_command(report.command)}")
    else:
        parts.append("<p>No command was recorded.</p>")
    parts.append("</section>")
    return _close(parts, report, f"nanhunt compare report, schema {report.schema_version}, "
                                 f"{len(cmp.modules)} module calls compared.")
