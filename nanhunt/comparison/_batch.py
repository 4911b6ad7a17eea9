"""Comparing one batch, and the totals of a set of batches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._util._errors import InputError
from ..records import Comparison, Decision, Quality, Regression, Rule, TensorDiff
from ._defaults import _Rule, _WORST
from ._measure import _classify, _compare_modules, _measure, _regress
from ._record import _Run, _first_nonfinite
from ._variant import Variant
from ._rule import _Scored, _judge, _nonfinite_rows, _quality, _score, _targets_cpu, _user_metric


# ------------------------------------------------------------------ one batch


@dataclass
class _Candidate:
    """One run compared (an autocast dtype, or float8 layers in float8): its tolerances and the rule fields of its
    comparisons."""

    variant: Variant
    name: str
    rtol: float
    atol: float
    limit: float
    header: _Rule
    batches: list[Comparison] = field(default_factory=list)
    scored: list[_Scored | None] = field(default_factory=list)
    outputs: list[tuple[torch.Tensor, torch.Tensor, Any]] = field(default_factory=list)  # for a user metric

    @property
    def run(self) -> str:
        return self.variant.run_name()


def _compare_batch(ref: _Run, amp: _Run, cand: _Candidate, rule: Rule, *, floats: Sequence[torch.Tensor],
                   name: str, targets: Any, ref_allowed: Sequence[str], scale: float,
                   metric_fn: Callable[..., Any] | None, need_quality: bool) -> Comparison:
    """The autocast run of one batch against its reference: errors, decisions, quality, the rule on it alone."""
    rtol, atol, limit, rows = cand.rtol, cand.atol, cand.limit, cand.header["per_row"]
    task = rule.task
    amp_loss = float(amp.loss.double().sum())
    amp_bad, amp_allowed = _first_nonfinite(amp, floats, rule.allow_nonfinite)
    modules, ranking, unmatched = _compare_modules(ref, amp, rtol=rtol, atol=atol, limit=limit, per_row=rows)
    loss_diff = _measure([ref.loss], [amp.loss], rtol, atol, rows).diff(name="<loss>", kind="loss", limit=limit,
                                                                  dtype="float32", shape=tuple(ref.loss.shape))
    grads: list[TensorDiff] = []
    for g_name, g in ref.grads.items():
        ag = amp.grads.get(g_name)
        if ag is None:
            unmatched.append(f"gradient of {g_name} (float32 run only)")
            continue
        grads.append(_measure([g], [ag], rtol, atol, rows).diff(name=g_name, kind="grad", limit=limit, dtype="float32",
                                                         shape=tuple(g.shape)))
    unmatched += [f"gradient of {n} (autocast run only)" for n in amp.grads if n not in ref.grads]

    output: TensorDiff | None = None
    n_samples = 0
    flipped: tuple[int, ...] = ()
    near: tuple[int, ...] = ()
    decisions: tuple[Decision, ...] = ()
    regression: Regression | None = None
    if ref.output is not None and amp.output is not None:
        output = _measure([ref.output], [amp.output], rtol, atol, rows).diff(
            name="<output>", kind="output", limit=limit, dtype=amp.output_dtype, shape=tuple(ref.output.shape))
    usable = ref.output is not None and amp.output is not None and ref.output.ndim > 0 \
        and ref.output.shape == amp.output.shape
    if usable and task != "classify":  # the samples the quality and the failures name
        assert ref.output is not None
        n_samples = int(ref.output.shape[0])
    nonfinite = tuple(_nonfinite_rows(ref.output, amp.output, task)) if usable else ()
    if task != "none":
        if not usable:
            raise InputError(f"--task {task} needs the model to return its scores or predictions as a tensor with "
                               "a sample dimension (or a dict with 'logits'); this model returned none")
        assert ref.output is not None and amp.output is not None
        if task == "classify":
            n_samples, flipped, near, decisions = _classify(ref.output, amp.output, rtol=rtol, atol=atol,
                                                            nonfinite=nonfinite)
        else:
            n_samples, regression = _regress(ref.output, amp.output)

    scored: _Scored | None = None
    user: tuple[float, float, int] | None = None
    if rule.metric is not None and usable:
        assert ref.output is not None and amp.output is not None
        try:
            if metric_fn is not None:
                user = _user_metric(metric_fn, ref.output, amp.output, targets)
                cand.outputs.append((ref.output, amp.output, targets))
            else:
                scored = _score(rule.metric, ref.output, amp.output, targets)
        except InputError:
            if need_quality:
                raise
    if metric_fn is None:
        cand.scored.append(scored)
    quality = _quality(rule, scored, user)
    def sample(i: int) -> str:
        return f"{name}:{i}" if name else str(i)

    worse = [sample(i) for i in quality.worse] if quality is not None else []
    failures = _judge(rule, run=cand.run, ref_bad=None, amp_bad=amp_bad,
                      amp_rows=[sample(i) for i in nonfinite] if amp_bad else [],
                      flipped=[sample(i) for i in flipped], max_flips=rule.max_flips, task=task, output=output,
                      loss=loss_diff, quality=quality, worse=worse)
    allowed = [f"float32 reference: {w}" for w in ref_allowed] + [f"{cand.run}: {w}" for w in amp_allowed]
    return Comparison(
        **cand.header, accepted=not failures, violations=tuple(f.message for f in failures), reference_finite=True,
        amp_finite=amp_bad is None, amp_first_nonfinite=amp_bad, ref_loss=float(ref.loss.double().sum()),
        amp_loss=amp_loss, modules=tuple(modules), ranking=ranking, output=output, loss=loss_diff, grads=tuple(grads),
        n_samples=n_samples, flipped=flipped, near_boundary=near, nonfinite=nonfinite, decisions=decisions,
        regression=regression, unmatched=tuple(unmatched), failures=tuple(failures), quality=quality,
        allowed=tuple(allowed), batch=name,
    )


def _reference_failed(cand: _Candidate, rule: Rule, *, name: str, ref_bad: str, ref_loss: float) -> Comparison:
    failures = _judge(rule, run=cand.run, ref_bad=ref_bad, amp_bad=None, amp_rows=[], flipped=[], max_flips=0,
                      task=rule.task, output=None, loss=None, quality=None, worse=[])
    cand.scored.append(None)
    return Comparison(**cand.header, accepted=False, violations=tuple(f.message for f in failures),
                      failures=tuple(failures), reference_finite=False, reference_first_nonfinite=ref_bad,
                      amp_finite=None, ref_loss=ref_loss, batch=name)


# ------------------------------------------------------------------ a set: totals


def _merge(diffs: Sequence[TensorDiff]) -> TensorDiff:
    """One value over several batches: the largest errors, the smallest headroom, counts summed."""
    first = diffs[0]
    numel = sum(d.numel for d in diffs)

    def most(xs: Iterable[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return max(vals) if vals else None

    headrooms = [d.headroom for d in diffs]
    return dataclasses.replace(
        first, numel=numel, max_abs=max(d.max_abs for d in diffs), max_rel=max(d.max_rel for d in diffs),
        scaled=max(d.scaled for d in diffs),
        out_of_tol=sum(d.out_of_tol * d.numel for d in diffs) / numel if numel else 0.0,
        headroom=None if any(h is None for h in headrooms) else min(h for h in headrooms if h is not None),
        underflow=sum(d.underflow for d in diffs), ref_nonfinite=sum(d.ref_nonfinite for d in diffs),
        amp_nonfinite=sum(d.amp_nonfinite for d in diffs), ref_absmax=max(d.ref_absmax for d in diffs),
        input_scaled=most(d.input_scaled for d in diffs), introduced=most(d.introduced for d in diffs),
    )


def _merged(groups: Iterable[Sequence[TensorDiff]], key: Callable[[TensorDiff], Any]) -> list[TensorDiff]:
    """``groups`` (one list per batch) merged by ``key``, in the order each key first appears."""
    by: dict[Any, list[TensorDiff]] = {}
    for group in groups:
        for d in group:
            by.setdefault(key(d), []).append(d)
    return [_merge(ds) for ds in by.values()]


def _total_regression(regs: Sequence[tuple[Regression, int]]) -> Regression | None:
    """The regression extremes of a set: each batch's ``(regression, sample offset)``; None without any."""
    if not regs:
        return None

    def ext(f: Callable[[Regression], float], pick: Callable[..., float]) -> float:
        vals = [f(g) for g, _ in regs if not math.isnan(f(g))]
        return pick(vals) if vals else math.nan

    worst = sorted(((o + i, e) for g, o in regs for i, e in g.worst), key=lambda w: (-w[1], w[0]))[:_WORST]
    return Regression(ref_min=ext(lambda g: g.ref_min, min), ref_max=ext(lambda g: g.ref_max, max),
                      amp_min=ext(lambda g: g.amp_min, min), amp_max=ext(lambda g: g.amp_max, max),
                      worst=tuple(worst))


