"""Float32 reference against autocast: where the error is *introduced*, and which decisions change.

The method of ``seeds/`` (first document), automated:

1. The acceptance rule is fixed before anything runs: the tolerances (per dtype unless given),
   the task and the number of decision flips allowed. It is stored with the result and printed
   with it; the result never widens it.
2. The float32 reference (autocast disabled) runs first and is checked first. A non-finite
   reference is reported as such (``status="reference-nonfinite"``) and nothing is compared:
   it is not a precision finding.
3. The same step (forward, loss, backward; no optimizer update) runs again from the same
   parameters, buffers and RNG state under autocast. Module calls are matched by module name
   and call index; the loss and every parameter gradient are compared too.
4. Module calls are ranked by the error they *introduce*, then the decisions are compared.

Errors are measured on float32 CPU copies, in float64. A call's ``scaled`` error is
max |amp - ref| / max(max |ref|, atol): the error as a fraction of the value's own magnitude,
so a value that only carries an error it was given keeps about the same number while the
absolute error grows or shrinks with the values. A call's *gain* is its output's scaled error
minus the largest scaled error among its floating inputs (which are copied when the call
starts, before any in-place op). A container's gain also contains its sub-calls' gains, so its
``introduced`` error is its gain minus the sum of its direct sub-calls' gains (for a chain of
sub-calls the sum telescopes to the container's gain, leaving what its own code adds); a leaf's
``introduced`` error is its gain. Both are floored at 0. A non-finite output from finite inputs
introduces an infinite error; a non-finite output from a non-finite input introduces none.

Memory: each run keeps a float32 CPU copy of every floating input and output of every module
call (containers repeat their children's tensors) and of every gradient, and both runs are kept
until they are compared: about four times the activations and gradients of one step, in host
memory. That is meant for one batch of a model that fits; slice the batch for larger ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError
from ..records import Comparison, Report, ReportConfig, Rule, Speed, Status
from .._util._env import environment
from .._util._text import dtype_name
from ..step.step import Step, split_batch
from ._batch import _Candidate, _compare_batch, _reference_failed, _total
from ._defaults import TASKS, TIE_RULE, _Rule, default_tolerances
from ._measure import top_two
from ._record import _Run, _absorbed, _first_nonfinite, _floats, _run, _upcast
from ._rule import rule_from, settle_rule
from ._speed import _speed
from ._variant import Variant, float8_note, running, variants
from ..step._float8 import float8_layers
from .history import HISTORY_FILE, History

__all__ = ["compare", "History", "HISTORY_FILE", "rule_from", "settle_rule", "default_tolerances", "top_two", "TIE_RULE",
           "TASKS"]

# ------------------------------------------------------------------ the entry point


def _named(batch: Any, batches: Sequence[Any] | Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if (batch is None) == (batches is None):
        raise InputError("compare needs a batch, or a set of them (batches=[...]), not both")
    if batches is None:
        return [("", batch)]
    named = list(batches.items()) if isinstance(batches, Mapping) else \
        [(f"batch{i}", b) for i, b in enumerate(batches)]
    if not named:
        raise InputError("the set of batches is empty")
    names = [str(n) for n, _ in named]
    if len(set(names)) != len(names) or not all(names):
        raise InputError("the batches of a set need different, non-empty names")
    return [(str(n), b) for n, b in named]


_BatchSet = tuple[str, Any, Any, tuple[Any, Any]]  # name, inputs, targets, (reference inputs, targets)


def _rule_of_args(rule: Rule | None, *, rtol: float | None, atol: float | None, task: str, max_flips: int,
                  fail_on_tolerance: bool) -> Rule:
    """The acceptance rule: ``rule`` as given, or built from compare's arguments (not both)."""
    if rule is None:
        return rule_from({"task": task, "rtol": rtol, "atol": atol, "max_flips": max_flips,
                          "fail_on_tolerance": fail_on_tolerance}, where="compare's arguments")
    if (rtol, atol, task, max_flips, fail_on_tolerance) != (None, None, "none", 0, False):
        raise InputError("give the acceptance rule as rule=... or as rtol/atol/task/max_flips/fail_on_tolerance, "
                           "not both")
    return rule


def _batch_sets(named: Sequence[tuple[str, Any]], low: Sequence[str]) -> list[_BatchSet]:
    sets: list[_BatchSet] = []
    for name, b in named:
        inputs, targets = b if isinstance(b, tuple) and len(b) == 2 else split_batch(b)
        # A float32 model's reference takes a float16/bfloat16 batch upcast (exactly): with autocast off, a
        # low-precision input would meet float32 weights. The autocast run takes the batch as it is.
        sets.append((name, inputs, targets, (inputs, targets) if low else (_upcast(inputs), _upcast(targets))))
    return sets


