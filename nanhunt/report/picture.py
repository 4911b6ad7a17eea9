"""The step as a picture: the magnitude of every recorded tensor, in execution order.

x is the record order (forward, loss, backward, update); y is log10 of the largest
finite magnitude. The float16 and bfloat16 maxima are horizontal lines, non-finite
tensors sit in a row at the top, and the origin is marked. matplotlib draws it
(its object API on an Agg canvas: no pyplot, no global state, no display needed).

A comparison report (``nanhunt compare``) gets another picture: error by module call
(:func:`comparison_figure`), one row per call in the order the calls started, a bar for
the error the call introduces and a dot for the error of its output, on a log scale,
with the relative tolerance as a vertical line.
"""

from __future__ import annotations

import io
import math

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .._util._errors import visible
from .._util._text import cut
from ..records import DTYPE_MAX, Comparison, Report, TensorDiff

__all__ = ["figure", "comparison_figure", "png", "svg", "FP16_MAX", "BF16_MAX"]

FP16_MAX = DTYPE_MAX["float16"]
BF16_MAX = DTYPE_MAX["bfloat16"]
_PHASE_COLOURS = {
    "input": "#7f7f7f", "weights": "#7f7f7f", "forward": "#1f77b4", "loss": "#9467bd", "backward": "#ff7f0e",
    "update": "#2ca02c",
}
_FLOOR_PAD = 1.0  # all-zero tensors are drawn one decade below the smallest magnitude


def _tex_safe(s: str) -> str:
    # matplotlib reads text between two '$' as mathtext; a module name is plain text (its control characters too).
    return visible(s).replace("$", r"\$")


def _origin_label(report: Report) -> str:
    occ = report.first
    if occ is None:
        return ""
    where = "outside the model" if occ.module is None else f"in {cut(occ.module, 80) or '<root>'}"
    what = "NaN" if occ.kind == "nan" else "Inf"
    return _tex_safe(f"origin: {what} {where} · {cut(occ.op or occ.output.role.value, 80)}")


_Point = tuple[int, str, float, str]


def figure(report: Report, *, width: float = 11.0, height: float = 5.0) -> Figure | None:
    """The picture of ``report.timeline``; ``None`` when the report has no timeline (schema 1 files).
    A comparison report gets :func:`comparison_figure` instead."""
    if report.comparison is not None:
        return comparison_figure(report, width=width)
    points = report.timeline
    if not points:
        return None
    finite = [(i, ph, m) for i, ph, m, k in points if k == "finite" and not math.isnan(m)]
    bad = [(i, ph, k) for i, ph, m, k in points if k != "finite"]
    logs = [math.log10(m) for _, _, m in finite if m > 0]
    lo = min(logs, default=0.0)
    floor = math.floor(lo) - _FLOOR_PAD
    hi = max(logs, default=0.0)
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    top, ax, axes, nonfinite_y, split = _panels(fig, floor, hi)
    x_lo, x_hi = _bands_and_limits(points, axes, top)
    _magnitudes(ax, top, finite, bad, floor, nonfinite_y)
    _origin(report, axes, top, nonfinite_y, (x_lo + x_hi) / 2)
    ax.set_xlabel("record, in execution order")
    ax.set_ylabel("log10 max |x|")
    top.set_title(_tex_safe(_title(report)), fontsize=11, loc="left", pad=16)
    _timeline_legend(fig, axes, top, split, nonfinite_y)
    return fig


