"""Measuring the autocast run against the float32 reference: per-tensor differences, module gains, and the decisions (classes flipped, regression errors)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..records import Decision, Regression, TensorDiff
from ._defaults import _WORST
from ._record import _Call, _Run


# ------------------------------------------------------------------ measuring


@dataclass
class _Measure:
    numel: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    scaled: float = 0.0
    n_out: int = 0
    absmax: float = 0.0  # largest finite magnitude in either run
    ref_absmax: float = 0.0
    underflow: int = 0
    ref_nonfinite: int = 0
    amp_nonfinite: int = 0
    shape_mismatch: bool = False

    def add(self, ref: torch.Tensor, amp: torch.Tensor, rtol: float, atol: float, per_row: bool = False) -> None:
        if ref.shape != amp.shape:
            self.shape_mismatch = True
            return
        # float64: the difference of two float32 copies is exact and the reductions reproducible.
        r, a = ref.double().flatten(), amp.double().flatten()
        self.numel += r.numel()
        if r.numel() == 0:
            return
        fr, fa = torch.isfinite(r), torch.isfinite(a)
        both = fr & fa
        same = ~fr & ~fa & ((r == a) | (torch.isnan(r) & torch.isnan(a)))  # the same NaN/Inf in both runs
        mismatch = ~(both | same)
        ar = r.abs()
        d = torch.where(both, (a - r).abs(), torch.zeros_like(r))
        ref_absmax = float(ar[fr].max()) if bool(fr.any()) else 0.0
        amp_absmax = float(a.abs()[fa].max()) if bool(fa.any()) else 0.0
        n_mismatch = int(mismatch.sum())
        if n_mismatch:
            max_abs = max_rel = scaled = math.inf
        else:
            max_abs = float(d.max())
            rel_mask = both & (ar > atol)
            max_rel = float((d[rel_mask] / ar[rel_mask]).max()) if bool(rel_mask.any()) else 0.0
            scaled = _row_scaled(d, ar, fr, ref.shape, atol) if per_row else max_abs / max(ref_absmax, atol)
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, max_rel)
        self.scaled = max(self.scaled, scaled)
        self.n_out += int(((d > atol + rtol * ar) & both).sum()) + n_mismatch
        self.absmax = max(self.absmax, ref_absmax, amp_absmax)
        self.ref_absmax = max(self.ref_absmax, ref_absmax)
        self.underflow += int((fr & (r != 0) & (a == 0)).sum())
        self.ref_nonfinite += int((~fr).sum())
        self.amp_nonfinite += int((~fa).sum())

    def diff(self, *, name: str, kind: str, limit: float, dtype: str, shape: Sequence[int], call_index: int = 0,
             module_class: str | None = None, input_scaled: float | None = None, depth: int = 0) -> TensorDiff:
        if self.amp_nonfinite:
            headroom: float | None = None
        else:
            headroom = math.inf if self.absmax == 0 else limit / self.absmax
        return TensorDiff(
            name=name, kind=kind, call_index=call_index, module_class=module_class, dtype=dtype,
            shape=tuple(int(s) for s in shape), numel=self.numel, max_abs=self.max_abs, max_rel=self.max_rel,
            scaled=self.scaled, out_of_tol=(self.n_out / self.numel) if self.numel else 0.0, headroom=headroom,
            underflow=self.underflow, ref_nonfinite=self.ref_nonfinite, amp_nonfinite=self.amp_nonfinite,
            ref_absmax=self.ref_absmax, input_scaled=input_scaled, depth=depth,
        )


def _row_scaled(d: torch.Tensor, ar: torch.Tensor, fr: torch.Tensor, shape: torch.Size, atol: float) -> float:
    """The largest error of a row (a vector along the last dimension; a tensor of fewer than 2 dimensions is one
    row) as a fraction of that row's own largest magnitude: a row sent to zero while another row is large has
    error 1, where the tensor's own largest magnitude would hide it."""
    width = shape[-1] if len(shape) >= 2 else d.numel()
    rows_d = d.reshape(-1, width).amax(dim=1)
    rows_r = torch.where(fr, ar, torch.zeros_like(ar)).reshape(-1, width).amax(dim=1)
    return float((rows_d / rows_r.clamp(min=atol)).max())