def _candidates(vs: Sequence[Variant], rule: Rule, device_type: str, per_row: bool) -> list[_Candidate]:
    cands: list[_Candidate] = []
    for v in vs:
        d_rtol, d_atol = v.tolerances()
        c_rtol = d_rtol if rule.rtol is None else rule.rtol
        c_atol = d_atol if rule.atol is None else rule.atol
        cands.append(_Candidate(v, v.name, c_rtol, c_atol, v.limit(), _Rule(
            dtype=v.name, device_type=device_type, rtol=c_rtol, atol=c_atol, task=rule.task, max_flips=rule.max_flips,
            fail_on_tolerance=rule.fail_on_tolerance, tie_rule=TIE_RULE if rule.task == "classify" else "",
            variant=v.label, per_row=per_row)))
    return cands


def _status(results: Sequence[Comparison]) -> Status:
    if not all(r.reference_finite for r in results):
        return Status.REFERENCE_NONFINITE
    if all(r.accepted for r in results):
        return Status.CLEAN
    if any(r.amp_finite is False for r in results):
        return Status.NONFINITE
    return Status.DIVERGED


class _Comparer:
    """One call of :func:`compare` once its arguments are checked: the step, the rule, the batches, the candidates."""

    def __init__(self, step: Step, rule: Rule, metric_fn: Callable[..., Any] | None, vs: Sequence[Variant],
                 named: Sequence[tuple[str, Any]], *, loss_fn: Callable[..., Any] | None,
                 scaler: torch.amp.GradScaler | None, train: bool | None, is_set: bool, metric_given: bool) -> None:
        self.step, self.rule, self.metric_fn, self.vs = step, rule, metric_fn, list(vs)
        # A float8 model's layers leave float8 for the reference and the autocast runs (see ._variant)
        self.layers = float8_layers(step.model)
        self.model, self.device_type = step.model, step.device_type
        self.loss_fn, self.scaler, self.train = loss_fn, scaler, train
        self.scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        self.is_set = is_set
        self.need_quality = rule.max_quality_drop is not None or rule.min_quality is not None or metric_given
        self.low = sorted({dtype_name(p.dtype) for p in self.model.parameters()
                           if p.is_floating_point() and p.dtype != torch.float32})
        self.sets = _batch_sets(named, self.low)
        self.names = [v.name for v in self.vs]

    def config(self, speed: int) -> ReportConfig:
        rule, vs, loss_fn = self.rule, self.vs, self.loss_fn
        loss_name = getattr(loss_fn, "__qualname__", None) or (type(loss_fn).__name__ if loss_fn is not None else None)
        return {
            "dtype": ",".join(self.names),
            "device_type": self.device_type,
            "train": self.model.training if self.train is None else self.train,
            "loss_fn": loss_name,
            "task": rule.task,
            "rtol": rule.rtol if rule.rtol is not None or len(vs) > 1 else vs[0].tolerances()[0],
            "atol": rule.atol if rule.atol is not None or len(vs) > 1 else vs[0].tolerances()[1],
            "max_flips": rule.max_flips,
            "fail_on_tolerance": rule.fail_on_tolerance,
            "scaler_scale": self.scale if self.scaler is not None else None,
            "metric": rule.metric,
            "batches": len(self.sets) if self.is_set else None,
            "speed_repeats": speed or None,
        }

    def notes(self, notes: Sequence[str]) -> tuple[str, ...]:
        base_notes = tuple(notes)
        if self.low:
            base_notes += (f"parameters held in {', '.join(self.low)}: the reference runs them as they are, so it is "
                           "float32 arithmetic on rounded weights",)
        note = float8_note(self.layers, self.vs)
        return base_notes + ((note,) if note is not None else ())

    def _run(self, inputs: Any, targets: Any, v: Variant | None) -> _Run:
        """One recorded run: the float32 reference (``v`` None) or a candidate."""
        self.step.reset()
        dt = v.autocast if v is not None else None
        with running(self.layers, v):
            return _run(self.model, inputs, targets, self.loss_fn, dtype=dt or torch.float32,
                        device_type=self.device_type, amp=dt is not None, scale=self.scale if dt is not None else 1.0)

    def _batch(self, cands: Sequence[_Candidate], name: str, inputs: Any, targets: Any,
               ref_in: Any, ref_tg: Any) -> None:
        """The reference of one batch, then every candidate against it."""
        rule = self.rule
        floats, _ = _floats(inputs)
        ref = self._run(ref_in, ref_tg, None)
        ref_bad, ref_allowed = _first_nonfinite(ref, floats, rule.allow_nonfinite)
        for cand in cands:
            if ref_bad is not None:
                # Checked first: a float32 step that is already non-finite is no reference for precision.
                cand.batches.append(_reference_failed(cand, rule, name=name, ref_bad=ref_bad,
                                                      ref_loss=float(ref.loss.double().sum())))
                continue
            amp = self._run(inputs, targets, cand.variant)
            result = _compare_batch(ref, amp, cand, rule, floats=floats, name=name, targets=targets,
                                    ref_allowed=ref_allowed, scale=self.scale, metric_fn=self.metric_fn,
                                    need_quality=self.need_quality)
            del amp
            if result.amp_finite:  # a non-finite run already says where it went non-finite first
                self.step.reset()
                dt = cand.variant.autocast
                with running(self.layers, cand.variant):
                    absorbed = _absorbed(self.model, inputs, targets, self.loss_fn, dtype=dt,
                                         device_type=self.device_type, scale=self.scale if dt is not None else 1.0,
                                         allow=rule.allow_nonfinite)
                result = dataclasses.replace(result, absorbed=tuple(f"{cand.run}: {a}" for a in absorbed))
            cand.batches.append(result)
        del ref

    def execute(self, speed: int) -> tuple[list[_Candidate], list[Comparison], dict[str, Speed]]:
        """Every batch and candidate, then the speed of those accepted; the model is restored afterwards."""
        cands = _candidates(self.vs, self.rule, self.device_type, per_row=bool(self.layers))
        speeds: dict[str, Speed] = {}
        with self.step.isolated():  # restored on leaving, also on Ctrl-C (held until the restore is complete)
            for name, inputs, targets, (ref_in, ref_tg) in self.sets:
                self._batch(cands, name, inputs, targets, ref_in, ref_tg)
            results = [_total(c, self.rule, self.metric_fn) if self.is_set else c.batches[0] for c in cands]
            if speed:
                mode = self.model.training if self.train is None else self.train
                for c, r in zip(cands, results):
                    if r.accepted:  # only after the numbers pass
                        speeds[c.name] = _speed(self.step, self.sets, c.variant.autocast, repeats=speed, train=mode,
                                                runs=self._runs(c.variant))
        return cands, results, speeds

    def _runs(self, v: Variant) -> Callable[[bool], AbstractContextManager[None]]:
        """The float8 layers as the candidate (True) or the reference (False) runs them, for the timed steps."""
        return lambda amp: running(self.layers, v if amp else None)

    def finish(self, cands: Sequence[_Candidate], results: Sequence[Comparison], speeds: Mapping[str, Speed],
               speed: int) -> tuple[Status, Comparison, list[str]]:
        """The status, the first candidate's comparison (holding the others) and the extra notes."""
        scale = self.scale
        extra: list[str] = []
        for c, r in zip(cands, results):
            bad = r.amp_first_nonfinite
            if bad is not None and "the gradient" in bad and scale != 1.0:
                extra.append(f"{c.run}: only the gradients went non-finite, with the loss scaled by "
                             f"{scale:g}: GradScaler would skip this step and lower the scale; nanhunt replay tells "
                             "whether it is scale-induced")
        refused = Speed(reason="not measured: the candidate failed the rule (speed is measured only after the "
                               "numbers pass)")
        digest = self.rule.sha256()
        results = [dataclasses.replace(r, acceptance=self.rule, rule_sha256=digest,
                                       speed=speeds.get(r.dtype, refused) if speed else None) for r in results]
        first = dataclasses.replace(results[0], alternatives=tuple(results[1:]))
        if len(extra) == 1 and len(results) == 1:
            extra = [extra[0].split(": ", 1)[1]]  # one candidate: as before
        return _status(results), first, extra