def _panels(fig: Figure, floor: float, hi: float) -> tuple[Axes, Axes, tuple[Axes, ...], float, bool]:
    """The axes: ``(top, ax, axes, nonfinite_y, split)``; ``top`` is ``ax`` when there is one panel."""
    fp16 = math.log10(FP16_MAX)
    bf16 = math.log10(BF16_MAX)
    # Two panels when the data stays far below the bfloat16 limit: the lower one keeps the
    # resolution where values live, the upper one holds the bfloat16 line and the non-finite row.
    low_top = max(fp16 + 1.0, hi + 0.5)
    split = low_top < bf16 - 4
    if split:
        top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, 4])
        top.set_ylim(bf16 - 2.0, bf16 + 3.0)
        ax.set_ylim(floor - 0.3, low_top)
        top.spines["bottom"].set_visible(False)
        ax.spines["top"].set_visible(False)
        top.tick_params(bottom=False)
        for a, y in ((top, 0.0), (ax, 1.0)):  # the break marks
            a.plot([0, 1], [y, y], transform=a.transAxes, marker=[(-1, -0.5), (1, 0.5)], markersize=10,
                   linestyle="none", color="k", mec="k", mew=1, clip_on=False)
        nonfinite_y = bf16 + 2.0
        axes: tuple[Axes, ...] = (top, ax)
    else:
        ax = fig.subplots(1, 1)
        top = ax
        ax.set_ylim(floor - 0.3, max(bf16, hi) + 3.0)
        nonfinite_y = max(bf16, hi) + 2.0
        axes = (ax,)
    return top, ax, axes, nonfinite_y, split


def _bands_and_limits(points: tuple[_Point, ...], axes: tuple[Axes, ...], top: Axes) -> tuple[float, float]:
    """The x range, the phase bands (named on ``top``) and the float16/bfloat16 lines; returns the x range."""
    fp16 = math.log10(FP16_MAX)
    bf16 = math.log10(BF16_MAX)
    xs = [p[0] for p in points]
    x_lo, x_hi = min(xs) - 0.5, max(xs) + 0.5
    for a in axes:
        a.set_xlim(x_lo, x_hi)
        # Phase bands, in the background.
        start = 0
        for j in range(1, len(points) + 1):
            if j == len(points) or points[j][1] != points[start][1]:
                ph = points[start][1]
                a.axvspan(points[start][0] - 0.5, points[j - 1][0] + 0.5, color=_PHASE_COLOURS.get(ph, "#cccccc"),
                          alpha=0.07, lw=0)
                if a is top:
                    a.text((points[start][0] + points[j - 1][0]) / 2, 1.0, ph, transform=a.get_xaxis_transform(),
                           ha="center", va="bottom", fontsize=8, color="#555555", clip_on=False)
                start = j
        a.axhline(fp16, color="#d62728", lw=1.2, ls="--", label="float16 max 65504", gid="limit-float16")
        a.axhline(bf16, color="#8c564b", lw=1.2, ls="-.", label="bfloat16 max 3.39e38", gid="limit-bfloat16")
    return x_lo, x_hi


def _magnitudes(ax: Axes, top: Axes, finite: list[tuple[int, str, float]], bad: list[tuple[int, str, str]],
                floor: float, nonfinite_y: float) -> None:
    """The finite magnitudes by phase (all-zero tensors on the floor) and the non-finite row on ``top``."""
    by_phase: dict[str, tuple[list[int], list[float]]] = {}
    for i, ph, m in finite:
        y = math.log10(m) if m > 0 else floor
        by_phase.setdefault(ph, ([], []))
        by_phase[ph][0].append(i)
        by_phase[ph][1].append(y)
    for ph, (px, py) in by_phase.items():
        ax.scatter(px, py, s=10, color=_PHASE_COLOURS.get(ph, "#333333"), label=ph, zorder=3)
    if any(m == 0 for _, _, m in finite):
        ax.axhline(floor, color="#bbbbbb", lw=0.8, ls=":", label="all zeros", zorder=1)
    for kind, marker, colour in (("nan", "x", "#d62728"), ("inf", "^", "#ff7f0e")):
        kx = [i for i, _, k in bad if k == kind]
        if kx:
            top.scatter(kx, [nonfinite_y] * len(kx), marker=marker, s=28, color=colour, zorder=4,
                        label=f"{'NaN' if kind == 'nan' else 'Inf'} ({len(kx)})", gid=f"nonfinite-{kind}")


