"""The step as a picture: the magnitude of every recorded tensor, in execution order.

x is the record order (forward, loss, backward, update); y is log10 of the largest
finite magnitude. The float16 and bfloat16 maxima are horizontal lines, non-finite
tensors sit in a row at the top, and the origin is marked. matplotlib draws it
(its object API on an Agg canvas: no pyplot, no global state, no display needed).
"""

from __future__ import annotations

import io
import math

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from ..records import Report

__all__ = ["figure", "png", "svg", "FP16_MAX", "BF16_MAX"]

FP16_MAX = 65504.0
BF16_MAX = 3.3895313892515355e38
_PHASE_COLOURS = {
    "input": "#7f7f7f", "weights": "#7f7f7f", "forward": "#1f77b4", "loss": "#9467bd", "backward": "#ff7f0e",
    "update": "#2ca02c",
}
_FLOOR_PAD = 1.0  # all-zero tensors are drawn one decade below the smallest magnitude


def _tex_safe(s: str) -> str:
    # matplotlib reads text between two '$' as mathtext; a module name is plain text.
    return s.replace("$", r"\$")


def _origin_label(report: Report) -> str:
    occ = report.first
    if occ is None:
        return ""
    where = "outside the model" if occ.module is None else (occ.module or "<root>")
    what = "NaN" if occ.kind == "nan" else "Inf"
    return _tex_safe(f"origin: {what} in {where} · {occ.op or occ.output.role.value}")


def figure(report: Report, *, width: float = 11.0, height: float = 5.0) -> Figure | None:
    """The picture of ``report.timeline``; ``None`` when the report has no timeline (schema 1 files)."""
    points = report.timeline
    if not points:
        return None
    finite = [(i, ph, m) for i, ph, m, k in points if k == "finite" and not math.isnan(m)]
    bad = [(i, ph, k) for i, ph, m, k in points if k != "finite"]
    logs = [math.log10(m) for _, _, m in finite if m > 0]
    lo = min(logs, default=0.0)
    floor = math.floor(lo) - _FLOOR_PAD
    hi = max(logs, default=0.0)
    fp16 = math.log10(FP16_MAX)
    bf16 = math.log10(BF16_MAX)
    # Two panels when the data stays far below the bfloat16 limit: the lower one keeps the
    # resolution where values live, the upper one holds the bfloat16 line and the non-finite row.
    low_top = max(fp16 + 1.0, hi + 0.5)
    split = low_top < bf16 - 4
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
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

    occ = report.first
    if occ is not None:
        ox = occ.output.index
        for a in axes:
            a.axvline(ox, color="#d62728", lw=1.5, alpha=0.8, gid="origin", zorder=2)
        top.scatter([ox], [nonfinite_y], marker="*", s=220, color="#d62728", edgecolor="k", zorder=5,
                    label="origin", gid="origin-marker")
        top.annotate(_origin_label(report), xy=(ox, nonfinite_y), xytext=(8, -14), textcoords="offset points",
                     fontsize=9, color="#b01010", ha="left" if ox < (x_lo + x_hi) / 2 else "right",
                     gid="origin-label")

    ax.set_xlabel("record, in execution order")
    ax.set_ylabel("log10 max |x|")
    top.set_title(_tex_safe(_title(report)), fontsize=11, loc="left", pad=16)
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
    return fig


def _title(report: Report) -> str:
    cfg = report.config
    bits = [f"{len(report.timeline)} recorded tensors"]
    if cfg.get("dtype"):
        bits.append(f"autocast {cfg.get('device_type', '?')} {cfg['dtype']}")
    return "magnitude along the step: " + ", ".join(bits)


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
