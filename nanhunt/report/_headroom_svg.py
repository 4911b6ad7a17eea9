"""Private: a Guard capture's headroom history as an inline SVG chart for the HTML page.

Plain SVG elements written here (no script, no reference to anything outside the page, whose
Content-Security-Policy forbids loading anything): log2 of each series' largest magnitude over the sampled steps,
each rising trend extended by a dashed segment from its last sample to its forecast step at its limit, the float16
(and, in range, bfloat16) maximum as dashed lines, the warnings as triangles at the top, the event's step as a
dotted line; under it, on the same steps, a panel for each of the history's tracks (the loss, the gradient norm,
the GradScaler's scale). Every user string is escaped, its control characters made visible.
"""

from __future__ import annotations

import html as _html
import math
from collections.abc import Callable

from .._util._errors import visible
from ..records import DTYPE_MAX, HeadroomHistory, HeadroomSeries
from . import _common as c

__all__ = ["chart"]

_W, _PLOT_H = 760, 260  # the chart's width, and the height above its legend
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 150, 16, 36  # the plot area's margins (the limits' labels at the right)
_LEGEND_ROW = 18
_TRACK_H, _TRACK_GAP = 56, 10  # a track's panel under the chart, and the space above it
_FORECAST_REACH = 1.0  # the steps axis reaches past the last sample by at most this share of the samples' span
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf")
_LIMITS = (("float16", "#c62828"), ("bfloat16", "#6a1b9a"))
_WARN = "#b26a00"
_LOG2_10 = math.log2(10.0)


def _e(s: object) -> str:
    return _html.escape(visible(str(s)), quote=True)


def _f(x: float) -> str:
    return f"{x:.1f}"


def chart(h: HeadroomHistory) -> str:
    """The ``<svg>`` element of ``h``'s series; empty when it holds none."""
    if not h.series:
        return ""
    steps = [s for series in h.series for s in series.steps] + [w.step for w in h.warnings] + [h.step]
    steps += [s for track in h.tracks for s in track.steps]
    x0, x1 = min(steps), max(steps)
    forecasts = [s for s in h.series if s.forecast_step is not None]
    if forecasts:  # as far as the nearest forecast, within reach
        reach = x1 + max(1, math.ceil((x1 - x0) * _FORECAST_REACH))
        x1 = max(x1, min(max(s.forecast_step or 0 for s in forecasts), reach))
    x1 = x1 if x1 > x0 else x0 + 1
    values = [v for series in h.series for v in series.log2max] + [math.log2(s.limit) for s in forecasts]
    fp16 = math.log2(DTYPE_MAX["float16"])
    lo, hi = min(min(values), fp16) - 1.0, max(max(values), fp16) + 1.0  # float16's maximum always in range
    right, bottom = _W - _RIGHT, _PLOT_H - _BOTTOM

    def px(step: float) -> float:
        return _LEFT + (step - x0) / (x1 - x0) * (right - _LEFT)

    def py(log2: float) -> float:
        return bottom - (log2 - lo) / (hi - lo) * (bottom - _TOP)

    below = len(h.tracks) * (_TRACK_H + _TRACK_GAP)
    height = _PLOT_H + below + _LEGEND_ROW * len(h.series) + 6
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="headroom" width="{_W}" height="{height}" '
           f'viewBox="0 0 {_W} {height}" role="img" aria-label="{_e(c.HEADROOM_TITLE)}" '
           'font-family="system-ui, sans-serif" font-size="11">',
           f'<rect x="{_LEFT}" y="{_TOP}" width="{right - _LEFT}" height="{bottom - _TOP}" fill="none" '
           'stroke="#ccc"/>']
    out += _y_ticks(lo, hi, py, right)
    mid = (_TOP + bottom) // 2
    out.append(f'<text transform="rotate(-90 14 {mid})" x="14" y="{mid}" text-anchor="middle" fill="#666">'
               "max |x|</text>")
    out += _x_ticks(x0, x1, px, bottom)
    for name, colour in _LIMITS:
        y = math.log2(DTYPE_MAX[name])
        if lo <= y <= hi:
            out.append(f'<g class="limit-{name}"><line x1="{_LEFT}" y1="{_f(py(y))}" x2="{right}" y2="{_f(py(y))}" '
                       f'stroke="{colour}" stroke-dasharray="6 4"/><text x="{right + 4}" y="{_f(py(y) + 4)}" '
                       f'fill="{colour}">{name} max {DTYPE_MAX[name]:.6g}</text></g>')
    out.append(f'<g class="event"><line x1="{_f(px(h.step))}" y1="{_TOP}" x2="{_f(px(h.step))}" y2="{bottom}" '
               f'stroke="#666" stroke-dasharray="2 3"/><text x="{_f(px(h.step) - 3)}" y="{bottom - 4}" '
               f'text-anchor="end" fill="#666">step {h.step}</text></g>')
    for k, series in enumerate(h.series):
        colour = _COLOURS[k % len(_COLOURS)]
        name = c.series_label(series)
        points = " ".join(f"{_f(px(s))},{_f(py(v))}" for s, v in zip(series.steps, series.log2max))
        dots = "".join(f'<circle cx="{_f(px(s))}" cy="{_f(py(v))}" r="2.5"><title>{_e(name)}: step {s}, max '
                       f"{2.0 ** v:.3g}</title></circle>" for s, v in zip(series.steps, series.log2max))
        y = _PLOT_H + below + _LEGEND_ROW * k + 8
        out.append(f'<g class="series" fill="{colour}"><polyline points="{points}" fill="none" stroke="{colour}" '
                   f'stroke-width="1.5"/>{dots}<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + 24}" y2="{y}" '
                   f'stroke="{colour}" stroke-width="2"/><text x="{_LEFT + 30}" y="{y + 4}" fill="#1d1d1f">'
                   f"{_e(name)}</text></g>")
        if series.forecast_step is not None:
            out.append(_forecast(series, colour, x1, px, py))
    for w in h.warnings:
        x = px(w.step)
        out.append(f'<g class="warning" fill="{_WARN}"><title>{_e(f"step {w.step}: {w.detail}")}</title>'
                   f'<line x1="{_f(x)}" y1="{_TOP}" x2="{_f(x)}" y2="{bottom}" stroke="{_WARN}" stroke-opacity="0.35"/>'
                   f'<polygon points="{_f(x - 5)},{_TOP - 8} {_f(x + 5)},{_TOP - 8} {_f(x)},{_TOP}"/></g>')
    for k, track in enumerate(h.tracks):
        out.append(_track(track.name, track.steps, track.values, _PLOT_H + k * (_TRACK_H + _TRACK_GAP), px, right))
    out.append("</svg>")
    return "".join(out)


