"""The pipeline, top to bottom: trace the step twice, check it reproduces, prove why by bisection,
write the repro, build the :class:`~nanhunt.records.Report`. ``nanhunt replay`` and :func:`nanhunt.replay`
both call :func:`hunt`."""

from __future__ import annotations

import dataclasses
import linecache
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .._util._env import environment
from ..capture._event import EventFile
from .advice import advise
from .bisection import Team, bisect
from ..records import (FP16_SMALLEST_NORMAL, PHASE_ORDER, BackwardUnderflow, GuardEvent, Occurrence, Phase, Record,
                       Report, ReportConfig, Repro, Level, Role, Status, Verdict, VerdictKind)
from ._twice import COMPILED_NOTE, Replayed, module_status, state_notes, step_config, trace_twice
from ._compiled import Ladder, climb
from ._update import last_update, optimizer_settings
from .repro import OriginCall, make_repro, origin_call
from ..step.step import Step
from ..tracing.tracer import Trace, as_level

__all__ = ["hunt", "replay", "Ranks"]


class Ranks(Team, Protocol):
    """Every rank of a distributed replay hunting at once (``nanhunt.hunt._dist_replay``): each traces its own
    batch, and what decides a collective (whether to bisect, with which origin) is agreed among them."""

    def traced(self, final: Trace) -> None:
        """This rank's final trace (it has gathered every rank's leading origin)."""
        ...

    def agreed_status(self, status: Status) -> Status:
        """The step's status over every rank."""
        ...

    def leading(self, first: Occurrence | None, origins: tuple[Occurrence, ...], first_rank: int | None,
                ) -> tuple[Occurrence | None, tuple[Occurrence, ...]]:
        """The leading origin and the origins of ``first_rank`` (the rank that went first), on every rank."""
        ...

    def repro(self, make: Callable[[str], Repro | None], bundle: str) -> Repro | None:
        """The repro of the rank that went first (``make(directory)`` runs there: its culprit op ran there), its
        files written into ``bundle`` by the rank that writes the bundle; the same Repro on every rank."""
        ...


def hunt(step: Step, *, level: str = "op", allow: Iterable[str] = (), prove: bool = False,
         progress: Callable[[int, str], None] | None = None, bundle: str | None = None,
         command: str | None = None, ranks: Ranks | None = None, repeat: int = 1,
         event: EventFile | None = None) -> Report:
    """Where the step's first non-finite value was born (two traced runs that must agree), with
    ``prove`` why (the bisection's verdict), and with ``bundle`` a verified repro of the culprit op
    written into that directory. The step's state is restored afterwards, also on Ctrl-C. ``ranks``: every
    rank of a distributed replay calls this at once (the bisection's trials then run on all of them).

    ``repeat``: replay (the two traced runs) up to that many times while it stays finite; the first replay
    that is not is the one reported. ``event``: the Guard's event of the capture the step was loaded from
    (:func:`nanhunt.capture.capture.load_replay` reads it), carried into the report; a capture whose event says
    the step failed, replayed finite every time, is ``not-reproducible`` (its status and verdict)."""
    if repeat < 1 or (ranks is not None and repeat != 1):
        raise ValueError(f"repeat={repeat}: at least 1, and 1 in a distributed replay")
    allow = tuple(allow)
    traced = as_level(level)  # as the command line and replay() give it: a ValueError for neither op nor module
    config = step_config(step, traced)
    notes: tuple[str, ...] = ()
    with step.isolated():  # one snapshot for every run below
        replayed = trace_twice(step, level=traced, allow=allow)
        replays = 1
        while replayed.status == Status.CLEAN and replays < repeat:
            replayed = trace_twice(step, level=traced, allow=allow)
            replays += 1
        if replays > 1 and replayed.status != Status.CLEAN:
            notes = (f"replay {replays} of up to {repeat} was not finite: "
                     f"{'the one' if replays == 2 else f'the {replays - 1}'} before it "
                     f"{'was' if replays == 2 else 'were'} (the step does not always fail)",)
        first = replayed.final.first
        if ranks is not None:
            ranks.traced(replayed.final)
        ladder = climb(step, step.compile_spec, eager_runs=2 * replays, repeat=repeat, bundle=bundle) \
            if step.compile_spec is not None and replayed.status == Status.CLEAN and ranks is None else None
        verdict = _prove(step, replayed, traced, allow, progress, ranks) if prove else None
        repro = None
        if bundle is not None:
            def make(directory: str) -> Repro | None:
                return make_repro(step, first, directory, call=_caught_call(step, replayed), rerun=ranks is None)

            repro = make(bundle) if ranks is None else ranks.repro(make, bundle)
    report = _report(step, replayed, config, verdict, repro, command)
    if ladder is not None:
        report = _compiled_report(report, ladder)
    guard = event or EventFile()
    report = dataclasses.replace(report, notes=(*report.notes, *notes, *([guard.note] if guard.note else [])),
                                 guard_event=guard.event, headroom=guard.headroom)
    if report.status == Status.CLEAN and guard.event is not None and _failed_here(guard.event):
        report = dataclasses.replace(report, status=Status.NOT_REPRODUCIBLE,
                                     verdict=Verdict(kind=VerdictKind.NOT_REPRODUCIBLE, replays=replays))
    return dataclasses.replace(report, advice=advise(report))