def _total_quality(cand: _Candidate, rule: Rule, metric_fn: Callable[..., Any] | None, done: Sequence[Comparison],
                   offsets: Sequence[int], at: int) -> Quality | None:
    """The quality of a set: the user metric on all outputs, else the built-in one on all scored samples."""
    if metric_fn is not None and cand.outputs:
        try:
            user = _user_metric(metric_fn, torch.cat([r for r, _, _ in cand.outputs]),
                                torch.cat([a for _, a, _ in cand.outputs]),
                                torch.cat([_targets_cpu(t) for _, _, t in cand.outputs]))
        except (RuntimeError, InputError):  # outputs that do not concatenate: the mean, weighted by samples
            qs = [b.quality for b in done if b.quality is not None]
            n = sum(q.n for q in qs) or 1
            user = (sum(q.ref * q.n for q in qs) / n, sum(q.amp * q.n for q in qs) / n, sum(q.n for q in qs))
        return _quality(rule, None, user)
    if metric_fn is None and any(s is not None for s in cand.scored):
        # a batch without scores (a non-finite reference) weighs nothing: its count stays 0
        ref_s, amp_s, count = (torch.zeros(at, dtype=torch.float64) for _ in range(3))
        ref_m, amp_m = (torch.zeros(at, dtype=torch.float64) for _ in range(2))
        for s, o in zip(cand.scored, offsets):
            if s is None:
                continue
            span = slice(o, o + s.count.numel())
            ref_s[span], amp_s[span], count[span] = s.ref, s.amp, s.count
            if s.ref_max is not None and s.amp_max is not None:
                ref_m[span], amp_m[span] = s.ref_max, s.amp_max
        return _quality(rule, _Scored(ref_s, amp_s, count, ref_m, amp_m), None)
    return None


