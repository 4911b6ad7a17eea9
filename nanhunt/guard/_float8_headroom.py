"""The headroom history of torchao float8 layers: the share of each cast's non-zero values that underflow to zero.

torchao 0.18's float8 training (``convert_to_float8_training``, ``Float8Linear``) scales every cast dynamically:
the scale is the format's maximum over the amax (of the tensor, or of each row along the GEMM's reduction dim
for the rowwise recipe), so nothing saturates, and its ``ScalingType`` holds only ``dynamic`` and ``disabled``
(no delayed or static scaling whose amax could run past the format's limit). What grows instead is the
underflow: once an outlier sets the amax, the small values of the same tensor (or row) land below half the
format's smallest subnormal and become exactly 0 (e4m3 for the forward's input and weight, e5m2 for the output
gradient).

On a sampled step a forward hook on each ``Float8Linear`` (found by its class's name: nanhunt never imports
torchao) casts the layer's input and weight as its config does, and a tensor hook on its output casts the
output gradient, all on the device; each cast is counted by the trace's own rule
(:func:`nanhunt.tracing._casts.measure_cast`: non-zero before the cast, zero after). The counts (zeros,
non-zeros, amax) wait on the device and join the headroom window's one host read. A model without float8 layers
gets no hook.

Judged per layer and operand: a warning when the share of non-zero values lost reaches :data:`UNDERFLOW_SHARE`,
or when the trend of the last samples (the output maxima's Theil-Sen fit, on log2 of the share) reaches it within
the Guard's horizon, once the share is at least :data:`~nanhunt.records.CastStats.STORY_SHARE`.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._dispatch import no_autocast
from .._util._subclass import plain_values
from .._util._text import dtype_name
from ..records import CastStats
from ..tracing._casts import measure_cast

__all__ = ["Float8Headroom", "UNDERFLOW_SHARE", "float8_layers"]

UNDERFLOW_SHARE = 0.10  # a cast that sends 10% of its non-zero values to 0 is warned about
_HISTORY = 24  # samples a layer's trend is fitted over (as the output maxima's)
_MIN_SAMPLES = 6
_FLOOR = 2.0 ** -24  # log2 of a share of 0 (one value in 16M: below anything a trend is judged from)
_EPS = 1e-12  # torchao's floor on the amax (float8_utils.EPS): a zero tensor's scale stays finite
# (operand, the config's cast field, the format when the config names none); each cast along its last dim when
# rowwise, as torchao's Float8Linear does (the input's and the output gradient's rows, the weight's along its
# input features: the GEMMs' reduction dims)
_ROLES = (("input", "cast_config_input", torch.float8_e4m3fn),
          ("weight", "cast_config_weight", torch.float8_e4m3fn),
          ("output gradient", "cast_config_grad_output", torch.float8_e5m2))

Fit = Callable[[deque[tuple[int, float, float]]], "tuple[float, float | None] | None"]
# what a judgement gives: Finding's fields (condition, module, detail, value, limit, forecast_step)
Found = tuple[str, str, str, float, float, int | None]


def _is_float8_linear(m: nn.Module) -> bool:
    return any(c.__name__ == "Float8Linear" for c in type(m).__mro__)


def float8_layers(names: Sequence[str], modules: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The ``Float8Linear`` layers among ``modules`` (of their class or a subclass), with their names."""
    return [(n, m) for n, m in zip(names, modules) if _is_float8_linear(m)]


def _cast(m: nn.Module, field: str, default: torch.dtype) -> tuple[torch.dtype, bool, bool] | None:
    """The layer's cast of one operand: (format, rowwise, scales rounded to a power of 2); None when it is not
    cast (``ScalingType.DISABLED``) or its config is not torchao's as nanhunt knows it."""
    config = getattr(m, "config", None)
    cc = getattr(config, field, None)
    if getattr(getattr(cc, "scaling_type", None), "value", None) != "dynamic":
        return None
    fmt = getattr(cc, "target_dtype", None)
    fmt = fmt if isinstance(fmt, torch.dtype) and fmt.is_floating_point and fmt.itemsize == 1 else default
    rowwise = getattr(getattr(cc, "scaling_granularity", None), "value", None) == "axiswise"
    return fmt, rowwise, bool(getattr(config, "round_scales_to_power_of_2", False))


