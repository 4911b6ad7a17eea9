"""The pipeline, top to bottom: trace the step twice, check it reproduces, prove why by bisection,
write the repro, build the :class:`~nanhunt.records.Report`. ``nanhunt replay`` and :func:`nanhunt.replay`
both call :func:`hunt`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._env import environment
from .bisect import bisect
from .records import Occurrence, Record, Report, Repro, Role, Verdict
from .replay import Replayed, module_status, state_notes, step_config, trace_twice
from .repro import OriginCall, make_repro, origin_call
from .step import Step
from .tracer import Trace

__all__ = ["hunt", "replay"]


def hunt(step: Step, *, level: str = "op", allow: Iterable[str] = (), prove: bool = False,
         progress: Callable[[int, str], None] | None = None, bundle: str | None = None,
         command: str | None = None) -> Report:
    """Where the step's first non-finite value was born (two traced runs that must agree), with
    ``prove`` why (the bisection's verdict), and with ``bundle`` a verified repro of the culprit op
    written into that directory. The step's state is restored afterwards, also on Ctrl-C."""
    allow = tuple(allow)
    config = step_config(step, level)
    with step.isolated():  # one snapshot for every run below
        replayed = trace_twice(step, level=level, allow=allow)
        first = replayed.final.first
        verdict = _prove(step, replayed, level, allow, progress) if prove else None
        repro = make_repro(step, first, bundle, call=_caught_call(step, replayed)) if bundle is not None else None
    return _report(step, replayed, config, verdict, repro, command)


def _caught_call(step: Step, replayed: Replayed) -> OriginCall | None:
    """The culprit op's call the second run kept, when it is the reported culprit's (reproducible runs)."""
    caught = replayed.runs[1]._caught
    return origin_call(step, caught) if caught is not None and replayed.reproducible else None


def _prove(step: Step, replayed: Replayed, level: str, allow: tuple[str, ...],
           progress: Callable[[int, str], None] | None) -> Verdict:
    status = replayed.status
    if status != "nonfinite":
        return Verdict(kind=status)

    def locate_fp32() -> Occurrence | None:
        """Where the float32 control fails: one traced run of it."""
        t = Trace(step.model, level=level, allow=allow)
        step.run(dtype=torch.float32, within=t)
        return t.first

    final = replayed.final
    return bisect(step, origin=final.first, origins=tuple(final.origins), progress=progress, locate_fp32=locate_fp32)


def _report(step: Step, replayed: Replayed, config: dict[str, Any], verdict: Verdict | None, repro: Repro | None,
            command: str | None) -> Report:
    final = replayed.final
    records = final.records
    first = final.first
    config["grads_finite"] = all(r.finite for r in records if r.role is Role.GRAD)
    if step.scaler is not None:
        config["scaler_would_skip"] = not config["grads_finite"]
    if verdict is not None and verdict.silent and first is not None:
        verdict = dataclasses.replace(verdict, corrupted=_corrupted(records, first))
    timeline = tuple(
        (r.index, r.phase.value, r.absmax if r.finite else math.nan,
         "finite" if r.finite else ("nan" if r.has_nan else "inf"))
        for r in records
    )
    return Report(
        timeline=timeline,
        verdict=verdict,
        status=replayed.status,
        first=first,
        origins=tuple(final.origins),
        path=tuple(final.path),
        runs=(replayed.runs[0].first, replayed.runs[1].first),
        loss=replayed.loss,
        config=config,
        modules=module_status(records, final.tainted, final.module_classes()),
        module_classes=final.module_classes(),
        environment=environment(step.device_type),
        command=command,
        notes=step.notes + state_notes(config, step.compiled),
        n_records=len(records),
        repro=repro,
    )


def _corrupted(records: Sequence[Record], origin: Occurrence) -> tuple[str, ...]:
    """Which values a silent origin corrupted: those that took its non-finite values in, finite again."""
    said = (f"{records[i].phase.value} {records[i].module or '<root>'} {records[i].op or records[i].role.value} "
            f"(|x| max {records[i].absmax:.3g})" for i in origin.absorbed)
    return tuple(dict.fromkeys(said))


def replay(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[..., Any] | None = None,
    dtype: torch.dtype = torch.float16,
    device_type: str | None = None,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    level: str = "op",
    train: bool | None = None,
    rng: Mapping[str, Any] | None = None,
    allow: Iterable[str] = (),
    command: str | None = None,
    notes: Sequence[str] = (),
    bisect: bool = False,
    progress: Callable[[int, str], None] | None = None,
) -> Report:
    """Replay one training step twice inside :func:`nanhunt.trace` and report where NaN/Inf was born.

    ``batch`` is ``(inputs, targets)``; ``inputs`` a tensor, a tuple of positional
    arguments or a dict of keyword arguments; ``loss_fn(output, targets)`` gives
    the loss, or with no ``loss_fn`` the model's output is the loss (a scalar,
    ``.loss`` or ``["loss"]``). Forward and loss run under autocast
    (``dtype=torch.float32`` disables it), backward is ``scaler.scale(loss)``
    with the scaler's current scale, and with an optimizer the update runs too
    (phase ``update``). Both runs start from the same weights, buffers, RNG state
    (``rng`` or the current one) and scaler state; the model, optimizer and
    scaler are restored exactly afterwards, also on an exception. ``device_type``
    defaults to the device of the model's parameters.

    With ``bisect=True`` and a non-finite step, :func:`nanhunt.bisect.bisect`
    then proves why: ``report.verdict`` names a minimal set of modules whose
    float32 execution makes the step finite (``progress(n, label)`` is called
    before each of its replays).

    Example::

        report = nanhunt.replay(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16)
        print(report.first)
    """
    step = Step.of(model, batch, loss_fn=loss_fn, dtype=dtype, device_type=device_type, scaler=scaler,
                   optimizer=optimizer, rng=rng, train=train, notes=tuple(notes))
    return hunt(step, level=level, allow=allow, prove=bisect, progress=progress, command=command)