def _total(cand: _Candidate, rule: Rule, metric_fn: Callable[..., Any] | None) -> Comparison:
    """The comparison of a whole set: every batch's, the rule applied to the totals."""
    bs = cand.batches
    done = [b for b in bs if b.reference_finite]
    offsets, at = [], 0
    for b in bs:
        offsets.append(at)
        at += b.n_samples

    def sample(i: int) -> str:
        b = next(k for k in range(len(bs)) if i < offsets[k] + bs[k].n_samples)
        return f"{bs[b].batch}:{i - offsets[b]}"

    def first(what: Callable[[Comparison], str | None]) -> str | None:
        return next((f"{b.batch}: {what(b)}" for b in bs if what(b) is not None), None)

    ref_bad = first(lambda b: b.reference_first_nonfinite)
    amp_bad = first(lambda b: b.amp_first_nonfinite)
    modules = _merged((b.modules for b in done), lambda d: (d.name, d.call_index))
    ranking = tuple(sorted((i for i, d in enumerate(modules) if (d.introduced or 0.0) > 0),
                           key=lambda i: (-(modules[i].introduced or 0.0), i)))
    grads = _merged((b.grads for b in done), lambda d: d.name)
    outputs = [b.output for b in done if b.output is not None]
    losses = [b.loss for b in done if b.loss is not None]
    flipped = tuple(o + i for b, o in zip(bs, offsets) for i in b.flipped)
    near = tuple(o + i for b, o in zip(bs, offsets) for i in b.near_boundary)
    nonfinite = tuple(o + i for b, o in zip(bs, offsets) for i in b.nonfinite)
    decisions = tuple(dataclasses.replace(d, index=o + d.index) for b, o in zip(bs, offsets) for d in b.decisions)
    regression = _total_regression([(b.regression, o) for b, o in zip(bs, offsets) if b.regression is not None])
    quality = _total_quality(cand, rule, metric_fn, done, offsets, at)
    loss_mean = [b.ref_loss for b in bs if b.ref_loss is not None]
    amp_mean = [b.amp_loss for b in done if b.amp_loss is not None]
    amp_rows = [f for b in done for x in b.failures if x.clause == "amp_finite" for f in x.samples]
    failures = _judge(rule, run=cand.run, ref_bad=None, amp_bad=amp_bad, amp_rows=amp_rows,
                      flipped=[sample(i) for i in flipped], max_flips=rule.max_flips, task=rule.task,
                      output=_merge(outputs) if outputs else None, loss=_merge(losses) if losses else None,
                      quality=quality, worse=[sample(i) for i in quality.worse] if quality is not None else [])
    if ref_bad is not None:
        failures = _judge(rule, run=cand.run, ref_bad=ref_bad, amp_bad=None, amp_rows=[], flipped=[],
                          max_flips=0, task=rule.task, output=None, loss=None, quality=None, worse=[]) + failures
    return Comparison(
        **cand.header, accepted=not failures, violations=tuple(f.message for f in failures),
        failures=tuple(failures), reference_finite=ref_bad is None, reference_first_nonfinite=ref_bad,
        amp_finite=None if not done else amp_bad is None, amp_first_nonfinite=amp_bad,
        ref_loss=sum(loss_mean) / len(loss_mean) if loss_mean else None,
        amp_loss=sum(amp_mean) / len(amp_mean) if amp_mean else None, modules=tuple(modules), ranking=ranking,
        output=_merge(outputs) if outputs else None, loss=_merge(losses) if losses else None, grads=tuple(grads),
        n_samples=at, flipped=flipped, near_boundary=near, nonfinite=nonfinite, decisions=decisions,
        regression=regression,
        unmatched=tuple(f"{b.batch}: {u}" for b in bs for u in b.unmatched), quality=quality,
        allowed=tuple(f"{b.batch}: {a}" for b in bs for a in b.allowed),
        absorbed=tuple(f"{b.batch}: {a}" for b in bs for a in b.absorbed), batches=tuple(bs),
    )