def _forecast(s: HeadroomSeries, colour: str, x1: int, px: Callable[[float], float],
              py: Callable[[float], float]) -> str:
    """The dashed segment from ``s``'s last sample to its forecast step at its limit, a ring there; cut at the
    axis' end ``x1`` when the forecast lies beyond it (its title says the step)."""
    assert s.forecast_step is not None
    sx, sy, top = s.steps[-1], s.log2max[-1], math.log2(s.limit)
    fx, fy = s.forecast_step, top
    if fx > x1:  # on the straight line to the forecast point, where it leaves the axis
        fx, fy = x1, sy + (top - sy) * (x1 - sx) / (s.forecast_step - sx)
    ring = f'<circle cx="{_f(px(fx))}" cy="{_f(py(fy))}" r="3.5" fill="none"/>' if fx == s.forecast_step else ""
    title = f"{c.series_label(s)}: its trend meets {s.limit:.6g} near step {s.forecast_step}"
    return (f'<g class="forecast" stroke="{colour}"><title>{_e(title)}</title><line x1="{_f(px(sx))}" '
            f'y1="{_f(py(sy))}" x2="{_f(px(fx))}" y2="{_f(py(fy))}" stroke-width="1.5" stroke-dasharray="5 4"/>'
            f"{ring}</g>")


def _track(name: str, steps: tuple[int, ...], values: tuple[float, ...], top: int, px: Callable[[float], float],
           right: int) -> str:
    """A panel ``_TRACK_H`` high at ``top`` (after a gap): a track's values over the chart's steps, a scale's on a
    log scale (it moves by factors of 2), its smallest and largest value at the left."""
    y0, y1 = top + _TRACK_GAP, top + _TRACK_GAP + _TRACK_H
    log = name == "scale" and min(values) > 0
    ys = [math.log2(v) for v in values] if log else list(values)
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-12:
        lo, hi = lo - 1.0, hi + 1.0

    def py(v: float) -> float:
        return y1 - 4 - (v - lo) / (hi - lo) * (_TRACK_H - 8)

    points = " ".join(f"{_f(px(s))},{_f(py(v))}" for s, v in zip(steps, ys))
    small, large = min(values), max(values)
    return (f'<g class="track" data-name="{_e(name)}"><rect x="{_LEFT}" y="{y0}" width="{right - _LEFT}" '
            f'height="{_TRACK_H}" fill="none" stroke="#ccc"/><polyline points="{points}" fill="none" '
            f'stroke="#444" stroke-width="1.2"/><text x="{_LEFT - 4}" y="{y0 + 10}" text-anchor="end" '
            f'fill="#666">{large:.3g}</text><text x="{_LEFT - 4}" y="{y1}" text-anchor="end" fill="#666">'
            f'{small:.3g}</text><text x="{right + 4}" y="{(y0 + y1) // 2 + 4}" fill="#1d1d1f">{_e(name)}'
            f"{' (log)' if log else ''}</text></g>")


def _y_ticks(lo: float, hi: float, py: Callable[[float], float], right: int) -> list[str]:
    """Grid lines and labels at powers of ten (at most 8: every other one, or sparser, over a wide range)."""
    first, last = math.ceil(lo / _LOG2_10), math.floor(hi / _LOG2_10)
    stride = max(1, math.ceil((last - first + 1) / 8))
    out = []
    for k in range(first, last + 1, stride):
        y = _f(py(k * _LOG2_10))
        out.append(f'<line x1="{_LEFT}" y1="{y}" x2="{right}" y2="{y}" stroke="#eee"/>'
                   f'<text x="{_LEFT - 4}" y="{y}" dy="4" text-anchor="end" fill="#666">{10.0 ** k:g}</text>')
    return out


def _x_ticks(x0: int, x1: int, px: Callable[[float], float], bottom: int) -> list[str]:
    """About six labelled steps, at a round stride (1, 2 or 5 times a power of ten)."""
    raw = (x1 - x0) / 6
    base = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    stride = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    stride = max(1.0, stride)
    out = []
    t = math.ceil(x0 / stride) * stride
    while t <= x1:
        x = _f(px(t))
        out.append(f'<line x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + 4}" stroke="#999"/>'
                   f'<text x="{x}" y="{bottom + 16}" text-anchor="middle" fill="#666">{int(t)}</text>')
        t += stride
    out.append(f'<text x="{(_LEFT + _W - _RIGHT) // 2}" y="{bottom + 30}" text-anchor="middle" fill="#666">step</text>')
    return out