def _origin(report: Report, axes: tuple[Axes, ...], top: Axes, nonfinite_y: float, x_mid: float) -> None:
    """The origin: a line on every panel, a star in the non-finite row and its label."""
    occ = report.first
    if occ is None:
        return
    ox = occ.output.index
    for a in axes:
        a.axvline(ox, color="#d62728", lw=1.5, alpha=0.8, gid="origin", zorder=2)
    top.scatter([ox], [nonfinite_y], marker="*", s=220, color="#d62728", edgecolor="k", zorder=5,
                label="origin", gid="origin-marker")
    top.annotate(_origin_label(report), xy=(ox, nonfinite_y), xytext=(8, -14), textcoords="offset points",
                 fontsize=9, color="#b01010", ha="left" if ox < x_mid else "right",
                 gid="origin-label")


def _timeline_legend(fig: Figure, axes: tuple[Axes, ...], top: Axes, split: bool, nonfinite_y: float) -> None:
    """One legend for all panels (each label once); the upper panel's ticks when split."""
    bf16 = math.log10(BF16_MAX)
    handles, labels = [], []
    for a in axes:
        h, lab = a.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if split:
        top.set_yticks([bf16, nonfinite_y], [f"{bf16:.1f}", "non-finite"])
    fig.legend(handles, labels, loc="outside lower center", fontsize=8, ncols=min(len(labels), 6), frameon=False)


def _title(report: Report) -> str:
    cfg = report.config
    bits = [f"{len(report.timeline)} recorded tensors"]
    if cfg.get("dtype"):
        bits.append(f"autocast {cfg.get('device_type', '?')} {cfg['dtype']}")
    return "magnitude along the step: " + ", ".join(bits)


_ROWS_SHOWN = 40
_LABEL_CHARS = 60
_INTRODUCED = "#1f77b4"
_OVER_TOL = "#d62728"
_OUTPUT = "#222222"


def _row_label(d: TensorDiff) -> str:
    text = " ".join((d.label() + (f" ({d.module_class})" if d.module_class else "")).split())
    if len(text) > _LABEL_CHARS:
        text = text[: _LABEL_CHARS - 1] + "…"
    return _tex_safe(text)


def _shown_calls(c: Comparison, limit: int) -> list[int]:
    """The module calls drawn: all of them when they fit, else the ranked ones first, then the largest output
    errors; in the order the calls started."""
    if len(c.modules) <= limit:
        return list(range(len(c.modules)))
    chosen = list(c.ranking[:limit])
    taken = set(chosen)
    rest = sorted((i for i in range(len(c.modules)) if i not in taken),
                  key=lambda i: (-_sort_key(c.modules[i].scaled), i))
    chosen += rest[: limit - len(chosen)]
    return sorted(chosen)


def _sort_key(x: float) -> float:
    return math.inf if math.isnan(x) else x


