"""Deterministic replay of a :class:`~nanhunt.step.step.Step`: traced twice from the same state, whether the
runs agree, and what the step's findings say (status, module summary, configuration)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._util._subclass import local_tensor
from .._util._text import dtype_name
from ..tracing.graph import loss_index
from ..records import Level, Occurrence, Phase, Record, ReportConfig, Role, Status
from ..step.step import Step
from ..tracing.tracer import Trace

__all__ = ["Replayed", "trace_twice", "step_config"]


@dataclass(frozen=True)
class Replayed:
    """The two traced runs of a step; ``final`` is the one reported (the second, which measured the
    culprit in full, unless they disagree)."""

    runs: tuple[Trace, Trace]
    loss: float | None

    @functools.cached_property
    def reproducible(self) -> bool:
        return _same(*self.runs)

    @property
    def final(self) -> Trace:
        return self.runs[1] if self.reproducible else self.runs[0]

    @property
    def status(self) -> Status:
        """``not-reproducible``; ``clean`` (no culprit, only harmless origins, finite loss, gradients and
        update); else ``nonfinite``."""
        if not self.reproducible:
            return Status.NOT_REPRODUCIBLE
        final = self.final
        if final.first is None and all(o.harmless for o in final.origins) and _sinks_finite(final.records):
            return Status.CLEAN
        return Status.NONFINITE


def trace_twice(step: Step, *, level: Level = Level.OP, allow: Sequence[str] = ()) -> Replayed:
    """Run ``step`` twice under :func:`nanhunt.trace` from the same state; the second run measures the
    first run's culprit in full (its record and its inputs). The step's state is restored afterwards."""
    traces: list[Trace] = []
    loss_value: float | None = None
    zoom: frozenset[int] = frozenset()
    with step.isolated():
        for _ in range(2):
            # the second run also keeps the culprit op's call (the repro's inputs): no third run
            first = traces[0].first if traces and level == Level.OP else None
            catch = first if first is not None and first.op is not None else None
            # an op's culprit is measured in full where it is caught, by its key (record indices can shift); a
            # value entering the step (no op), by its record index
            t = Trace._zooming(step.model, () if catch is not None else zoom, catch=catch,
                               catch_records=traces[0].records if catch else None, level=level, allow=allow)
            loss = step.run(within=t)
            loss_value = float(local_tensor(loss.detach()).float())  # a subclass loss: its values
            traces.append(t)
            if t.first is not None:
                zoom = frozenset((t.first.output.index, *t.first.output.inputs))
    return Replayed((traces[0], traces[1]), loss_value)


def step_config(step: Step, level: Level) -> ReportConfig:
    """What the step is replayed with (read before it runs: the scaler's scale)."""
    loss_fn, optimizer, scaler = step.loss_fn, step.optimizer, step.scaler
    config: ReportConfig = {
        "dtype": dtype_name(step.dtype),
        "device_type": step.device_type,
        "level": level.value,  # plain data, as a file reads back
        "train": step.model.training if step.train is None else step.train,
        "loss_fn": getattr(loss_fn, "__qualname__", None) or (type(loss_fn).__name__ if loss_fn is not None else None),
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }
    if scaler is not None:
        config["scaler_scale"] = float(scaler.get_scale()) if scaler.is_enabled() else None
        config["scaler_growth_tracker"] = int(scaler.state_dict().get("_growth_tracker", 0)) if scaler.is_enabled() else None
    return config


def _same(a: Trace, b: Trace) -> bool:
    """Both runs name the same culprit, as the user sees it: phase, module, call, op, kind, and which
    of that call's ops of that name it was (record indices differ when a wrapper's first call records
    more: DDP's)."""
    if a.first is None or b.first is None:
        return a.first is b.first
    return _occurrence_key(a.first, a.records) == _occurrence_key(b.first, b.records)


def _occurrence_key(o: Occurrence, records: Sequence[Record]) -> tuple[object, ...]:
    nth = sum(1 for r in records[:o.output.index]
              if (r.phase, r.module, r.call_index, r.op) == (o.phase, o.output.module, o.output.call_index, o.op))
    return (o.phase, o.module, o.call_index, o.op, o.kind, nth)


COMPILED_NOTE = "the model is torch.compile'd: the eager original was replayed"


def state_notes(config: ReportConfig, compiled: bool) -> tuple[str, ...]:
    """What the step was replayed from that the findings alone do not say."""
    out: list[str] = []
    scale: float | None = config.get("scaler_scale")  # typed: a misspelt key is a mypy error
    if isinstance(scale, float) and not math.isfinite(scale):
        # GradScaler makes its scale tensor inside the step, as a literal: no op is its origin
        out.append(f"the GradScaler's scale is {scale}: every scaled loss and gradient is non-finite before any "
                   "op runs; fix the scaler state (nanhunt inspect flags it)")
    if compiled:
        out.append(COMPILED_NOTE)
    return tuple(out)


def _sinks_finite(records: Sequence[Record]) -> bool:
    """The loss value, the gradients and the update are finite. Intermediate values of the loss and of
    backward are no sinks: a checkpoint's recomputed -inf attention mask sits there on purpose."""
    loss = loss_index(records)
    return (loss is None or records[loss].finite) and all(
        r.finite for r in records if r.phase is Phase.UPDATE or r.role is Role.GRAD)


def module_status(records: Sequence[Record], tainted: frozenset[int], classes: Mapping[str, str]) -> dict[str, str]:
    """Per module: ``"inf in forward"``/``"nan in backward"``... for the first value that went
    non-finite there because of an origin (contained intentional -inf masks don't count); a module
    whose subtree went non-finite first says where (``"inf in forward, inside blocks.1.ff.wo"``): a
    parent, the root above all, is never "finite" over a non-finite child."""
    status = {name: "finite" for name in classes}
    first: dict[str, int] = {}  # module -> its first tainted record
    for i in sorted(tainted):
        r = records[i]
        if r.module is not None and r.module not in first:
            first[r.module] = i
    for name, i in first.items():
        status[name] = f"{'nan' if records[i].has_nan else 'inf'} in {records[i].phase.value}"
    inside: dict[str, tuple[int, str]] = {}  # ancestor -> (record, the descendant it is in), earliest
    for name, i in first.items():
        parts = name.split(".") if name else []
        for k in range(len(parts)):
            anc = ".".join(parts[:k])
            if i < first.get(anc, len(records)) and (anc not in inside or i < inside[anc][0]):
                inside[anc] = (i, name)  # earlier than anything of its own
    for anc, (i, name) in inside.items():
        if anc in status:
            status[anc] = f"{'nan' if records[i].has_nan else 'inf'} in {records[i].phase.value}, inside {name}"
    return status
