"""Console report (rich): the verdict first, then the op's statistics, the path, the module tree.

Every user string goes through ``visible`` (control characters as visible escapes: a module name
read from a file must not move the cursor, recolour the terminal or forge a line) and, where rich
reads markup (table cells), through ``rich.markup.escape`` too.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from .._util._errors import visible
from .._util._text import cut
from . import _common as _c
from . import _compare_text as _ct
from ..records import Comparison, HeadroomHistory, Inspection, Occurrence, Report, Status, TensorDiff

__all__ = ["render", "render_text", "render_inspection", "summary_line", "render_comparison", "compare_summary"]


_WARNINGS_SHOWN = 3  # a Guard's warnings on the console (each is a few lines; Markdown and HTML fold them all)


def _t(text: str, style: str = "") -> Text:
    """Text that may hold user strings: never parsed as markup, control characters made visible."""
    return Text(visible(text), style=style)


def _m(text: str) -> str:
    """A table cell (rich reads it as markup): markup and control characters escaped."""
    return escape(visible(text))


def _text(spans: list[_c.Span], style: str = "") -> Text:
    """Spans as rich Text: user names in a code style (cut past ``NAME_SHOWN`` characters), never parsed as
    markup."""
    t = Text(style=style)
    for sp in spans:
        t.append(visible(cut(sp.text) if sp.code else sp.text), style="bold cyan" if sp.code else "")
    return t


def _code(code: str, style: str = "cyan") -> Text:
    """Code to paste (a fix): its line breaks kept, every line indented, so that no line of it, read from a
    file, starts where nanhunt's own lines do (a forged ``nanhunt: error:``)."""
    return Text("\n".join("    " + line for line in visible(code, multiline=True).splitlines()), style=style)


def summary_line(report: Report) -> str:
    return visible("".join(sp.text for sp in _c.sentence(report)))