def comparison_figure(report: Report, *, width: float = 11.0, limit: int = _ROWS_SHOWN) -> Figure | None:
    """Error by module call for a comparison report; ``None`` when nothing was compared (a non-finite
    reference) or the report is no comparison.

    One row per module call, in the order the calls started (at most ``limit``: then the ranked calls and
    the largest output errors). Artists carry ids: ``introduced`` (the bars), ``output-error`` (the dots),
    ``tolerance`` (the rtol line), ``nonfinite`` (infinite errors, drawn in a column of their own at the
    right, past ``nonfinite-break``), ``zero-error`` (outputs without error, at the left edge), ``rank-N``."""
    c = report.comparison
    if c is None or not c.modules:
        return None
    rows = _shown_calls(c, limit)
    diffs = [c.modules[i] for i in rows]
    intro = [d.introduced if d.introduced is not None else 0.0 for d in diffs]
    outs = [d.scaled for d in diffs]
    tol = c.rtol if c.rtol > 0 else None
    left, right, edge = _error_range(intro, outs, tol)
    bad = [not math.isfinite(x) or not math.isfinite(o) for x, o in zip(intro, outs)]

    n = len(rows)
    fig = Figure(figsize=(width, max(2.8, 0.34 * n + 1.9)), dpi=100, layout="constrained")
    ax = fig.subplots(1, 1)
    ax.set_xscale("log")
    ax.set_xlim(left, right)
    ax.set_ylim(n - 0.5, -0.5)  # the first call at the top
    ys = list(range(n))
    over = [not math.isfinite(x) or (tol is not None and x > tol) for x in intro]
    drawn = [k for k, x in enumerate(intro) if x != 0]
    pos = [k for k, x in enumerate(outs) if x > 0 and math.isfinite(x)]
    zero = [k for k, x in enumerate(outs) if x == 0]
    _error_marks(ax, intro, outs, ys, left, edge, over, drawn, pos, zero)
    if any(bad):
        ax.axvline(edge / 10.0**0.5, color="#999999", lw=0.8, ls=":", zorder=1, gid="nonfinite-break")
        ax.text(edge, 1.0, "non-finite", transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8,
                color=_OVER_TOL)
        ax.scatter([edge] * sum(bad), [y for y, b in zip(ys, bad) if b], s=70, marker=">", color=_OVER_TOL,
                   edgecolors="k", zorder=5, gid="nonfinite")
    if tol is not None:
        ax.axvline(tol, color="#ff7f0e", lw=1.4, ls="--", zorder=3, gid="tolerance")
    _rank_marks(ax, c, rows, intro, outs, ys, edge)
    _call_axes(ax, c, rows, diffs, left, edge)
    _error_legend(fig, c, tol, [over[k] for k in drawn], bool(pos), bool(zero), any(bad))
    return fig


def _error_range(intro: list[float], outs: list[float], tol: float | None) -> tuple[float, float, float]:
    """``(left, right, edge)``: the x range, whole decades around the finite errors (and rtol), wider by the
    column of infinite errors at ``edge`` when there are any."""
    finite_pos = [x for x in (*intro, *outs, *(() if tol is None else (tol,))) if math.isfinite(x) and x > 0]
    lo = min(finite_pos, default=1e-3)
    hi = max(finite_pos, default=1.0)
    left = 10.0 ** (math.floor(math.log10(lo)) - 1)
    right = 10.0 ** (math.ceil(math.log10(hi)) + 1)
    bad = [not math.isfinite(x) or not math.isfinite(o) for x, o in zip(intro, outs)]
    edge = right * 10.0**0.5  # infinite errors: a column past the finite range
    if any(bad):
        right *= 10.0
    return left, right, edge


def _at(x: float, edge: float) -> float:
    return x if math.isfinite(x) else edge


def _error_marks(ax: Axes, intro: list[float], outs: list[float], ys: list[int], left: float, edge: float,
                 over: list[bool], drawn: list[int], pos: list[int], zero: list[int]) -> None:
    """The bars of introduced error and the dots of output error (hollow at the left edge when zero)."""
    bars = ax.barh([ys[k] for k in drawn], [_at(intro[k], edge) - left for k in drawn], left=left, height=0.6,
                   color=[_OVER_TOL if over[k] else _INTRODUCED for k in drawn], zorder=2)
    for patch in bars.patches:
        patch.set_gid("introduced")
    if pos:
        ax.scatter([outs[k] for k in pos], [ys[k] for k in pos], s=34, marker="o", color=_OUTPUT, zorder=4,
                   gid="output-error")
    if zero:
        ax.scatter([left] * len(zero), [ys[k] for k in zero], s=34, marker="o", facecolors="none",
                   edgecolors="#888888", zorder=4, clip_on=False, gid="zero-error")