def _compiled_report(report: Report, ladder: Ladder) -> Report:
    """A compiled step's report: the ladder in its configuration; a compile-induced verdict and status when a
    compiled rung failed (the graph node with its line's text)."""
    config: ReportConfig = {**report.config, "compiled_rungs": {
        r.backend: f"{r.nonfinite}/{r.runs} non-finite" if r.error is None else "could not run"
        for r in ladder.rungs}}
    ran = ", ".join(r.backend for r in ladder.rungs[1:] if r.error is None)
    notes = tuple(f"the model is torch.compile'd: its eager original was traced, and the step replayed compiled "
                  f"({ran}) as well" if n == COMPILED_NOTE and ran else n for n in report.notes)
    notes += tuple(f"the step could not be replayed compiled by {r.backend} (its finding stands for the eager "
                   f"step only): {r.error}" for r in ladder.rungs if r.error is not None)
    v = ladder.verdict
    if v is None:
        return dataclasses.replace(report, config=config, notes=notes)
    if v.graph_node is not None:
        v = dataclasses.replace(v, graph_node=dataclasses.replace(v.graph_node,
                                                                  source_text=_line_text(v.graph_node.source)))
    return dataclasses.replace(report, config=config, notes=notes, status=Status.COMPILE_INDUCED, verdict=v,
                               repro=ladder.repro or report.repro)


def _failed_here(event: GuardEvent) -> bool:
    """The Guard's event says this capture's step failed on this rank alone: a finite replay did not reproduce it.
    (Other ranks that saw it too may have sent it through a collective: their captures are the ones to replay.)"""
    return event.is_detection() and not [r for r in event.ranks if r != event.rank]


def _caught_call(step: Step, replayed: Replayed) -> OriginCall | None:
    """The culprit op's call the second run kept, when it is the reported culprit's (reproducible runs)."""
    caught = replayed.runs[1]._caught
    return origin_call(step, caught) if caught is not None and replayed.reproducible else None


def _prove(step: Step, replayed: Replayed, level: Level, allow: tuple[str, ...],
           progress: Callable[[int, str], None] | None, ranks: Ranks | None = None) -> Verdict:
    status = replayed.status if ranks is None else ranks.agreed_status(replayed.status)
    if status != Status.NONFINITE:
        return Verdict(kind=VerdictKind.CLEAN if status == Status.CLEAN else VerdictKind.NOT_REPRODUCIBLE)

    def locate_fp32() -> Occurrence | None:
        """Where the float32 control fails: one traced run of it."""
        t = Trace(step.model, level=level, allow=allow)
        step.run(dtype=torch.float32, within=t)
        return t.first if ranks is None else ranks.leading(t.first, (), t.first_rank)[0]

    final = replayed.final
    first, origins = final.first, tuple(final.origins)
    if ranks is not None:
        first, origins = ranks.leading(first, origins, final.first_rank)
    return bisect(step, origin=first, origins=origins, progress=progress, locate_fp32=locate_fp32, team=ranks,
                  level=level, allow=allow)


