"""The Guard's headroom history: how near each module's values come to their dtype's limit, and the warnings
that forecast an overflow while the run can still be saved.

On a sampled step (one in ``every``) a forward hook on every module, and a tensor hook on each output, reduce
the output and its gradient to their extremes on the device (``_magnitude``); the step's extremes are kept as one
stack, and at the window's read every sampled step's largest magnitudes (a max over a module's calls) go into one
row each of a preallocated device buffer. The buffer is read back once
it is full (one host read per ``READ_STEPS`` steps, or per sample when sampling is sparser), with the largest
magnitude of every parameter and optimizer state tensor. The loss, the gradient norm and the GradScaler's scale come every step
as host numbers the Guard read anyway. Nothing is hooked on an unsampled step.

What is judged on the host: per module, a Theil-Sen line through log2(max) against the step over the last
``HISTORY`` samples (robust to a noisy sample), the step where it meets the limit; robust z-scores of the
loss and the gradient norm; the scale's fall over a window. Each :class:`Finding` is given once per module
(or tensor) and condition.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._dispatch import foreach_norm, local_tensor
from .._util._limits import SQUARED_FROM, squared_limit
from .._util._text import dtype_name
from .._util._wrappers import user_modules
from ..records import HeadroomNote, HeadroomSeries
from ..tracing._tensors import tensors
from ._float8_headroom import Float8Headroom
from ._magnitude import Samples, extremes
from ._tracker import GuardTracker

__all__ = ["Finding", "Headroom", "READ_STEPS", "HISTORY", "PICTURED", "AUTO_EVERY", "AUTO_MAX", "AUTO_BUDGET"]

READ_STEPS = 64  # steps per host read of the device buffer (the samples they hold fill it)
AUTO_EVERY = 16  # headroom_every="auto": the first stride, and the shortest
AUTO_MAX = 32  # ... the longest (a trend needs _MIN_SAMPLES samples: 192 steps at 32)
AUTO_BUDGET = 0.01  # ... between them, the sampled steps' extra host time spread over the stride is 1% of a step
_clock = time.perf_counter
HISTORY = 24  # samples a module's trend is fitted over
_MIN_SAMPLES = 6  # no trend from fewer
_NEAR_BITS = 10  # an output or gradient is watched once it is within 2**10 = 1024x of its limit
_MIN_RISE_BITS = 1.0  # ... and the fitted line rose at least 2x over the samples fitted (not noise)
_STATE_NEAR = 16.0  # a weight or optimizer state within 16x of its dtype's limit
_SPIKE_WINDOW = 100  # steps of loss / gradient norm a spike is judged against
_SPIKE_MIN = 50  # ... once this many are known
_SPIKE_Z = 8.0  # robust z-score of a spike (median, 1.4826 * MAD), and at least twice the median
_SCALE_WINDOW = 200  # steps in which a GradScaler scale that backed off 4 times more than it grew is warned;
_SCALE_FALLS = 4  # a run of consecutive backoffs (the scale finding its level at the start) counts once
PICTURED = 6  # series a capture's picture holds: the modules nearest their limit
_OWN = 1024  # steps of loss, gradient norm and scale kept for its tracks
_TRACK_POINTS = 120  # ... drawn at most per track: longer ones in runs of consecutive steps
_NOTES = 20  # warnings it holds (each is given once per module and condition: the first ones say most)
_NOTE_TEXT = 500  # characters kept of each (a capture's event is read back bounded)

_FIX_GROWTH = ("usual fixes: a lower learning rate or a longer warmup, gradient clipping, weight decay; or run the "
               "step in bfloat16 (its range reaches 3.4e38), or keep this module in float32 (nanhunt.keep_fp32)")
_FIX_GROWTH_WIDE = ("usual fixes: a lower learning rate or a longer warmup, gradient clipping, weight decay, a norm "
                    "on the growing activation; float32 has the same range, so keeping the module in it does not help")
_FIX_SCALE = ("usual fixes: a lower learning rate or gradient clipping; the output gradient warnings name the "
              "module whose gradients grow")
_FIX_SPIKE = ("usual fixes: a lower learning rate or a longer warmup, gradient clipping; look at this step's batch "
              "(on_warn='capture' keeps it)")
_FIX_STATE = ("usual fixes: weight decay or a lower learning rate; keep the parameters and the optimizer state in "
              "float32 (autocast for the forward only)")


@dataclass(frozen=True)
class Finding:
    """One warning: ``condition`` is ``"output"``, ``"output gradient"``, ``"scale"``, ``"loss"``,
    ``"gradient norm"``, ``"weights"``, ``"optimizer state"`` or ``"float8 underflow"`` (the share of a float8
    layer's cast sent to zero, :mod:`._float8_headroom`); ``module`` the module (or parameter) it is about, None
    for the step's own numbers; ``value`` what was measured, ``limit`` the dtype's largest finite value (for float8
    underflow, the share that warns), ``forecast_step`` where the trend meets it."""

    condition: str
    module: str | None
    detail: str
    value: float | None = None
    limit: float | None = None
    forecast_step: int | None = None


class _Robust:
    """The last ``_SPIKE_WINDOW`` finite values; median and MAD recomputed every tenth value (the rest of the
    steps compare one number)."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=_SPIKE_WINDOW)
        self._stats: tuple[float, float] | None = None
        self._since = 0

    def spike(self, x: float | None) -> tuple[float, float, int] | None:
        """(median, z, values judged against) when ``x`` is a spike against the values before it; then records
        it."""
        if x is None or not math.isfinite(x):
            return None
        found = None
        if len(self.values) >= _SPIKE_MIN:
            if self._stats is None or self._since >= 10:
                # Python's median, not NumPy's: on 100 values it is the same number (the middle two averaged)
                # at a tenth of the cost, which on a clean step matters (NumPy's came to ~280 us after a step)
                med = statistics.median(self.values)
                self._stats, self._since = (med, 1.4826 * statistics.median([abs(v - med) for v in self.values])), 0
            med, spread = self._stats
            z = (x - med) / spread if spread > 0 else (math.inf if x > med else 0.0)
            if z >= _SPIKE_Z and x - med > abs(med):
                found = (med, z, len(self.values))
        self.values.append(x)
        self._since += 1
        return found


class Headroom:
    """The history of one Guard, and the findings it gives. ``every``: sample one step in ``every`` (None: no
    module history; the step's own numbers are still judged). ``horizon``: warn when the forecast overflow is at
    most this many steps ahead."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int | str | None,
                 horizon: int, device_type: str) -> None:
        if not (every is None or every == "auto" or (isinstance(every, int) and every >= 1)):
            raise ValueError(f"headroom_every must be 'auto', an int >= 1 or None, not {every!r}")
        if horizon < 1:
            raise ValueError("warn_horizon must be >= 1")
        # "auto": the stride starts at AUTO_EVERY and follows what a sampled step costs (see _timed)
        self._auto = every == "auto"
        self.every: int | None = AUTO_EVERY if isinstance(every, str) else every
        self.horizon, self.device_type = horizon, device_type
        self._next = 0  # "auto": the next step sampled
        self._t0: float | None = None  # "auto": when this step began (host clock)
        self._plain: deque[float] = deque(maxlen=16)  # "auto": host seconds of the last unsampled steps
        self._cost: deque[float] = deque(maxlen=4)  # ... and of the last sampled ones
        self._optimizer = optimizer
        named = list(user_modules(model).items())
        self.names = [name or "(model)" for name, _ in named]
        self._modules = [m for _, m in named]
        n = len(self._modules)
        self._fwd = [functools.partial(self._on_output, i) for i in range(n)]
        self._bwd = [functools.partial(self._on_grad, n + i) for i in range(n)]
        self._handles: list[RemovableHandle] = []
        self._active = False
        self._vals: list[torch.Tensor] = []
        self._idx: list[int] = []
        self._limit = [math.inf] * n  # this sample's limit per module: the smallest of its outputs' dtypes'
        self.rows = max(1, READ_STEPS // self.every) if self.every is not None else 1  # samples per host read
        self._buf: torch.Tensor | None = None  # (rows, 2n) on the device: outputs, then gradients
        self._samples = Samples()  # the sampled steps' extremes, into the buffer (on the device) at the window's read
        self._rows: list[tuple[int, float | None, list[float]]] = []  # (step, scale, limits) per buffered row
        # host history: (condition, module index) -> (step, log2 max, limit) of the last HISTORY samples
        self.history: dict[tuple[str, int], deque[tuple[int, float, float]]] = {}
        self._warned: set[tuple[str, str | None]] = set()
        # A capture's picture (HeadroomHistory's JSON), kept up as the history changes: the series nearest their
        # limit, rebuilt at each read and warning, and the first _NOTES warnings
        self._pictured: tuple[dict[str, Any], ...] = ()
        self._notes: tuple[dict[str, Any], ...] = ()
        self._loss, self._norm = _Robust(), _Robust()
        self._scales: deque[tuple[int, float]] = deque()  # (step, scale) of the last _SCALE_WINDOW steps
        self._moves: deque[tuple[int, int]] = deque()  # (step, -1 a separate backoff or +1 a growth) in the window
        self._fell_last = False  # the last step's scale was a backoff
        # (step, loss, gradient norm, scale) of the last _OWN steps, NaN where unknown: the picture's tracks (from
        # the first step of its series, _since), the tracker's numbers
        self._own: deque[tuple[float, float, float, float]] = deque(maxlen=_OWN)
        self._since = 0
        self.tracker: GuardTracker | None = None  # the run's tracker, given each window's numbers (guard.py)
        self.float8 = Float8Headroom.of(self.names, self._modules)  # None without float8 layers: no hook

    # ---------------------------------------------------------------- sampled steps
    def sampled(self, index: int) -> bool:
        if self._auto:
            return self.every is not None and index >= self._next
        return self.every is not None and index % self.every == 0

    def begin(self, index: int) -> None:
        """Hook every module for this step if it is sampled."""
        if self._auto:
            self._t0 = _clock()
        if self._active or not self.sampled(index):
            return
        self._next = index + (self.every or 1)
        self._active = True
        self._limit = [math.inf] * len(self._modules)
        for m, fn in zip(self._modules, self._fwd):
            self._handles.append(m.register_forward_hook(fn))
        if self.float8 is not None:
            self.float8.begin()

    def off(self) -> None:
        """No module history from now on (the step's own numbers are still judged)."""
        self.discard()
        self.every, self._auto = None, False

    def discard(self) -> None:
        """Unhook, keeping nothing of this step (it raised, or it ended); safe to call twice."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False
        self._vals, self._idx = [], []
        if self.float8 is not None:
            self.float8.discard()

    def end(self, index: int, scale: float | None) -> list[Finding]:
        """The sampled step's backward is done: its maxima into the buffer (on the device); when the buffer is
        full, the one host read and the findings. ``scale``: the GradScaler's scale its backward ran with."""
        if not self._active:
            self._timed(sampled=False)
            return []
        vals, idx = self._vals, self._idx
        if self.float8 is not None:
            self.float8.end(index)
        self.discard()
        if not vals:
            return []
        n2 = 2 * len(self._modules)
        dev = vals[0].device
        if self._buf is None or self._buf.device != dev:
            self._buf, self._rows, self._samples = torch.zeros((self.rows, n2), device=dev), [], Samples()
        with torch.no_grad():
            self._samples.add(vals, idx)  # one stack: the buffer's row is written at the window's read
        self._rows.append((index, scale, list(self._limit)))
        findings: list[Finding] = []
        if len(self._rows) >= self.rows:
            findings = self._given(index, self.read())  # the picture redrawn there when it warned
            if not findings:
                self._picture()
            if self.tracker is not None:
                self._tracked(index)
        self._timed(sampled=True)
        return findings

    def _timed(self, *, sampled: bool) -> None:
        """At "auto", the step's host time (from its start to its checks, which waited for the device) into the
        sampled or the unsampled ones; after a sampled step, the stride that spreads its extra time to
        AUTO_BUDGET of a step, between AUTO_EVERY and AUTO_MAX."""
        if not self._auto or self._t0 is None or self.every is None:
            return
        (self._cost if sampled else self._plain).append(_clock() - self._t0)
        self._t0 = None
        if sampled and len(self._plain) >= 4:
            plain = statistics.median(self._plain)
            # the mean of the last 4 samples, not their median: the sample that fills the buffer (one in
            # READ_STEPS // AUTO_EVERY = 4) reads the window back too, and the budget counts that read
            extra = statistics.fmean(self._cost) - plain
            want = math.ceil(extra / (AUTO_BUDGET * plain)) if plain > 0 else AUTO_MAX
            self.every = min(AUTO_MAX, max(AUTO_EVERY, want))

    def _on_output(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active:
            return
        # A float32 region (nanhunt.keep_fp32) ran without autocast; its hook runs outside it, so ask the module.
        cast = (None if getattr(module.__dict__.get("forward"), "__nanhunt_fp32__", False)
                else torch.get_autocast_dtype(self.device_type) if torch.is_autocast_enabled(self.device_type)
                else None)
        grads = torch.is_grad_enabled()
        cap = math.inf if cast is None else _room(cast)
        for t in tensors(output):
            if not t.is_floating_point() or not t.numel():
                continue
            limit = _room(t.dtype)
            if t.dtype != torch.float64:
                limit = min(limit, cap)
            self._limit[i] = min(self._limit[i], limit)
            # detached: the extremes hold no graph (nor the output); made magnitudes at the step's end, together
            self._vals += extremes(local_tensor(t).detach())
            self._idx.append(i)
            if t.requires_grad and grads:
                t.register_hook(self._bwd[i])  # type: ignore[no-untyped-call]

    def _on_grad(self, j: int, grad: torch.Tensor | None) -> None:
        # None: an output whose gradient DDP's reducer or the autograd engine left undefined
        if self._active and grad is not None and grad.numel():
            self._vals += extremes(local_tensor(grad).detach())
            self._idx.append(j)

    # ---------------------------------------------------------------- the window's read
    def read(self) -> list[Finding]:
        """Read the buffered samples (and the weights' and optimizer state's largest magnitudes) back in one
        host read, add them to the history, and judge it."""
        if self._buf is None or not self._rows:
            return []
        with torch.no_grad():
            self._samples.fill(self._buf, len(self._rows) - len(self._samples))
        rows, self._rows = self._rows, []
        states = self._state_tensors()
        with torch.no_grad():
            dev = self._buf.device
            parts = [self._buf[: len(rows)].reshape(-1)]
            # one fused max-norm per (device, dtype): states come grouped so (see _state_tensors)
            for group in _groups([local_tensor(t.detach()) for _, t in states]):
                parts.append(torch.stack(foreach_norm(group, math.inf, dtype=torch.float32)).to(dev))
            f8 = self.float8.pending(dev) if self.float8 is not None else None
            data: list[float] = torch.cat(parts if f8 is None else [*parts, f8]).tolist()  # the one host read
        n = len(self._modules)
        for r, (step, scale, limits) in enumerate(rows):
            for i in range(n):
                for cond, v in (("output", data[r * 2 * n + i]), ("output gradient", data[r * 2 * n + n + i])):
                    if cond == "output gradient" and scale:
                        v /= scale  # the true gradient, whatever the loss scale
                    if v > 0 and math.isfinite(v) and math.isfinite(limits[i]):
                        h = self.history.setdefault((cond, i), deque(maxlen=HISTORY))
                        h.append((step, math.log2(v), limits[i]))
        # the nearest overflow first; of modules sharing an output (a container and its last child), the innermost
        # With a GradScaler the scale keeps the gradients in range, however they grow: its steady fall is the
        # warning then, not a gradient's trend (its history is kept, unscaled).
        scaled = rows[-1][1] is not None
        findings = sorted((f for key in self.history
                           if not (scaled and key[0] == "output gradient") and (f := self._trend(*key)) is not None),
                          key=lambda f: (f.forecast_step or 0, -_depth(f.module)))
        offset = len(rows) * 2 * n
        for k, (what, t) in enumerate(states):
            f = self._state(what, t.dtype, data[offset + k])
            if f is not None:
                findings.append(f)
        if self.float8 is not None and f8 is not None:
            findings += [Finding(*f) for f in self.float8.judge(data[len(data) - f8.numel():], self.horizon, _fit)]
        return findings

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and optimizer state tensor with its name, grouped by (device, dtype). Names are
        looked up at each read (once a window): a parameter replaced since the Guard began keeps its name."""
        names = {id(p): pn if name == "(model)" else f"{name}.{pn}"
                 for name, m in zip(self.names, self._modules) for pn, p in m.named_parameters(recurse=False)}
        out: list[tuple[str, torch.Tensor]] = []
        for g in self._optimizer.param_groups:
            for p in g["params"]:
                name = names.get(id(p), "a parameter the optimizer updates outside the model")
                if p.is_floating_point() and p.numel():
                    out.append((f"{name}", p))
                for k, s in self._optimizer.state.get(p, {}).items():
                    if isinstance(s, torch.Tensor) and s.is_floating_point() and s.numel() > 1:
                        out.append((f"{k} of {name}", s))
        keyed = [((local_tensor(t).device, t.dtype), n, t) for n, t in out]
        order = {k: i for i, k in enumerate(dict.fromkeys(k for k, _, _ in keyed))}
        return [(n, t) for _, n, t in sorted(keyed, key=lambda knt: order[knt[0]])]

    def _trend(self, cond: str, i: int) -> Finding | None:
        name = self.names[i]
        h = self.history[(cond, i)]
        if len(h) < _MIN_SAMPLES or (cond, name) in self._warned:
            return None
        last, y, limit = h[-1]
        if math.log2(limit) - y > _NEAR_BITS:
            return None
        fit = _fit(h)
        if fit is None:
            return None
        slope, left = fit
        if left is None or left > self.horizon:
            return None
        self._warned.add((cond, name))
        at = int(last + max(left, 0.0))
        value = 2.0 ** y
        detail = (f"{name} {cond}: max {_num(value)} (headroom {_num(limit / value)}x to {_limit_name(limit)}), "
                  f"growing {_num(_per_100(slope))}x per 100 steps: overflow expected near step {at:,}; "
                  f"{_FIX_GROWTH if limit < SQUARED_FROM else _FIX_GROWTH_WIDE}")
        return Finding(cond, name, detail, value, limit, at)

    def _state(self, what: str, dtype: torch.dtype, value: float) -> Finding | None:
        limit = _limit_of(dtype)
        cond = "weights" if " of " not in what else "optimizer state"
        if not (math.isfinite(value) and value * _STATE_NEAR >= limit) or (cond, what) in self._warned:
            return None
        self._warned.add((cond, what))
        detail = (f"{what}: max |x| {_num(value)} (headroom {_num(limit / value)}x to {dtype_name(dtype)}); "
                  f"{_FIX_STATE}")
        return Finding(cond, what, detail, value, limit)

    # ---------------------------------------------------------------- a capture's picture
    def _given(self, index: int, found: list[Finding]) -> list[Finding]:
        """``found``, kept for the picture (the first ``_NOTES``) with the step it was given at."""
        if found:
            self._notes += tuple(HeadroomNote(index, f.condition, f.module, f.detail[:_NOTE_TEXT]).to_dict()
                                 for f in found[: _NOTES - len(self._notes)])
            self._picture()  # the warned first
        return found

    def _picture(self) -> None:
        """The ``PICTURED`` series nearest their limit (those warned about first), from the history."""
        warned = {(n["condition"], n["module"]) for n in self._notes}

        def nearest(key: tuple[str, int]) -> tuple[bool, float]:
            _, y, limit = self.history[key][-1]
            return (key[0], self.names[key[1]]) not in warned, math.log2(limit) - y

        series = []
        for cond, i in sorted(self.history, key=nearest)[:PICTURED]:
            h = self.history[(cond, i)]
            fit = _fit(h) if len(h) >= _MIN_SAMPLES else None
            left = None if fit is None else fit[1]
            series.append(HeadroomSeries(
                self.names[i], cond, h[-1][2], tuple(s for s, _, _ in h), tuple(round(v, 4) for _, v, _ in h),
                growth=None if fit is None else _per_100(fit[0]),
                forecast_step=None if left is None else int(h[-1][0] + max(left, 0.0))).to_dict())
        self._pictured = tuple(series)
        self._since = min((s["steps"][0] for s in series), default=0)

    def picture(self, step: int) -> dict[str, Any] | None:
        """What a capture at ``step`` holds of the history, as plain JSON (``HeadroomHistory.to_dict()``): the
        ``PICTURED`` series nearest their limit as the host holds them, and the warnings given, with the tracks of
        the loss, gradient norm and scale up to ``step``; None when there is neither series nor warning. No device
        read: the samples taken since the last read-back are not in it. Kept up as the
        history changes, so that a capture (on the failure path, which Ctrl-C tests replay line by line) builds
        one dict whatever the history holds."""
        tracks = _tracks(self._own, self._since)  # up to this step: host numbers; the same lines whatever they hold
        kept = self._pictured or self._notes
        return {"step": step, "series": self._pictured, "warnings": self._notes, "tracks": tracks} if kept else None

    def _tracked(self, index: int) -> None:
        """The window just read, to the run's tracker: the pictured series and the step's own numbers."""
        assert self.tracker is not None
        at, loss, norm, scale = self._own[-1] if self._own else (-1.0, math.nan, math.nan, math.nan)
        if at != index:  # no numbers of this step (observe runs before each window read)
            loss = norm = scale = math.nan
        self.tracker.window(index, self._pictured, loss=loss, grad_norm=norm, scale=scale)

    # ---------------------------------------------------------------- every step
    def observe(self, index: int, *, loss: float | None, grad_norm: float | None,
                scale: float | None) -> list[Finding]:
        """The step's own numbers (host floats the Guard read anyway): spikes, and a scale falling steadily."""
        self._own.append((index, math.nan if loss is None else loss, math.nan if grad_norm is None else grad_norm,
                          math.nan if scale is None else scale))
        out: list[Finding] = []
        for cond, robust, x in (("loss", self._loss, loss), ("gradient norm", self._norm, grad_norm)):
            spike = robust.spike(x)
            if spike is not None and (cond, None) not in self._warned:
                self._warned.add((cond, None))
                assert x is not None
                med, z, n = spike
                out.append(Finding(cond, None, f"{cond} spike: {_num(x)} against a median of {_num(med)} over the "
                                   f"last {n} steps (robust z-score {z:.3g}); {_FIX_SPIKE}", x))
        if scale is not None and math.isfinite(scale):
            prev = self._scales[-1][1] if self._scales else None
            fell = prev is not None and scale < prev
            if prev is not None and scale != prev:
                self._scales.append((index, scale))
                if not (fell and self._fell_last):
                    self._moves.append((index, -1 if fell else 1))
            elif prev is None:
                self._scales.append((index, scale))
            self._fell_last = fell
            while len(self._scales) > 1 and self._scales[1][0] <= index - _SCALE_WINDOW:
                self._scales.popleft()  # the first kept is the scale in use _SCALE_WINDOW steps ago
            while self._moves and self._moves[0][0] <= index - _SCALE_WINDOW:
                self._moves.popleft()
            falls = -sum(d for _, d in self._moves)
            if falls >= _SCALE_FALLS and ("scale", None) not in self._warned:
                self._warned.add(("scale", None))
                high = max(s for _, s in self._scales)
                out.append(Finding("scale", None, f"GradScaler's scale fell {high / scale:.3g}x in the last "
                                   f"{_SCALE_WINDOW} steps ({high:,g} -> {scale:,g}), backing off {falls} times "
                                   f"more than it grew, each after steps that did not overflow: the gradients "
                                   f"are growing into the float16 range; {_FIX_SCALE}", scale))
        return self._given(index, out)

    def close(self) -> None:
        self.discard()


def _fit(h: deque[tuple[int, float, float]]) -> tuple[float, float | None] | None:
    """A Theil-Sen line through a history's (step, log2 max), robust to a noisy sample: its slope in bits per step,
    and the steps left until it (or the last sample, when above it) meets the limit, None when it did not rise
    2x over the samples; None when no two samples are steps apart."""
    x = np.array([s for s, _, _ in h], dtype=np.float64)
    y = np.array([v for _, v, _ in h], dtype=np.float64)
    ii, jj = np.triu_indices(len(x), 1)
    dx = x[jj] - x[ii]
    keep = dx > 0
    if not keep.any():
        return None
    slope = float(np.median((y[jj] - y[ii])[keep] / dx[keep]))
    if slope <= 0 or slope * (x[-1] - x[0]) < _MIN_RISE_BITS:
        return slope, None
    fitted = float(np.median(y - slope * x)) + slope * x[-1]
    return slope, (math.log2(h[-1][2]) - max(fitted, float(y[-1]))) / slope


def _tracks(own: deque[tuple[float, float, float, float]], since: int) -> tuple[dict[str, Any], ...]:
    """The loss, gradient norm and scale of the steps in ``own`` from step ``since`` on, as ``HeadroomTrack`` dicts
    (their finite values; over ``_TRACK_POINTS`` of them, that many runs of consecutive steps, each its last step
    and its largest value, a scale its smallest: a spike or a backoff stays in the picture). Array operations
    only: on a capture's path it runs the same lines whatever the history holds."""
    rows = np.array(own, dtype=np.float64).reshape(-1, 4)
    made = (_track(rows, k, name, since) for k, name in ((1, "loss"), (2, "gradient norm"), (3, "scale")))
    return tuple(t for t in made if t is not None)


def _track(rows: np.ndarray[Any, Any], k: int, name: str, since: int) -> dict[str, Any] | None:
    keep = (rows[:, 0] >= since) & np.isfinite(rows[:, k])
    steps, values = rows[keep, 0].astype(np.int64), rows[keep, k]
    n = len(values)
    starts = np.linspace(0, n, min(n, _TRACK_POINTS), endpoint=False).astype(np.int64)
    ends = np.append(starts[1:], n).astype(np.int64) - 1
    thin = (np.minimum if name == "scale" else np.maximum).reduceat(values, starts) if n else values
    # HeadroomTrack's dict, written directly: its checks would loop over the values in Python
    return {"name": name, "steps": tuple(steps[ends].tolist()), "values": tuple(thin.tolist())} if n else None


def _per_100(slope: float) -> float:
    """The factor a slope in bits per step makes over 100 steps (capped below float's overflow)."""
    return float(2.0 ** min(slope * 100, 1023.0))


def _depth(name: str | None) -> int:
    return -1 if name in (None, "(model)") else (name or "").count(".")


def _groups(ts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``ts`` cut into runs of one (device, dtype), in order."""
    out: list[list[torch.Tensor]] = []
    for t in ts:
        if out and (out[-1][0].device, out[-1][0].dtype) == (t.device, t.dtype):
            out[-1].append(t)
        else:
            out.append([t])
    return out


_LIMITS: dict[torch.dtype, float] = {}


def _limit_of(dtype: torch.dtype) -> float:
    limit = _LIMITS.get(dtype)
    if limit is None:
        limit = _LIMITS[dtype] = float(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf
    return limit


def _room(dtype: torch.dtype) -> float:
    """The largest magnitude a module's output or gradient of ``dtype`` is judged against: any of them may be
    squared on its way (a norm's variance, the x ** 3 of GELU's tanh approximation and its backward's 3 x ** 2),
    so a wide dtype's at its limit's square root (:func:`nanhunt._util._limits.squared_limit`, the rule the
    report's op table judges a squared input by)."""
    return squared_limit(_limit_of(dtype))


def _limit_name(limit: float) -> str:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        if limit == _limit_of(dtype):
            return dtype_name(dtype)
        if limit == _room(dtype):
            return f"{_num(limit)}, where its square overflows {dtype_name(dtype)}"
    return f"{limit:.3g}"


def _num(x: float) -> str:
    """``21,400``, ``3.5``, ``3.39e+38``: three significant digits, thousands grouped."""
    if not math.isfinite(x) or abs(x) >= 1e7 or (x != 0 and abs(x) < 1e-3):
        return f"{x:.3g}"
    r = float(f"{x:.3g}")
    return f"{r:,.0f}" if abs(r) >= 1000 else f"{r:.3g}"