def _rank_marks(ax: Axes, c: Comparison, rows: list[int], intro: list[float], outs: list[float], ys: list[int],
                edge: float) -> None:
    """``rank N`` beside the three calls that introduce the most error."""
    rank_of = {i: r for r, i in enumerate(c.ranking, 1)}
    for k, i in enumerate(rows):
        r = rank_of.get(i)
        if r is not None and r <= 3 and intro[k] != 0:
            x = (max(_at(intro[k], edge), _at(outs[k], edge)) if outs[k] > 0 or not math.isfinite(outs[k])
                 else _at(intro[k], edge))
            ax.annotate(f"rank {r}", xy=(x, ys[k]), xytext=(8, 0), textcoords="offset points", va="center",
                        fontsize=8, color="#b01010", gid=f"rank-{r}")


def _call_axes(ax: Axes, c: Comparison, rows: list[int], diffs: list[TensorDiff], left: float, edge: float) -> None:
    """The row labels (the first ranked call in bold red), the decade ticks and grid, the labels and title."""
    n = len(rows)
    ys = list(range(n))
    ax.set_yticks(ys, [_row_label(d) for d in diffs], fontsize=8.5)
    if c.ranking and c.ranking[0] in rows:
        tick = ax.get_yticklabels()[rows.index(c.ranking[0])]
        tick.set_color("#b01010")
        tick.set_fontweight("bold")
    # Decades only over the finite range: the non-finite column has no scale.
    first_dec, last_dec = round(math.log10(left)), round(math.log10(edge / 10.0**0.5))
    ax.set_xticks([10.0**k for k in range(first_dec, last_dec + 1)])
    ax.set_xticks([m * 10.0**k for k in range(first_dec, last_dec) for m in range(2, 10)], minor=True)
    ax.grid(axis="x", which="major", color="#e6e6e6", lw=0.8, zorder=0)
    ax.set_axisbelow(True)
    ax.set_xlabel("error as a fraction of the value's largest float32 magnitude (log scale)")
    shown = f"{n} of {len(c.modules)} module calls" if n < len(c.modules) else f"{n} module calls"
    ax.set_title(_tex_safe(f"error by module call: autocast {c.device_type} {c.dtype} against float32, {shown}"),
                 fontsize=11, loc="left", pad=14)


def _error_legend(fig: Figure, c: Comparison, tol: float | None, over_drawn: list[bool], pos: bool, zero: bool,
                  bad: bool) -> None:
    """The legend: only the marks drawn. ``over_drawn``: for each bar, whether it is above rtol."""
    handles: list[Artist] = []
    if any(not o for o in over_drawn):
        handles.append(Patch(color=_INTRODUCED, label="error the call introduces"))
    if any(over_drawn):
        handles.append(Patch(color=_OVER_TOL, label="introduced error above rtol" if tol is not None
                             else "introduced error, non-finite"))
    if pos:
        handles.append(Line2D([], [], marker="o", ls="none", color=_OUTPUT, label="error of its output"))
    if zero:
        handles.append(Line2D([], [], marker="o", ls="none", markerfacecolor="none", markeredgecolor="#888888",
                              label="output without error"))
    if bad:
        handles.append(Line2D([], [], marker=">", ls="none", color=_OVER_TOL, markeredgecolor="k",
                              label="infinite error (non-finite)"))
    if tol is not None:
        handles.append(Line2D([], [], color="#ff7f0e", ls="--", label=f"tolerance: rtol {c.rtol:g}"))
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, ncols=min(len(handles), 6), frameon=False)


def png(report: Report, *, dpi: int = 100) -> bytes | None:
    """The picture as PNG bytes (deterministic: no timestamp, no software tag)."""
    fig = figure(report)
    if fig is None:
        return None
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def svg(report: Report) -> str | None:
    """The picture as SVG text; artists keep their ids (``origin``, ``nonfinite-nan``, ``limit-float16``...)."""
    fig = figure(report)
    if fig is None:
        return None
    buf = io.StringIO()
    FigureCanvasSVG(fig)
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()