def _stats_table(occ: Occurrence) -> Table:
    # The console drops the "dtype max" column (the headroom says it) to fit 100 columns.
    keep = [i for i, col in enumerate(_c.TENSOR_COLUMNS) if col != "dtype max"]
    t = Table(title="the op's tensors against their dtype limits", title_justify="left", padding=(0, 1),
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    for i in keep:
        col = _c.TENSOR_COLUMNS[i]
        left = col in ("tensor", "dtype", "shape")
        t.add_column(col, justify="left" if left else "right", no_wrap=col in ("tensor", "dtype"))
    for row in _c.tensor_rows(occ):
        row = (*row[:2], row[2].replace(" ", ""), *row[3:])  # [2,16,64]: shapes stay on one line
        t.add_row(*(_m(row[i]) for i in keep))
    return t


def _casts_table(occ: Occurrence) -> Table:
    t = Table(title=_c.CASTS_TITLE.lower(), title_justify="left", padding=(0, 1), box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True, show_edge=False)
    for col in _c.CAST_COLUMNS:
        t.add_column(col, justify="right" if col in ("amax", "scale", "to zero", "at max") else "left")
    for row in _c.cast_rows(occ):
        t.add_row(_m(cut(row[0])), *(_m(cell) for cell in row[1:]))
    return t


def _tree(report: Report) -> Tree | None:
    if not report.modules:
        return None

    def style_of(status: str) -> str:
        if status == "finite":
            return "green"
        return "bold red" if status.startswith("nan") else "bold yellow"

    root = Tree(Text("modules", style="bold"))
    nodes: dict[str, Tree] = {}
    for name in sorted(report.modules, key=lambda n: (n.count("."), n)):
        status = report.modules[name]
        label = _t(f"{cut(name) or '<root>'} ({cut(report.module_classes.get(name, ''))}) ", style=style_of(status))
        label.append(visible(status), style=style_of(status))
        parent_name = name.rpartition(".")[0] if "." in name else ("" if name else None)
        parent = nodes.get(parent_name) if parent_name is not None else None
        nodes[name] = (parent or root).add(label)
    return root


def _key_values(rows: list[tuple[str, list[_c.Span]]]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="dim")
    t.add_column()
    for k, spans in rows:
        t.add_row(k, _text(spans))
    return t


def render(report: Report) -> RenderableType:
    if report.comparison is not None:
        return render_comparison(report)
    colour = "green" if report.status == Status.CLEAN else "red"
    parts: list[RenderableType] = [_text(_c.sentence(report), style=f"bold {colour}")]
    guard = _c.guard_text(report)
    if guard is not None:
        parts.append(_t(guard, style="bold"))
    if report.headroom is not None:
        parts += _headroom(report.headroom)
    occ = report.first
    if occ is not None:
        parts.append(_key_values(_c.birth_rows(occ)))
        parts.append(_stats_table(occ))
        note = _c.tensor_note(occ)
        if note is not None:
            parts.append(_t(note, style="dim"))
        if occ.casts:
            parts.append(_casts_table(occ))
    if report.path:
        path = Text("propagation: ", style="bold")
        for i, r in enumerate(report.path[:12]):
            path.append(" -> " if i else "")
            path.append_text(_text(_c.path_label(r)))
        if len(report.path) > 12:
            path.append(f" -> ... ({len(report.path) - 12} more)")
        parts.append(path)
    others = [o for o in report.origins if o is not occ]
    if others:
        line = _text([_c.Span(f"{len(others)} other origin(s): ")])
        for i, other in enumerate(others[:5]):
            line.append_text(_text([_c.Span("; " if i else ""), *_c.occurrence_spans(other)]))
        parts.append(line)
    if report.status == Status.NOT_REPRODUCIBLE:
        for i, run in enumerate(report.runs):
            said = _c.occurrence_spans(run) if run is not None else [_c.Span("finite")]
            parts.append(_text([_c.Span(f"run {i + 1}: "), *said]))
    if report.verdict is not None:
        parts.append(_text([_c.Span("verdict: ")] + _c.verdict_text(report), style="bold"))
        v = report.verdict
        alone = _c.origin_alone(v)
        if alone is not None:
            parts.append(Text(f"{alone[0][0].lower()}{alone[0][1:]}: {alone[1]}"))
        alts = _c.alternatives(report)
        if alts:
            parts.append(_t("alternatives: " + ", ".join(f"{k}: {state}" for k, state in alts)))
        if v.fix:
            parts += [Text("suggested fix:", style="cyan"), _code(v.fix)]
    parts += _advice(report)
    parts.append(_t("GradScaler: " + _c.scaler_text(report.config)))
    if report.repro is not None:
        parts.append(_text([_c.Span("repro: ")] + _c.repro_text(report)))
    tree = _tree(report)
    if tree is not None:
        parts.append(tree)
    env = _c.environment_rows(report)
    if env:
        parts.append(_t("environment: " + ", ".join(f"{k} {v}" for k, v in env), style="dim"))
    if report.command:
        parts.append(_t(f"reproduce: {report.command}", style="dim"))
    for n in report.notes:
        parts.append(_t(f"note: {n}", style="yellow"))
    return Group(*parts)


def _headroom(h: HeadroomHistory) -> list[RenderableType]:
    """The Guard's headroom history: the table of its series, then its warnings."""
    parts: list[RenderableType] = [_t(_c.headroom_intro(h))]
    if h.series:
        t = Table(title=_c.HEADROOM_TITLE.lower(), title_justify="left", padding=(0, 1), box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True, show_edge=False)
        for i, col in enumerate(_c.HEADROOM_COLUMNS):
            t.add_column(col, justify="left" if i < 2 else "right")
        for row in _c.headroom_rows(h):
            t.add_row(*(_m(x) for x in row))
        parts.append(t)
    said = _c.headroom_warnings(h)
    parts += [_t(f"warning at {w}", style="yellow") for w in said[:_WARNINGS_SHOWN]]
    if len(said) > _WARNINGS_SHOWN:
        parts.append(_t(f"... and {len(said) - _WARNINGS_SHOWN} more warnings", style="yellow"))
    return parts


def _advice(report: Report) -> list[RenderableType]:
    """Each fix beyond float32: the advice, the measurement that triggered it, the code."""
    if not report.advice:
        return []
    parts: list[RenderableType] = [Text(f"{_c.ADVICE_TITLE.lower()} ({_c.ADVICE_INTRO}):", style="bold")]
    for a in report.advice:
        parts.append(_t(f"- {a.advice}", style="bold cyan"))
        parts.append(_t(f"  because: {a.because}", style="dim"))
        parts.append(_code(a.fix))
    return parts


def render_text(report: Report, width: int = 100) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(render(report))
    return buf.getvalue()


def _factor(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}x"


def _inspect_table(title: str, columns: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> Group:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    for i, col in enumerate(columns):
        # the tensor's name folds onto more lines rather than losing its end, which tells tensors apart
        t.add_column(col, justify="left" if i < 3 else "right", overflow="fold" if i == 0 else "ellipsis",
                     no_wrap=0 < i < 3)
    for row in rows:
        t.add_row(*(_m(x) for x in row))
    return Group(Text(title, style="bold"), t)  # the title as wide as the console, not as the table


def _min_text(x: float | None) -> str:
    return "-" if x is None else _c.num(x)


def render_inspection(found: Inspection, limit: int = 20) -> RenderableType:
    """``nanhunt inspect``: the non-finite and near-overflow tensors; for the others, those closest to the dtype
    limits (largest magnitudes with their float16 / bfloat16 headroom, values below float16's smallest normal),
    the optimizer's second moments against eps, and what the GradScaler state means. Each tensor in one list; the
    lists of the finite tensors only when nothing is non-finite (then the non-finite tensors are the finding)."""
    parts: list[RenderableType] = []
    bad = [t for t in found.flagged if t.nan or t.inf]
    near = [t for t in found.flagged if not (t.nan or t.inf)]
    head = f"{found.n_tensors} floating tensors: {len(bad)} non-finite, {len(near)} within 16x of the float16 max"
    parts.append(Text(head, style="bold red" if bad else ("bold yellow" if near else "bold green")))
    if found.flagged:
        t = Table()
        for col in ("tensor", "dtype", "shape", "nan", "inf", "max |x| (finite)", "fp16 headroom"):
            t.add_column(col)
        for s in found.flagged[:limit]:
            t.add_row(_m(cut(s.name)), _m(s.dtype), _m(str(list(s.shape))), str(s.nan), str(s.inf), _c.num(s.absmax),
                      f"{s.fp16_headroom:.3g}x")
        parts.append(t)
        if len(found.flagged) > limit:
            parts.append(Text(f"... and {len(found.flagged) - limit} more"))
    finite = not bad
    rows: list[tuple[str, ...]]
    if found.largest and finite:
        rows = [(cut(s.name), s.dtype, str(list(s.shape)).replace(" ", ""), _c.num(s.absmax), _factor(s.fp16_headroom),
                 _factor(s.bf16_headroom), _min_text(s.min_nonzero)) for s in found.largest]
        title = ("closest to the dtype limits" + (" among the other tensors" if found.flagged else "")
                 + ": the largest magnitudes (headroom = the dtype's max / max |x|)")
        parts.append(_inspect_table(title, ("tensor", "dtype", "shape", "max |x|", "fp16 headroom",
                                            "bf16 headroom", "min |x|>0"), rows))
    if found.tiniest and finite:
        rows = [(cut(s.name), s.dtype, str(list(s.shape)).replace(" ", ""), f"{s.below_fp16_normal} of {s.numel}",
                 _min_text(s.min_nonzero)) for s in found.tiniest]
        parts.append(_inspect_table("non-zero values below float16's smallest normal (6.1e-05: fewer bits of "
                                    "precision; below 6e-08 they round to 0)",
                                    ("tensor", "dtype", "shape", "values below", "min |x|>0"), rows))
    if found.moments and finite:
        rows = []
        for s in found.moments:
            low = None if s.min_nonzero is None else math.sqrt(s.min_nonzero)
            rows.append((cut(s.name), s.dtype, str(list(s.shape)).replace(" ", ""), _c.num(s.absmax),
                         _c.num(math.sqrt(s.absmax)), _min_text(low), "-" if s.eps is None else f"{s.eps:g}",
                         "-" if s.eps is None else f"{s.below_eps} of {s.numel}"))
        parts.append(_inspect_table("optimizer second moments v, largest first (Adam's update is m / (sqrt(v) + "
                                    "eps): where sqrt(v) < eps, eps sets its size)",
                                    ("tensor", "dtype", "shape", "max v", "sqrt(max v)", "min sqrt(v)>0", "eps",
                                     "sqrt(v)<eps"), rows))
    if found.scaler:
        line = "GradScaler: " + ", ".join(f"{k}={v}" for k, v in found.scaler.items())
        if found.scaler_nonfinite:
            line += " (non-finite scale: every loss it scales is non-finite)"
        parts.append(_t(line, style="bold red" if found.scaler_nonfinite else ""))
        for m in found.scaler_meaning:
            parts.append(Padding(_t(m, style="red" if found.scaler_nonfinite else ""), (0, 0, 0, 2)))
    for n in found.notes:
        parts.append(_t(f"note: {n}", style="yellow"))
    return Group(*parts)


# ------------------------------------------------------------------ nanhunt compare


def compare_summary(report: Report) -> str:
    return visible(_ct.compare_summary(report))


def _ranking_table(c: Comparison, limit: int) -> Table:
    t = Table(title=f"where the error is introduced: {_ct.error_definition(c)}", title_justify="left")
    for col in _ct.RANKING_COLUMNS:
        t.add_column(col, justify="left" if col == "module call" else "right")
    for rank, i in enumerate(c.ranking[:limit], 1):
        d = c.modules[i]
        t.add_row(str(rank), _m(d.label() + _ct.module_class_text(d)), *_ct.ranking_cells(d))
    return t


_KIND_STYLE = {"nonfinite": "bold magenta", "flip": "bold red", "near": "yellow"}


def _decisions(c: Comparison) -> list[RenderableType]:
    """The categories, then the worst decisions only: the other formats list every one."""
    parts: list[RenderableType] = [_t(_ct.decisions_head(c), style="bold red" if c.flipped or c.nonfinite else "bold"),
                                   _t(_ct.decision_categories(c))]
    shown, more = _ct.worst_decisions(c)
    if shown:
        t = Table(title="worst first" if more else None, title_justify="left")
        for col in _ct.decision_columns(c):
            t.add_column(col, justify="left" if col in ("sample", "") else "right")
        for kind, cells in _ct.decision_rows(c, shown):
            t.add_row(*(_m(x) for x in cells), style=_KIND_STYLE[kind])
        parts.append(t)
    if more:
        parts.append(Text(f"... and {more} more: the JSON, Markdown and HTML reports (--report) list every sample"))
    return parts


def _diff_line(what: str, d: TensorDiff) -> Text:
    return _t(f"{what}: {_ct.diff_text(d)}")


def _cells_table(columns: tuple[str, ...], rows: list[tuple[str, ...]], *, left: int = 1, title: str = "") -> Table:
    t = Table(title=title or None, title_justify="left")
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        t.add_row(*(_m(x) for x in row))
    return t


def _candidate(c: Comparison, limit: int) -> list[RenderableType]:
    """One autocast dtype: the runs, the batches of a set, the quality, the ranking, the decisions, the values."""
    parts: list[RenderableType] = []
    if not c.reference_finite and not c.modules:
        parts.append(Text(_ct.NOTHING_COMPARED, style="red"))
    elif not c.reference_finite:
        parts.append(_t(f"runs: float32 reference NON-FINITE (first at {c.reference_first_nonfinite}); the other "
                        "batches compared", style="red"))
    else:
        runs = _t(f"runs: float32 reference finite, loss {_c.num(c.ref_loss)} · {c.run_name()} ")
        runs.append(visible(_ct.amp_state(c)), style="green" if c.amp_finite else "bold red")
        runs.append(f", loss {_c.num(c.amp_loss)}")
        parts.append(runs)
    if c.batches:
        parts.append(_cells_table(_ct.batch_columns(c), [_ct.batch_cells(b) for b in c.batches], left=1,
                                  title="the set, batch by batch"))
    q = _ct.quality_text(c)
    if q is not None:
        parts.append(_t(q, style="bold red" if c.quality is not None and c.quality.drop() > 0 else "bold"))
    if c.modules:
        if c.ranking:
            parts.append(_ranking_table(c, limit))
            if len(c.ranking) > limit:
                parts.append(Text(f"... and {len(c.ranking) - limit} more module calls introduce some error"))
        else:
            parts.append(Text(_ct.NO_RANKING))
        d = _ct.carrier(c)
        if d is not None:
            parts.append(_text(_ct.carrier_text(d)))
    if c.task == "classify" and (c.reference_finite or c.modules):  # a non-finite reference: nothing was compared
        parts += _decisions(c)
    if c.output is not None:
        parts.append(_diff_line("model output", c.output))
    g = c.regression
    if g is not None:
        parts.append(_t(_ct.extremes_text(c, g)))
        if g.worst:
            parts.append(_t(_ct.worst_text(c, g)))
    if c.loss is not None:
        parts.append(_diff_line("loss", c.loss))
    if c.grads:
        worst = _ct.ordered_grads(c)[:5]
        line = _t(_ct.gradients_head(c) + "; largest errors: ")
        ref = "max |ref| of its row" if c.per_row else "max |ref|"
        line.append_text(_t("; ".join(f"{d.name} (max abs {_c.num(d.max_abs)} = {_c.num(d.scaled)} x {ref})"
                                      for d in worst)))
        parts.append(line)
    if c.unmatched:
        parts.append(_t("not compared: " + "; ".join(c.unmatched[:5]), style="yellow"))
    return parts


def render_comparison(report: Report, limit: int = 10) -> RenderableType:
    """``nanhunt compare``: the verdict and the rule first (its hash, the failed clauses), the candidates when
    several dtypes were compared, then for each the runs, the batches of a set, the quality, the
    introduced-error ranking, the decisions, the output, the loss and the gradients; the speed last."""
    c = report.comparison
    assert c is not None, "not a comparison report"
    ok = all(x.accepted for x in c.candidates())
    parts: list[RenderableType] = [Text(compare_summary(report), style="bold " + ("green" if ok else "red"))]
    parts.append(_t(f"{_ct.RULE_LABEL}: {c.rule_text()}", style="bold"))
    digest = _ct.rule_hash_text(c)
    if digest is not None:
        parts.append(_t(f"{_ct.RULE_HASH_LABEL}: {digest}", style="dim"))
    for w in _ct.rule_warning_lines(c):
        parts.append(_t("warning: " + w, style="bold yellow"))
    for v in _ct.violation_lines(c):
        parts.append(_t("violation: " + v, style="red"))
    for a in _ct.allowed_lines(c):
        parts.append(_t("allowed by the rule: " + a, style="yellow"))
    for a in _ct.absorbed_lines(c):
        parts.append(_t("absorbed: " + a, style="yellow"))
    if c.alternatives:
        parts.append(_cells_table(_ct.CANDIDATE_COLUMNS, [_ct.candidate_cells(x) for x in c.candidates()], left=4,
                                  title="candidates against one float32 reference"))
    for x in c.candidates():
        if c.alternatives:
            parts.append(_t(_ct.candidate_head(x), style="bold " + ("green" if x.accepted else "red")))
        parts += _candidate(x, limit)
    rows, untimed = _ct.speed_rows(c)
    if rows:
        parts.append(_cells_table(_ct.SPEED_COLUMNS, rows, left=2,
                                  title="speed, after validation (no nanhunt hook; ratio = autocast / float32)"))
        for m in _ct.speed_memory_lines(c):
            parts.append(_t(m, style="dim"))
    for u in untimed:
        parts.append(_t(u, style="yellow"))
    cfg = report.config
    if cfg:
        parts.append(_t("config: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if v is not None), style="dim"))
    for n in report.notes:
        parts.append(_t(f"note: {n}", style="yellow"))
    return Group(*parts)