def _measure(refs: Sequence[torch.Tensor], amps: Sequence[torch.Tensor], rtol: float, atol: float,
             per_row: bool = False) -> _Measure:
    m = _Measure()
    if len(refs) != len(amps):
        m.shape_mismatch = True
    for r, a in zip(refs, amps):
        m.add(r, a, rtol, atol, per_row)
    return m


def _gain(out: float, inp: float) -> float:
    if math.isinf(out):
        return 0.0 if math.isinf(inp) else math.inf  # a carried non-finite value adds nothing
    return out - inp


def _introduced(gains: list[float], parents: list[int | None]) -> list[float]:
    """Each call's gain less its direct sub-calls' gains (see the module docstring), floored at 0."""
    children: list[float] = [0.0] * len(gains)
    for i, p in enumerate(parents):
        if p is not None:
            children[p] += gains[i]
    out: list[float] = []
    for g, c in zip(gains, children):
        own = g - c
        out.append(0.0 if math.isnan(own) or own < 0 else own)  # inf - inf: a sub-call made it non-finite
    return out


def _compare_modules(ref: _Run, amp: _Run, *, rtol: float, atol: float, limit: float, per_row: bool = False
                     ) -> tuple[list[TensorDiff], tuple[int, ...], list[str]]:
    amp_calls = {(c.name, c.call_index): c for c in amp.calls if c.outputs is not None}
    unmatched: list[str] = []
    matched: list[tuple[_Call, _Call]] = []
    position: dict[int, int] = {}  # ref call index -> position in ``matched``
    for i, rc in enumerate(ref.calls):
        ac = amp_calls.pop((rc.name, rc.call_index), None)
        if rc.outputs is None or ac is None or ac.outputs is None:
            unmatched.append(f"module call {rc.name or '<root>'}#{rc.call_index} (float32 run only)")
            continue
        position[i] = len(matched)
        matched.append((rc, ac))
    unmatched += [f"module call {n or '<root>'}#{k} (autocast run only)" for n, k in amp_calls]
    diffs: list[TensorDiff] = []
    gains: list[float] = []
    parents: list[int | None] = []
    for rc, ac in matched:
        assert rc.outputs is not None and ac.outputs is not None
        m_in = _measure(rc.inputs, ac.inputs, rtol, atol, per_row)
        m_out = _measure(rc.outputs, ac.outputs, rtol, atol, per_row)
        if m_in.shape_mismatch or m_out.shape_mismatch:
            unmatched.append(f"module call {rc.name or '<root>'}#{rc.call_index} (tensors differ in number or shape)")
        diffs.append(m_out.diff(name=rc.name, kind="module", call_index=rc.call_index, module_class=rc.module_class,
                                dtype=ac.dtypes[0] if ac.dtypes else "", limit=limit,
                                shape=rc.outputs[0].shape if rc.outputs else (), input_scaled=m_in.scaled,
                                depth=rc.depth))
        gains.append(_gain(m_out.scaled, m_in.scaled))
        p = rc.parent
        while p is not None and p not in position:  # the nearest enclosing call that was matched
            p = ref.calls[p].parent
        parents.append(None if p is None else position[p])
    introduced = _introduced(gains, parents)
    diffs = [dataclasses.replace(d, introduced=x) for d, x in zip(diffs, introduced)]
    ranking = tuple(sorted((i for i, x in enumerate(introduced) if x > 0), key=lambda i: (-introduced[i], i)))
    return diffs, ranking, unmatched


# ------------------------------------------------------------------ decisions