def _measure(x: torch.Tensor, cast: tuple[torch.dtype, bool, bool]) -> torch.Tensor:
    """(zeros, non-zeros, amax) of casting ``x`` as torchao does, as one float32 tensor on its device."""
    fmt, rowwise, pow2 = cast
    with torch.no_grad(), no_autocast():
        a = x.abs()
        amax = a.amax(dim=-1, keepdim=True) if rowwise else a.max()
        scale = (torch.finfo(fmt).max / amax.double().clamp(min=_EPS)).float()
        if pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        fmax = torch.finfo(fmt).max
        scaled = x.float() * scale
        pending = measure_cast(scaled, scaled.clamp(-fmax, fmax).to(fmt))
        assert pending is not None and pending.counts is not None  # plain tensors of one shape
        return torch.stack([pending.counts[0].float(), (x != 0).sum().float(), amax.max().float()])


class Float8Headroom:
    """The underflow history of a model's float8 layers; see the module's docstring."""

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self.names = [n for n, _ in layers]
        self._modules = [m for _, m in layers]
        self._fwd = [functools.partial(self._on_forward, i) for i in range(len(layers))]
        self._handles: list[RemovableHandle] = []
        self._calls: list[tuple[int, torch.Tensor]] = []  # this step's (column, measured) per cast
        self._steps: list[tuple[int, list[int], torch.Tensor]] = []  # (step, columns, stacked) not read yet
        self._formats: dict[int, tuple[torch.dtype, bool]] = {}  # column -> (format, rowwise), as cast last
        self.history: dict[int, deque[tuple[int, float, float]]] = {}  # column -> (step, log2 share, amax)
        self._warned: set[int] = set()
        self.size = 0  # values the next read's tensor holds

    @classmethod
    def of(cls, names: Sequence[str], modules: Sequence[nn.Module]) -> Float8Headroom | None:
        """The history of these modules' float8 layers; None without any (nothing hooked, nothing paid)."""
        layers = float8_layers(names, modules)
        return cls(layers) if layers else None

    def begin(self) -> None:
        for m, fn in zip(self._modules, self._fwd):
            self._handles.append(m.register_forward_hook(fn))

    def discard(self) -> None:
        """Unhook, keeping nothing of the step not ended."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._calls = []

    def end(self, index: int) -> None:
        """The sampled step is done: its measurements wait, stacked on the device, for the window's read."""
        calls, self._calls = self._calls, []
        self.discard()
        by: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for c, t in calls:
            by.setdefault(t.device, []).append((c, t))
        for group in by.values():
            self._steps.append((index, [c for c, _ in group], torch.stack([t for _, t in group])))

    def _on_forward(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and torch.is_autocast_enabled():  # the cast Float8Linear.forward makes first
            x = x.to(torch.get_autocast_dtype("cuda"))
        for r, (_, field, default) in enumerate(_ROLES[:2]):
            t = x if r == 0 else getattr(module, "weight", None)
            self._add(3 * i + r, t, _cast(module, field, default))
        role = _cast(module, _ROLES[2][1], _ROLES[2][2])
        if role is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, 3 * i + 2, role))  # type: ignore[no-untyped-call]

    def _on_grad(self, column: int, cast: tuple[torch.dtype, bool, bool], grad: torch.Tensor | None) -> None:
        if self._handles:  # still the sampled step's backward
            self._add(column, grad, cast)

    def _add(self, column: int, t: Any, cast: tuple[torch.dtype, bool, bool] | None) -> None:
        v = plain_values(t.detach()) if isinstance(t, torch.Tensor) and t.is_floating_point() else None
        if cast is None or v is None or not v.numel():
            return
        self._formats[column] = cast[0], cast[1]
        self._calls.append((column, _measure(v, cast)))

    # ---------------------------------------------------------------- the window's read
    def pending(self, device: torch.device) -> torch.Tensor | None:
        """The window's measurements, flat on ``device`` for its one host read (``size`` values); None when
        there are none."""
        if not self._steps:
            self.size = 0
            return None
        flat = torch.cat([s.to(device).reshape(-1) for _, _, s in self._steps])
        self.size = flat.numel()
        return flat

    def judge(self, data: Sequence[float], horizon: int, fit: Fit) -> list[Found]:
        """The values ``pending`` gave, read back, into the history (a layer's calls in one step summed); then
        the warnings."""
        steps, self._steps = self._steps, []
        at = 0
        seen: dict[tuple[int, int], list[float]] = {}
        for step, columns, _ in steps:
            for c in columns:
                zeros, nonzero, amax = data[at:at + 3]
                at += 3
                got = seen.setdefault((step, c), [0.0, 0.0, 0.0])
                got[0], got[1], got[2] = got[0] + zeros, got[1] + nonzero, max(got[2], amax)
        for (step, c), (zeros, nonzero, amax) in sorted(seen.items()):
            if nonzero > 0:
                share = zeros / nonzero
                h = self.history.setdefault(c, deque(maxlen=_HISTORY))
                h.append((step, math.log2(max(share, _FLOOR)), amax))
        found = [f for c in sorted(self.history) if (f := self._judged(c, horizon, fit)) is not None]
        return sorted(found, key=lambda f: f[5] or 0)

    def _judged(self, c: int, horizon: int, fit: Fit) -> Found | None:
        h = self.history[c]
        last, y, amax = h[-1]
        share = 2.0 ** y
        if c in self._warned or share < CastStats.STORY_SHARE:
            return None
        at: int | None = None
        if share < UNDERFLOW_SHARE:
            got = fit(deque(((s, v, UNDERFLOW_SHARE) for s, v, _ in h), maxlen=_HISTORY)) \
                if len(h) >= _MIN_SAMPLES else None
            left = None if got is None else got[1]
            if left is None or left > horizon:
                return None
            at = int(last + max(left, 0.0))
        self._warned.add(c)
        name, role = self.names[c // 3], _ROLES[c % 3][0]
        fmt, rowwise = self._formats[c]
        fi = torch.finfo(fmt)
        # half the smallest subnormal rounds to 0 (ties to even): as a share of the amax, through its scale
        kept = fi.smallest_normal * fi.eps / 2 / fi.max
        when = (f"{share:.1%} of its non-zero values underflow to 0" if at is None else
                f"{share:.1%} of its non-zero values underflow to 0, rising to {UNDERFLOW_SHARE:.0%} near step {at:,}")
        whose = "the row's" if rowwise else "the tensor's"
        fix = (f'usual fixes: the rowwise recipe (Float8LinearConfig.from_recipe_name("rowwise"): one scale per row, '
               f"so one outlier row no longer sets the others' scale), or leave {name} out of float8 "
               f'(convert_to_float8_training(..., module_filter_fn=lambda mod, fqn: fqn != "{name}"))'
               if not rowwise else
               f"usual fix: leave {name} out of float8 (convert_to_float8_training(..., module_filter_fn=lambda "
               f'mod, fqn: fqn != "{name}")); a norm or clipping on the outlier feature')
        detail = (f"{name} float8 {role} cast: {when} in {dtype_name(fmt)} ({'rowwise' if rowwise else 'tensorwise'} "
                  f"scaling: values below {kept:.3g}x {whose} amax become 0; amax {amax:.3g}); {fix}")
        return "float8 underflow", name, detail, share, UNDERFLOW_SHARE, at

    def close(self) -> None:
        self.discard()
