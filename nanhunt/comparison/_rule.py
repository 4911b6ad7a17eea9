"""The acceptance rule, fixed before the run; the quality it scores; judging a run against it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._util._errors import InputError
from ..records import Failure, Quality, Rule, TensorDiff
from ._defaults import TASKS, _WORST
from ._measure import _as_samples, top_two


# ------------------------------------------------------------------ the rule, fixed first

_METRICS = ("accuracy", "mse")
_RULE_KEYS = tuple(f.name for f in dataclasses.fields(Rule))
_NUMBERS = {"rtol": True, "atol": True, "max_quality_drop": True, "min_quality": False}  # key: must be >= 0


def rule_from(d: Mapping[str, Any], *, where: str = "the rule") -> Rule:
    """A :class:`~nanhunt.records.Rule` from a JSON object (a ``--rule`` file), every key and value checked:
    an unknown key (a typo would silently drop a clause) or a value of the wrong type is an error."""
    if not isinstance(d, Mapping):
        raise InputError(f"{where} is a {type(d).__name__}, not a JSON object of the rule's clauses")
    unknown = sorted(str(k) for k in d if k not in _RULE_KEYS)
    if unknown:
        raise InputError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; a rule has "
                           f"{', '.join(_RULE_KEYS)}")
    kw: dict[str, Any] = {}
    for k, v in d.items():
        def bad(expected: str) -> InputError:
            return InputError(f"{where}: {k} is {v!r}, expected {expected}")

        if v is None and k in ("metric", "higher_is_better", *_NUMBERS):
            kw[k] = None
        elif k == "task":
            if v not in TASKS:
                raise bad(f"one of {', '.join(TASKS)}")
            kw[k] = v
        elif k == "metric":
            if not isinstance(v, str) or not v:
                raise bad("'accuracy', 'mse' or 'package.module:fn'")
            kw[k] = v
        elif k in ("higher_is_better", "fail_on_tolerance"):
            if not isinstance(v, bool):
                raise bad("true or false")
            kw[k] = v
        elif k == "max_flips":
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad("an integer >= 0")
            kw[k] = v
        elif k in _NUMBERS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (_NUMBERS[k] and v < 0):
                raise bad("a finite number" + (" >= 0" if _NUMBERS[k] else "") + " or null")
            kw[k] = float(v)
        elif k == "allow_nonfinite":
            if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
                raise bad("a list of module names ('<root>': the model's own code, '<input>': the batch)")
            kw[k] = tuple(v)
    return Rule(**kw)


def settle_rule(rule: Rule, metric: str | Callable[..., Any] | None = None
                ) -> tuple[Rule, Callable[..., Any] | None]:
    """The rule as it is printed and hashed, with what it leaves to defaults made explicit: the quality metric
    of its task (``classify``: accuracy, ``regress``: mse) and which way the metric improves; and the user's
    metric function. ``metric`` is a name (``"accuracy"``, ``"mse"``, ``"package.module:fn"``, imported as
    given: a name you typed is trusted) or a function ``fn(outputs, targets) -> float``, higher is better
    unless the rule or ``fn.higher_is_better`` says otherwise."""
    rule = rule_from(rule.to_dict(), where="the rule")  # the same checks as a file's
    name, fn = rule.metric, None
    if metric is not None:
        given = metric if isinstance(metric, str) else f"{metric.__module__}:{metric.__qualname__}"
        if name is not None and name != given:
            raise InputError(f"the rule measures {name!r} but the metric given is {given!r}; give one")
        name = given
        fn = None if isinstance(metric, str) else metric
    if name is None:
        name = {"classify": "accuracy", "regress": "mse"}.get(rule.task)
    if name is not None and name not in _METRICS and fn is None:
        from ..capture.capture import resolve

        fn = resolve(name, what="quality metric", trusted=True)
    hib = rule.higher_is_better
    if name in _METRICS:
        natural = name == "accuracy"
        if hib is not None and hib != natural:
            raise InputError(f"{name} is {'higher' if natural else 'lower'} is better; the rule says otherwise")
        hib = natural
    elif name is None:
        hib = None
    elif hib is None:
        hib = bool(getattr(fn, "higher_is_better", True))
    if name is None and (rule.max_quality_drop is not None or rule.min_quality is not None):
        raise InputError("a quality clause (max_quality_drop, min_quality) needs a metric: --task classify "
                           "(accuracy), --task regress (mse) or --metric package.module:fn")
    return dataclasses.replace(rule, metric=name, higher_is_better=hib), fn


# ------------------------------------------------------------------ quality


@dataclass
class _Scored:
    """One batch's quality per sample, so that a set's total is exact: quality = sum(ref) / sum(count).
    accuracy: 1 right / 0 wrong, count 1 (0: no target); mse: the sample's sum of squared errors and its
    number of elements, and its largest |output - target|."""

    ref: torch.Tensor
    amp: torch.Tensor
    count: torch.Tensor
    ref_max: torch.Tensor | None = None
    amp_max: torch.Tensor | None = None


def _targets_cpu(targets: Any) -> torch.Tensor:
    if not isinstance(targets, torch.Tensor):
        raise InputError("the quality metric needs the batch's targets as a tensor; this batch has "
                           + ("none" if targets is None else f"a {type(targets).__name__}"))
    return targets.detach().cpu()


def _score(metric: str, ref: torch.Tensor, amp: torch.Tensor, targets: Any) -> _Scored:
    t = _targets_cpu(targets)
    if metric == "accuracy":
        r, a = _as_samples(ref), _as_samples(amp)
        if t.is_floating_point() and tuple(t.shape) == tuple(ref.shape):  # one-hot or probabilities
            labels = top_two(_as_samples(t.float()))[0]
        elif not t.is_floating_point() and t.numel() == r.shape[0]:
            labels = t.reshape(-1).long()
        else:
            raise InputError(f"accuracy needs targets as class indices ({r.shape[0]} of them) or scores shaped "
                               f"like the output {list(ref.shape)}; the targets are {t.dtype} {list(t.shape)}")
        valid = labels >= 0  # -100 and the like: ignored, as cross_entropy's ignore_index
        count = valid.double()
        return _Scored(((top_two(r)[0] == labels) & valid).double(), ((top_two(a)[0] == labels) & valid).double(),
                       count)
    if t.numel() != ref.numel():
        raise InputError(f"mse needs targets with as many elements as the output {list(ref.shape)}; the targets "
                           f"are {list(t.shape)}")
    n = ref.shape[0] if ref.ndim else 1
    tt = t.double().reshape(n, -1)
    r, a = ref.double().reshape(n, -1) - tt, amp.double().reshape(n, -1) - tt
    count = torch.full((n,), float(tt.shape[1]), dtype=torch.float64)
    ref_max = r.abs().max(dim=1).values if tt.shape[1] else torch.zeros(n, dtype=torch.float64)
    amp_max = a.abs().max(dim=1).values if tt.shape[1] else torch.zeros(n, dtype=torch.float64)
    return _Scored(r.square().sum(dim=1), a.square().sum(dim=1), count, ref_max, amp_max)


def _quality(rule: Rule, scored: _Scored | None, user: tuple[float, float, int] | None) -> Quality | None:
    """The quality of both runs from their per-sample scores (or the user's metric's two values)."""
    name, hib = rule.metric, rule.higher_is_better is not False
    if name is None:
        return None
    if user is not None:
        return Quality(metric=name, higher_is_better=hib, ref=user[0], amp=user[1], n=user[2])
    if scored is None:
        return None
    total = float(scored.count.sum())
    ref = float(scored.ref.sum()) / total if total else math.nan
    amp = float(scored.amp.sum()) / total if total else math.nan
    if name == "accuracy":
        worse = tuple(int(i) for i in torch.nonzero((scored.count > 0) & (scored.ref > scored.amp)).flatten())
        return Quality(metric=name, higher_is_better=True, ref=ref, amp=amp, n=int(total), worse=worse)
    growth = torch.nan_to_num((scored.amp - scored.ref) / scored.count.clamp(min=1), nan=math.inf)
    order = sorted((i for i in range(growth.numel()) if float(growth[i]) > 0), key=lambda i: (-float(growth[i]), i))
    assert scored.ref_max is not None and scored.amp_max is not None
    return Quality(metric=name, higher_is_better=False, ref=ref, amp=amp, n=int(scored.count.numel()),
                   ref_max_error=float(scored.ref_max.max()) if scored.ref_max.numel() else 0.0,
                   amp_max_error=float(scored.amp_max.max()) if scored.amp_max.numel() else 0.0,
                   worse=tuple(order[:_WORST]))


def _user_metric(fn: Callable[..., Any], ref: torch.Tensor, amp: torch.Tensor, targets: Any) -> tuple[float, float, int]:
    t = targets.detach().cpu() if isinstance(targets, torch.Tensor) else targets
    return float(fn(ref, t)), float(fn(amp, t)), int(ref.shape[0]) if ref.ndim else 1


# ------------------------------------------------------------------ judging


_NAMED = 20  # samples a failure's message names; ``Failure.samples`` holds them all


def _samples_text(ids: Sequence[str]) -> str:
    head = ", ".join(ids[:_NAMED]) + (f", ... ({len(ids) - _NAMED} more)" if len(ids) > _NAMED else "")
    return f"sample{'s' if len(ids) != 1 else ''} {head}"


def _judge(rule: Rule, *, run: str, ref_bad: str | None, amp_bad: str | None, amp_rows: Sequence[str],
           flipped: Sequence[str], max_flips: int, task: str, output: TensorDiff | None, loss: TensorDiff | None,
           quality: Quality | None, worse: Sequence[str]) -> list[Failure]:
    """The clauses of the rule that the measurements fail, in the rule's order (one :class:`Failure` each);
    ``run`` names the compared run (``"autocast float16"``)."""
    out: list[Failure] = []
    if ref_bad is not None:
        out.append(Failure("reference_finite", f"the float32 reference is non-finite, first at {ref_bad}: not a "
                           "precision finding; fix the float32 step first (nanhunt replay --dtype float32 names the op)"))
        return out
    if amp_bad is not None:
        text = f"the {run} run is non-finite, first at {amp_bad}"
        if amp_rows:
            text += f"; non-finite output in {_samples_text(amp_rows)}"
        out.append(Failure("amp_finite", text, tuple(amp_rows)))
    if task == "classify" and len(flipped) > max_flips:
        out.append(Failure("max_flips", f"{len(flipped)} decision flip{'s' if len(flipped) != 1 else ''} "
                                        f"(at most {max_flips} allowed): {_samples_text(flipped)}", tuple(flipped)))
    if rule.fail_on_tolerance:
        for what, d in (("the model's output", output), ("the loss", loss)):
            if d is not None and d.out_of_tol > 0:
                out.append(Failure("tolerance", f"{what}: {d.out_of_tol:.2%} of elements out of tolerance "
                                                f"(max abs error {d.max_abs:.3g}, max rel error {d.max_rel:.3g})"))
    if quality is not None:
        m = quality.metric
        seen = f"{m} {quality.amp:.6g} {_under(run)} against {quality.ref:.6g} in float32"
        which = f"; worse {_under(run, short=True)}: {_samples_text(worse)}" if worse else ""
        if rule.max_quality_drop is not None and not quality.drop() <= rule.max_quality_drop:  # NaN fails too
            out.append(Failure("max_quality_drop", f"{seen}: {quality.drop():.6g} worse (at most "
                                                   f"{rule.max_quality_drop:g} allowed){which}", tuple(worse)))
        q = rule.min_quality
        if q is not None and not (quality.amp >= q if quality.higher_is_better else quality.amp <= q):
            ref_ok = quality.ref >= q if quality.higher_is_better else quality.ref <= q
            tail = "" if ref_ok else "; the float32 reference fails it too: not a precision finding"
            out.append(Failure("min_quality", f"{m} {quality.amp:.6g} {_under(run)} "
                                              f"({'at least' if quality.higher_is_better else 'at most'} {q:g} "
                                              f"required){tail}", tuple(worse)))
    return out


def _under(run: str, short: bool = False) -> str:
    """``under autocast float16`` (``short``: ``under autocast``), or ``in`` a run of another kind."""
    if run.startswith("autocast "):
        return "under autocast" if short else f"under {run}"
    return "in " + (run.split(" ", 1)[0] if short else run)


def _nonfinite_rows(ref: torch.Tensor | None, amp: torch.Tensor | None, task: str = "classify") -> list[int]:
    """Samples whose autocast output holds a non-finite value where the reference's does not (samples as
    ``task`` counts them: classify's rows of scores, else the output's first dimension)."""
    if ref is None or amp is None or ref.ndim == 0 or ref.shape != amp.shape:
        return []
    if task == "classify":
        r, a = _as_samples(ref), _as_samples(amp)
    else:
        r, a = ref.reshape(ref.shape[0], -1), amp.reshape(amp.shape[0], -1)
    return [int(i) for i in torch.nonzero((~torch.isfinite(a)).any(dim=1) & torch.isfinite(r).all(dim=1)).flatten()]