def _as_samples(x: torch.Tensor) -> torch.Tensor:
    """``(samples, classes)``: a 1-D output is one sample; with more than 2 dims the classes are dim 1
    (as for cross_entropy) and every other position is a sample, in row-major order."""
    if x.ndim == 1:
        return x.unsqueeze(0)
    if x.ndim == 2:
        return x
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def top_two(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: top-1 class, runner-up class, top score and margin (top-1 minus top-2 score), by :data:`TIE_RULE`.

    Ties are broken explicitly rather than relying on ``argmax``: among equal top scores the lowest
    class index wins. A row holding NaN has no class (-1) and a NaN margin."""
    x = scores.double()
    n, c = x.shape
    idx = torch.arange(c).expand(n, c)
    nan_row = torch.isnan(x).any(dim=1)
    filled = torch.where(torch.isnan(x), torch.full_like(x, -math.inf), x)
    top = filled.max(dim=1).values
    first = torch.where(filled == top[:, None], idx, torch.full_like(idx, c)).min(dim=1).values.clamp(max=c - 1)
    if c > 1:
        rest = filled.scatter(1, first[:, None], -math.inf)
        second_score = rest.max(dim=1).values
        second = torch.where(rest == second_score[:, None], idx, torch.full_like(idx, c)).min(dim=1).values
        second = second.clamp(max=c - 1)
        # Equal scores (inf == inf included) have a zero margin, not inf - inf.
        margin = torch.where(top == second_score, torch.zeros_like(top), top - second_score)
    else:
        second = torch.full_like(first, -1)
        margin = torch.full_like(top, math.inf)
    first = torch.where(nan_row, torch.full_like(first, -1), first)
    margin = torch.where(nan_row, torch.full_like(margin, math.nan), margin)
    return first, second, top, margin


def _classify(ref: torch.Tensor, amp: torch.Tensor, *, rtol: float, atol: float, nonfinite: Sequence[int] = ()
              ) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[Decision, ...]]:
    """Samples, flips, near-boundary samples and the decisions listed (flipped, ``nonfinite``, near the
    boundary). A sample whose autocast scores are non-finite (``nonfinite``) made no decision: it is listed as
    such and never counted as a flip, whatever class its NaN/Inf scores would give."""
    r, a = _as_samples(ref), _as_samples(amp)
    r_cls, r_second, r_top, r_margin = top_two(r)
    a_cls, _, a_top, a_margin = top_two(a)
    bad = set(nonfinite)
    flipped = [f and i not in bad for i, f in enumerate((r_cls != a_cls).tolist())]
    # Near the boundary: the reference's own top-2 margin is within the score tolerance.
    near = (r_margin < atol + rtol * r_top.abs()).tolist()
    decisions = tuple(
        Decision(index=i, ref_class=int(r_cls[i]), amp_class=int(a_cls[i]), ref_runner_up=int(r_second[i]),
                 ref_margin=float(r_margin[i]), amp_margin=float(a_margin[i]), ref_score=float(r_top[i]),
                 amp_score=float(a_top[i]), flipped=bool(flipped[i]), near_boundary=bool(near[i]))
        for i in range(r.shape[0]) if flipped[i] or near[i] or i in bad
    )
    return (r.shape[0], tuple(i for i, f in enumerate(flipped) if f), tuple(i for i, x in enumerate(near) if x),
            decisions)


def _regress(ref: torch.Tensor, amp: torch.Tensor) -> tuple[int, Regression]:
    r = ref.double().reshape(ref.shape[0] if ref.ndim else 1, -1)
    a = amp.double().reshape(r.shape)
    both = torch.isfinite(r) & torch.isfinite(a)
    same = (r == a) | (torch.isnan(r) & torch.isnan(a))
    err = torch.where(both, (a - r).abs(), torch.where(same, torch.zeros_like(r), torch.full_like(r, math.inf)))
    per_sample = err.max(dim=1).values if r.shape[1] else torch.zeros(r.shape[0], dtype=torch.float64)
    order = sorted(range(r.shape[0]), key=lambda i: (-float(per_sample[i]), i))[:_WORST]

    def extremes(t: torch.Tensor) -> tuple[float, float]:
        f = t[torch.isfinite(t)]
        return (float(f.min()), float(f.max())) if f.numel() else (math.nan, math.nan)

    (rmin, rmax), (amin, amax) = extremes(r), extremes(a)
    return r.shape[0], Regression(ref_min=rmin, ref_max=rmax, amp_min=amin, amp_max=amax,
                                  worst=tuple((i, float(per_sample[i])) for i in order))