def compare(
    model: nn.Module, batch: Any = None, *, batches: Sequence[Any] | Mapping[str, Any] | None = None,
    loss_fn: Callable[..., Any] | None = None, dtype: torch.dtype | str | Sequence[torch.dtype | str] | None = None,
    device_type: str | None = None, rtol: float | None = None, atol: float | None = None, task: str = "none",
    max_flips: int = 0, fail_on_tolerance: bool = False, rule: Rule | None = None,
    metric: str | Callable[..., Any] | None = None, speed: int = 0, scaler: torch.amp.GradScaler | None = None,
    train: bool | None = None, rng: Mapping[str, Any] | None = None, command: str | None = None,
    notes: Sequence[str] = (), float8_autocast: torch.dtype | str | None = None,
) -> Report:
    """Run one step in float32 and under autocast from the same state; say where error is introduced.

    ``batch`` is ``(inputs, targets)`` as for :func:`nanhunt.replay`; the step is forward, loss
    and backward (no optimizer update). Or ``batches``, a fixed set to validate on (ordinary inputs,
    edge cases, inputs near decision boundaries): a list (named ``batch0``, ``batch1``...) or a dict
    name -> batch; every batch starts from the same state and RNG, samples are named ``name:index``,
    and the result holds one comparison per batch (``comparison.batches``) and the totals.

    The acceptance rule is fixed before anything runs: ``rule`` (a :class:`nanhunt.records.Rule`, e.g.
    :func:`rule_from` of a JSON file) or the arguments ``rtol``, ``atol``, ``task``, ``max_flips`` and
    ``fail_on_tolerance`` (not both). It holds when the float32 reference and the autocast run are finite
    (but for values introduced inside the modules ``rule.allow_nonfinite`` names), at most ``max_flips``
    decisions change (``task="classify"``), with ``fail_on_tolerance`` no element of the model's output
    or the loss is out of tolerance (|amp - ref| > atol + rtol * |ref|), and the quality of the
    autocast run is at most ``rule.max_quality_drop`` worse than float32's and at least
    ``rule.min_quality``. ``rtol``/``atol`` default to float16 1e-3/1e-5 and bfloat16 1e-2/1e-5;
    without ``fail_on_tolerance`` they only rank modules and mark near-boundary samples. The rule is
    stored with its sha256 (``comparison.acceptance``, ``comparison.rule_sha256``); each failed clause
    is a :class:`~nanhunt.records.Failure` naming its samples.

    Quality (``metric``): accuracy for ``task="classify"``, mean squared error (and the largest error)
    for ``"regress"``, or your ``fn(outputs, targets) -> float`` (a function, or its
    ``"package.module:fn"`` name), on both runs against the targets.

    ``dtype`` may list several autocast dtypes (``"float16,bfloat16"``): the reference runs once per
    batch, each candidate after it; ``report.comparison`` is the first's and
    ``report.comparison.alternatives`` the others'. ``speed=N`` then times the plain step (no hook
    of nanhunt's) N times interleaved, for the candidates that passed only. ``dtype`` defaults to float16, and
    to ``"float8,bfloat16"`` for a model holding torchao float8 layers: ``"float8"`` runs them in float8 under
    autocast ``float8_autocast`` (None: off), every other run as ``nn.Linear`` (see :mod:`._variant`).

    ``task="classify"``: the model's output holds class scores (classes on dim 1, or a 1-D
    output for one sample); the top-1 class is taken per sample in both runs, ties going to
    the lowest class index (:data:`TIE_RULE`). ``task="regress"``: the output's error per
    sample and its extremes. With a ``scaler``, the autocast backward is scaled by its current
    scale and the gradients unscaled before comparing, as training would.

    The model, its gradients, ``training`` flags and the RNG are restored afterwards, also on
    an exception. The result is ``report.comparison`` (a :class:`nanhunt.records.Comparison`);
    ``report.status`` is ``"clean"`` (rule held by every candidate), ``"reference-nonfinite"``,
    ``"nonfinite"`` (an autocast run) or ``"diverged"`` (another clause failed).

    Example::

        report = nanhunt.compare(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16, task="classify")
        c = report.comparison
        print(c.accepted, c.flipped, [c.modules[i].label() for i in c.ranking[:3]])

        rule = Rule(task="classify", max_flips=0, max_quality_drop=0.01)
        report = nanhunt.compare(model, batches={"ordinary": b1, "edge": b2, "boundary": b3}, loss_fn=F.cross_entropy,
                                 dtype="float16,bfloat16", rule=rule, speed=10)
        print([(c.dtype, c.accepted, [f.clause for f in c.failures]) for c in report.comparison.candidates()])
    """
    vs = variants(dtype, model, float8_autocast=float8_autocast)
    rule = _rule_of_args(rule, rtol=rtol, atol=atol, task=task, max_flips=max_flips, fail_on_tolerance=fail_on_tolerance)
    rule, metric_fn = settle_rule(rule, metric)
    if speed < 0:
        raise InputError(f"speed must be >= 0 repetitions, not {speed}")
    named = _named(batch, batches)
    # no optimizer: the comparison runs forward, loss and backward (the scaler only gives its scale)
    step = Step.of(model, named[0][1], loss_fn=loss_fn, dtype=vs[0].autocast or torch.float32,
                   device_type=device_type, scaler=scaler, train=train, rng=rng)
    run = _Comparer(step, rule, metric_fn, vs, named, loss_fn=loss_fn, scaler=scaler, train=train,
                    is_set=batches is not None, metric_given=metric is not None)
    config = run.config(speed)
    module_classes = {name: type(m).__name__ for name, m in run.model.named_modules()}
    cands, results, speeds = run.execute(speed)
    status, first, extra = run.finish(cands, results, speeds, speed)
    return Report(status=status, first=None, loss=results[0].ref_loss, config=config, module_classes=module_classes,
                  environment=environment(run.device_type), command=command, notes=run.notes(notes) + tuple(extra),
                  comparison=first)