def _report(step: Step, replayed: Replayed, config: ReportConfig, verdict: Verdict | None, repro: Repro | None,
            command: str | None) -> Report:
    final = replayed.final
    records = final.records
    first = final.first
    config["grads_finite"] = all(r.finite for r in records if r.role is Role.GRAD)
    if step.scaler is not None:
        config["scaler_would_skip"] = not config["grads_finite"]
    eps = _optimizer_eps(step.optimizer)
    if eps is not None:
        config["optimizer_eps"] = eps
    settings = optimizer_settings(step.optimizer)
    if settings is not None:
        config["optimizer_settings"] = settings
    update = last_update(step.optimizer, step.model)
    if update is not None:
        config["last_update"] = update
    underflow = _fp16_backward_underflow(records)
    if underflow is not None:
        config["fp16_backward_underflow"] = underflow
    if verdict is not None and verdict.silent and first is not None:
        verdict = dataclasses.replace(verdict, corrupted=_corrupted(records, first))
    told = {id(o): _told(o, records) for o in (first, *final.origins) if o is not None}
    first = told[id(first)] if first is not None else None
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
        origins=tuple(told[id(o)] for o in final.origins),
        path=tuple(final.path),
        runs=tuple(None if t.first is None else told.get(id(t.first)) or _told(t.first, t.records)
                   for t in replayed.runs),
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


def _optimizer_eps(optimizer: torch.optim.Optimizer | None) -> float | None:
    """The smallest ``eps`` of the optimizer's parameter groups (Adam's, RMSprop's...), None without one."""
    if optimizer is None:
        return None
    found = [float(g["eps"]) for g in optimizer.param_groups
             if isinstance(g.get("eps"), (int, float)) and not isinstance(g.get("eps"), bool)]
    return min(found) if found else None


def _fp16_backward_underflow(records: Sequence[Record]) -> BackwardUnderflow | None:
    """How many float16 tensors of the backward lie wholly below float16's smallest normal (their values
    subnormal, or flushed to 0), of how many, and the largest of them; None when there is none."""
    backward = [r for r in records if r.phase is Phase.BACKWARD and r.dtype == "float16" and r.finite]
    tiny = [r for r in backward if 0 < r.absmax < FP16_SMALLEST_NORMAL]
    if not tiny:
        return None
    top = max(tiny, key=lambda r: r.absmax)
    return {"tensors": len(tiny), "of": len(backward), "largest": top.absmax, "at": top.where()}


def _told(o: Occurrence, records: Sequence[Record]) -> Occurrence:
    """``o`` with the text of its source line and, born in backward, the forward ops it derives from."""
    return dataclasses.replace(o, source_text=_line_text(o.source), forward_ops=_forward_ops(o, records))


_LINE_CHARS = 300


def _line_text(source: str | None) -> str | None:
    """The text of ``"file:line in function"``'s line, read now; None when the file is not there."""
    if not source:
        return None
    where = source.rpartition(" in ")[0]  # a function's name holds no space
    file, _, line = where.rpartition(":")
    if not file or not line.isdigit() or not os.path.isfile(file):
        return None
    linecache.checkcache(file)  # the file as it is now, not as an earlier read cached it
    text = linecache.getline(file, int(line)).strip()
    if len(text) > _LINE_CHARS:
        text = text[:_LINE_CHARS] + "..."
    return text or None


_BACKWARD = PHASE_ORDER.index(Phase.BACKWARD)


def _forward_ops(o: Occurrence, records: Sequence[Record], depth: int = 3) -> tuple[str, ...]:
    """A backward origin: the ops of the nearest forward (or loss) records upstream of its inputs, what its
    derivative was taken of (``aten::sqrt`` for the division in sqrt's backward); () elsewhere."""
    if o.phase is not Phase.BACKWARD:
        return ()
    frontier = [i for i in o.output.inputs if 0 <= i < len(records)]
    seen = set(frontier)
    for _ in range(depth):
        ops = [records[i].op for i in frontier if PHASE_ORDER.index(records[i].phase) < _BACKWARD]
        found = tuple(dict.fromkeys(op for op in ops if op is not None))
        if found:
            return found
        nxt = [j for i in frontier for j in records[i].inputs if 0 <= j < len(records) and j not in seen]
        seen.update(nxt)
        frontier = list(dict.fromkeys(nxt))
    return ()


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

    A ``torch.compile``d model is traced through its eager original and, when that step is finite, run
    compiled too (:mod:`nanhunt.hunt._compiled`): a NaN of the compiled step alone is ``compile-induced``.

    With ``bisect=True`` and a non-finite step, :func:`nanhunt.hunt.bisection.bisect`
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
