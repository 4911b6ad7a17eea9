"""One self-contained HTML file: inline CSS, the picture inlined as a PNG data URI, no network.

Every string that came from the user's program goes through ``html.escape``; the page
carries a Content-Security-Policy that forbids loading anything, so even a mistake here
cannot make a browser fetch from outside.
"""

from __future__ import annotations

import base64
import html as _html

from ..records import Occurrence, Report
from . import _common as c
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
    return _html.escape(str(s), quote=True)


def _spans(spans: list[Span]) -> str:
    return "".join(f"<code>{_e(s.text)}</code>" if s.code else _e(s.text) for s in spans)


def _kv(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _tensor_table(occ: Occurrence) -> str:
    head = "".join(f'<th class="{"num" if i >= 3 else ""}">{_e(h)}</th>' for i, h in enumerate(c.TENSOR_COLUMNS))
    rows = []
    for row in c.tensor_rows(occ):
        cells = []
        for i, cell in enumerate(row):
            cls = "num" if i >= 3 else ""
            if c.TENSOR_COLUMNS[i] == "headroom" and cell not in ("-", "inf"):
                cls += " bad" if cell == "overflowed" else (" warn" if cell.endswith("x") and float(cell[:-1]) < 16 else "")
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
        cls = report.module_classes.get(n, "")
        kids = children.get(n, [])
        sub = f"<ul>{''.join(item(k) for k in kids)}</ul>" if kids else ""
        return (f'<li><code>{_e(c.label(n))}</code> <span class="dim">{_e(cls)}</span> '
                f'<span class="{_status_class(st)}">{_e(st)}</span>{sub}</li>')

    return f'<ul class="tree">{"".join(item(n) for n in children.get(None, []))}</ul>'


def _occurrence(o: Occurrence) -> str:
    spans = [Span(f"{'NaN' if o.kind == 'nan' else 'Inf'} in phase {o.phase.value}, "),
             Span(c.label(o.module), o.module is not None)]
    if o.op:
        spans += [Span(" at "), Span(o.op, True)]
    if o.allowed:
        spans.append(Span(" (allowed)"))
    if o.silent:
        spans.append(Span(" (silent)"))
    return _spans(spans)


def _badges(report: Report) -> str:
    if report.status == "clean":
        out = '<span class="badge b-ok">finite</span>'
    elif report.status == "not-reproducible":
        out = '<span class="badge b-warn">not reproducible</span>'
    else:
        out = '<span class="badge b-bad">non-finite</span>'
    rp = report.repro
    if rp is not None:
        out += ('<span class="badge b-ok">repro verified</span>' if rp.verified
                else '<span class="badge b-warn">repro not verified</span>')
    v = report.verdict
    if v is not None and v.kind not in ("clean",):
        out += f'<span class="badge {"b-ok" if v.confirmed else "b-warn"}">{_e(v.kind)}{" · confirmed" if v.confirmed else ""}</span>'
    return out


def render(report: Report, *, png: bytes | None = None, draw: bool = True) -> str:
    """The page. ``png`` is the picture (drawn here with :mod:`nanhunt.report.picture` when
    ``None`` and ``draw``); pass the bytes you also write beside the page to draw it once."""
    if png is None and draw and report.timeline:
        from .picture import png as draw_png

        png = draw_png(report)
    title = "".join(s.text for s in c.sentence(report))
    parts: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>nanhunt: {_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<header><h1>nanhunt report</h1>{_badges(report)}",
        f'<p class="sentence">{_spans(c.sentence(report))}</p></header>',
    ]
    occ = report.first
    if occ is not None:
        rows = [(k, _spans(v)) for k, v in c.birth_rows(occ)]
        parts += ["<section><h2>Where it was born</h2>", _kv(rows), "</section>"]
        parts += ["<section><h2>The op's tensors against their dtype's limits</h2>", _tensor_table(occ),
                  '<p class="dim">headroom: how many times larger the largest value could grow before its dtype '
                  "overflows (65504 for float16).</p></section>"]
    if png:
        alt = "log10 of the largest magnitude of every recorded tensor along the step"
        parts += ["<section><h2>The step at a glance</h2><figure>",
                  f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">',
                  "<figcaption>x: every recorded tensor in execution order (forward, loss, backward, update); "
                  "y: log10 of its largest finite |x|. Dashed lines: float16 and bfloat16 maxima. Crosses and "
                  "triangles at the top: NaN and Inf tensors. The star and the red line: the origin."
                  "</figcaption></figure></section>"]
    if report.path:
        items = "".join(f"<li>{_spans(c.path_label(r))}</li>" for r in report.path[:_PATH_SHOWN])
        if len(report.path) > _PATH_SHOWN:
            items += f"<li>... and {len(report.path) - _PATH_SHOWN} more</li>"
        parts += ["<section><h2>Propagation path</h2>", f'<ol class="path">{items}</ol></section>']
    v = report.verdict
    if report.status != "clean" or v is not None:
        parts += ["<section><h2>Bisection by local float32</h2>", f"<p>{_spans(c.verdict_text(report))}</p>"]
        if v is not None and v.origin_alone_fixes is not None:
            parts.append(f"<p>The origin's module alone in float32 fixes the step: "
                         f"<b>{'yes' if v.origin_alone_fixes else 'no'}</b>.</p>")
        alts = c.alternatives(report)
        if alts:
            parts.append(_kv([(f"whole step, {k}", f'<span class="{"ok" if s == "finite" else "bad"}">{_e(s)}</span>')
                              for k, s in alts]))
        if v is not None and v.fix:
            parts.append(f"<p>Suggested fix:</p><pre><code>{_e(v.fix)}</code></pre>")
        parts.append("</section>")
    parts += ["<section><h2>GradScaler</h2>", f"<p>{_e(c.scaler_text(report.config))}</p></section>"]
    env = c.environment_rows(report)
    if env:
        parts += ["<section><h2>Environment</h2>", _kv([(k, _e(val)) for k, val in env]), "</section>"]
    parts.append("<section><h2>Reproduce</h2>")
    if report.command:
        parts.append(f"<p>Replay the step:</p><pre><code>{_e(report.command)}</code></pre>")
    rp = report.repro
    if rp is not None:
        parts += [f"<p>{_spans(c.repro_text(report))}</p>",
                  "<p>Run the op alone (needs only torch; exit status 1 when the output is non-finite):</p>",
                  f"<pre><code>{_e(rp.command)}</code></pre>"]
    elif not report.command:
        parts.append("<p>No command was recorded.</p>")
    parts.append("</section>")
    if report.modules:
        parts += ["<section><h2>Modules</h2>", _tree(report), "</section>"]
    others = [o for o in report.origins if o is not occ and o != occ]
    if others:
        items = "".join(f"<li>{_occurrence(o)}</li>" for o in others)
        parts.append(f"<details><summary>Other origins ({len(others)})</summary><ul>{items}</ul></details>")
    if report.status == "not-reproducible" and report.runs:
        items = "".join(f"<li>run {i + 1}: {_occurrence(o) if o is not None else 'finite'}</li>"
                        for i, o in enumerate(report.runs))
        parts.append(f"<details open><summary>The two replays</summary><ul>{items}</ul></details>")
    if report.notes:
        items = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
        parts.append(f"<details open><summary>Notes ({len(report.notes)})</summary><ul>{items}</ul></details>")
    parts.append(f"<footer>nanhunt report, schema {report.schema_version}, {report.n_records} recorded tensors."
                 "</footer></body></html>")
    return "\n".join(parts) + "\n"
