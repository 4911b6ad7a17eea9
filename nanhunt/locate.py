"""First-occurrence rules: records -> origins -> the first one.

An **origin** is a record whose non-finite value was created there: an op output
holding a NaN while none of the op's inputs (tensors or Python scalars) holds
one, or an Inf while all of them are finite; or a tensor that entered the step
non-finite (batch, weights, optimizer state).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import networkx as nx

from .graph import SINKS, loss_index, nonfinite_graph, propagation_path, reached_sinks
from .records import Occurrence, Phase, Record, RecordView, Role

__all__ = ["LocateResult", "locate", "leading_origin", "origin_kind", "is_allowed"]

_ENTERING = (Role.INPUT, Role.PARAM, Role.BUFFER, Role.STATE)
# Entering tensors that may hold -inf on purpose. A weight, a stale .grad or optimizer state holding
# -inf is a corruption from an earlier step, never a mask.
_MASKS = (Role.INPUT, Role.BUFFER)
_MODULE_GRADS = (Role.GRAD_OUTPUT, Role.GRAD)
# Ops whose extra output is a workspace kept for their own backward, never a value of the step: CTC's
# log-space alpha table holds log(0) = -inf for unreachable states, and its columns past a shorter target
# are never written (uninitialised memory: any value, NaN included, differing between runs). What such
# an output holds is harmless unless it reaches a sink (the loss output itself does).
_WORKSPACES = frozenset({"aten::_ctc_loss", "aten::_cudnn_ctc_loss"})


@dataclass(frozen=True)
class LocateResult:
    first: Occurrence | None
    origins: tuple[Occurrence, ...]
    path: tuple[int, ...]
    tainted: frozenset[int] = frozenset()  # origins and every non-finite record they fed


def origin_kind(r: RecordView, records: Sequence[RecordView], *, may_mask: bool = True) -> str | None:
    """``"nan"``/``"inf"`` when ``r`` creates a non-finite value from finite inputs, else ``None``.
    ``may_mask=False``: ``r`` cannot be a -inf mask (a normalisation layer's running statistics)."""
    if r.finite:
        return None
    if r.role in _ENTERING:
        if may_mask and r.role in _MASKS and not r.has_nan and r.max < math.inf:
            return None  # only -inf: an intentional mask (a causal-mask buffer, an additive attention mask)
        return "nan" if r.has_nan else "inf"
    if r.role is Role.UNWRITTEN:
        # Uninitialised memory written in part and read: its inputs are the allocation and every write into it
        # since (each measured); when all of those are finite, the unwritten part made it non-finite.
        if all(records[i].finite for i in r.inputs):
            return "nan" if r.has_nan else "inf"
        return None
    if r.role is not Role.OUTPUT:
        return None
    ins = [records[i] for i in r.inputs]
    if r.has_nan:
        if r.nonfinite_scalar == "nan" or any(i.has_nan for i in ins):
            return None
        return "nan"
    if r.nonfinite_scalar is not None or not all(i.finite for i in ins):
        return None
    return "inf"


def is_allowed(module: str | None, op: str | None, allow: Sequence[str]) -> bool:
    for a in allow:
        if module is not None and (module == a or module.startswith(a + ".")):
            return True
        if op is not None and (a == op or a == op.split("::", 1)[-1]):
            return True
    return False


def locate(
    records: Sequence[RecordView],
    *,
    level: str,
    classes: Mapping[str, str],
    root_outputs: frozenset[int],
    spans: Mapping[int, int],
    allow: Sequence[str] = (),
    start: int = 0,
    final: bool = True,
    materialize: Callable[[int], Record] | None = None,
    calls: Sequence[tuple[int, int, str, int]] = (),
    not_masks: AbstractSet[int] = frozenset(),
    sinks_seen: bool = True,
    index_uses: AbstractSet[int] = frozenset(),
) -> LocateResult:
    """Find every origin in ``records[start:]`` in order; ``first`` is the earliest not allowed.

    ``spans`` (module level) maps a module output record to the index where its
    call began: a module is no origin when one of its children already was. ``calls`` (module
    level) holds every module call as (first record, end, module, call index); ``not_masks``, the
    records that cannot be -inf masks (running statistics). ``sinks_seen=False`` (a scoped
    trace, which records neither the loss nor the model's output): ``reached`` stays unknown.
    ``index_uses`` (op level): records taken in by ops with no floating output (a cast to an index).
    With ``final=False`` (a check while the step runs) no propagation is computed.
    ``records`` may be any :class:`RecordView`; ``materialize(i)`` gives the
    :class:`Record` of index ``i`` for the occurrences (default: ``records[i]``).
    """
    if materialize is None:
        def materialize(i: int) -> Record:
            r = records[i]
            assert isinstance(r, Record)
            return r

    module_level = level == "module"
    masks: list[tuple[RecordView, str]] = []  # module level: the first module output holding only -inf
    found = _origin_records(records, module_level=module_level, start=start, spans=spans, not_masks=not_masks,
                            root_outputs=root_outputs, masks_out=masks)
    if final and not found and _sinks_bad(records, root_outputs):
        seeded = _scalar_seeded(records) or (masks[0] if masks else None)
        if seeded is not None:
            found.append(seeded)
    flows = _flows(records, found, root_outputs=root_outputs, module_level=module_level, sinks_seen=sinks_seen,
                   index_uses=index_uses) if final else {}
    origins: list[Occurrence] = []
    for r, kind in found:
        flow = flows.get(r.index, _Flow(None, (r.index,), False, (), frozenset()))
        module, call_index = _made_by(records, r, module_level, calls)
        out = materialize(r.index)
        origins.append(Occurrence(
            phase=r.phase,
            module=module,
            module_class=classes.get(module) if module is not None else None,
            call_index=call_index,
            op=r.op,
            kind=kind,
            source=out.source,
            output=out,
            inputs=tuple(materialize(i) for i in r.inputs),
            reached=flow.reached,
            allowed=is_allowed(module, r.op, allow),
            path=flow.path,
            harmless=flow.harmless,
            absorbed=flow.absorbed,
        ))
    first = leading_origin(origins)
    tainted = frozenset().union(*(f.spread for f in flows.values()))
    return LocateResult(first=first, origins=tuple(origins), path=() if first is None else first.path,
                        tainted=tainted)


def _origin_records(records: Sequence[RecordView], *, module_level: bool, start: int, spans: Mapping[int, int],
                    not_masks: AbstractSet[int], root_outputs: frozenset[int],
                    masks_out: list[tuple[RecordView, str]] | None = None) -> list[tuple[RecordView, str]]:
    """The records of ``records[start:]`` that create a non-finite value, with its kind, in order (one per
    op call; a module whose child already made it is none; module level: a module output holding only -inf
    may be a mask returned on purpose and goes to ``masks_out``)."""
    found: list[tuple[RecordView, str]] = []
    grads_nonfinite = module_level and any(not records[i].finite and records[i].role in _MODULE_GRADS
                                           for i in range(start))
    # (a -inf-only model output may be a mask returned on purpose: it does not hide what backward does)
    root_nonfinite = module_level and any(records[i].has_nan or records[i].max == math.inf
                                          for i in root_outputs if i < len(records))
    group, prev, last_group = 0, None, -1
    for k in range(start, len(records)):
        r = records[k]
        # Consecutive outputs of one op call (layer_norm's out, mean, rstd) form one group.
        key = (r.op, r.inputs, r.module, r.call_index, r.phase) if r.op is not None else None
        if key is None or key != prev:
            group += 1
        prev = key
        if r.finite:
            continue
        kind = origin_kind(r, records, may_mask=r.index not in not_masks)
        if kind is None and module_level and r.role in _MODULE_GRADS:
            # Module level sees no backward ops: the first non-finite gradient is where
            # backward went bad, unless the forward output already was.
            if not grads_nonfinite and not root_nonfinite:
                kind = "nan" if r.has_nan else "inf"
        if r.role in _MODULE_GRADS:
            grads_nonfinite = True
        if kind is None or group == last_group:
            continue  # no origin, or another output of the same op call
        last_group = group
        s = spans.get(r.index)
        if s is not None and any(not x.finite and x.phase is Phase.FORWARD for x in records[s : r.index]):
            continue  # a child of this module already made it
        if module_level and r.role is Role.OUTPUT and r.op is None and not r.has_nan and r.max < math.inf:
            # Module level does not see masked_fill's -inf scalar: a module returning -inf only may
            # mask on purpose (masked logits). It is the origin only when nothing else explains
            # non-finite sinks; a silent one is left to the op level.
            if masks_out is not None and not masks_out:
                masks_out.append((r, kind))
            continue
        found.append((r, kind))
    return found


@dataclass(frozen=True)
class _Flow:
    """Where an origin's non-finite values went."""

    reached: tuple[str, ...] | None  # None: unknown (the sinks were not recorded)
    path: tuple[int, ...]
    harmless: bool
    absorbed: tuple[int, ...]  # the first finite records that took them in
    spread: frozenset[int]  # the origin and every non-finite record it fed


def _flows(records: Sequence[RecordView], found: Sequence[tuple[RecordView, str]], *, root_outputs: frozenset[int],
           module_level: bool, sinks_seen: bool, index_uses: AbstractSet[int]) -> dict[int, _Flow]:
    g = nonfinite_graph(records)
    loss = loss_index(records)
    grads_bad = module_level and any(not x.finite and x.role is Role.GRAD for x in records)
    spread = {r.index: frozenset({r.index} | nx.descendants(g, r.index)) for r, _ in found}
    absorbed = _absorbed(records, set().union(*spread.values())) if spread else {}
    out: dict[int, _Flow] = {}
    for r, _ in found:
        reached: tuple[str, ...] | None
        reached, target = reached_sinks(g, records, r.index, root_outputs, loss)
        if module_level and "loss" in reached and "gradients" not in reached and grads_bad:
            # module level records no backward op: every gradient comes from the loss it reached
            reached = tuple(k for k in SINKS if k in reached or k == "gradients")
        if not sinks_seen:
            reached = None  # not "silent": the sinks were not recorded
        # it went only into integer / index / boolean results: no floating value took it in, and
        # an op with no floating output did (a value nothing used, a buffer it was stored in, is not)
        into = sorted({k for i in spread[r.index] for k in absorbed.get(i, ())})
        harmless = reached == () and (not into and bool(spread[r.index] & index_uses) or r.op in _WORKSPACES)
        out[r.index] = _Flow(reached, propagation_path(g, r.index, target), harmless, tuple(into[:8]),
                             spread[r.index])
    return out


def _made_by(records: Sequence[RecordView], r: RecordView, module_level: bool,
             calls: Sequence[tuple[int, int, str, int]]) -> tuple[str | None, int]:
    """The module call an origin is attributed to."""
    if r.phase is Phase.INPUT:
        return None, r.call_index  # the batch comes from outside the model (the call: the model call it entered)
    if module_level and r.role is Role.GRAD_OUTPUT and r.phase is Phase.BACKWARD and r.inputs:
        # The gradient w.r.t. a module's output is made by the backward of the module that consumed it.
        consumer = _consumer(records, r.inputs[0])
        if consumer is not None:
            return consumer.module, consumer.call_index
        return _enclosing(records, calls, r.inputs[0]) or (r.module, r.call_index)
    return r.module, r.call_index


def leading_origin(origins: Sequence[Occurrence]) -> Occurrence | None:
    """The culprit among a step's origins (execution order), none of them allowed: the first whose
    non-finite values reached a sink (output, loss, gradients, update); else, when all were absorbed,
    the first silent one that fed floating values; a harmless one (feeding only integer / index /
    boolean results) never leads. While the step runs (``reached`` unknown) the first one."""
    candidates = [o for o in origins if not o.allowed]
    if any(o.reached is None for o in candidates):
        return candidates[0]
    return next((o for o in candidates if o.reached), None) or next(
        (o for o in candidates if not o.harmless), None)


def _absorbed(records: Sequence[RecordView], nonfinite: set[int]) -> dict[int, list[int]]:
    """For the records of ``nonfinite``: the finite floating records that took them as an input."""
    out: dict[int, list[int]] = {}
    for r in records:
        if r.finite and r.role is Role.OUTPUT:
            for i in r.inputs:
                if i in nonfinite:
                    out.setdefault(i, []).append(r.index)
    return out


def _consumer(records: Sequence[RecordView], produced: int) -> RecordView | None:
    """Module level: the innermost module call that took record ``produced`` as an input
    (the last one in forward order, whose backward ran first)."""
    users = [
        r for r in records
        if r.role is Role.OUTPUT and r.op is None and r.phase is Phase.FORWARD and r.module is not None
        and produced in r.inputs
    ]
    inner = [u for u in users if not any(
        v.module is not None and u.module is not None and v.module.startswith(u.module + ".") if u.module else
        v.module not in (None, "")
        for v in users)]
    return inner[-1] if inner else None


def _sinks_bad(records: Sequence[RecordView], root_outputs: frozenset[int]) -> bool:
    """The loss value (the last loss-phase record), the parameters' gradients or the update are
    non-finite, or the model's output holds NaN or +Inf (a -Inf there is usually a mask returned
    on purpose); intermediate values, where -inf may sit on purpose, do not count."""
    loss = loss_index(records)
    return (loss is not None and not records[loss].finite) or any(
        not r.finite and (r.role is Role.GRAD or r.phase is Phase.UPDATE) for r in records) or any(
        records[i].has_nan or records[i].max == math.inf for i in root_outputs if i < len(records))


def _enclosing(records: Sequence[RecordView], calls: Sequence[tuple[int, int, str, int]],
               produced: int) -> tuple[str, int] | None:
    """Module level, no module call took record ``produced`` as an input: the code of the module
    call that ran its producer did (a parent's own ops between its children): the innermost call
    whose records hold ``produced``, other than the producer's own."""
    best: tuple[str, int] | None = None
    best_start = -1
    for start, end, module, call in calls:
        if start <= produced < end and start > best_start and module != records[produced].module:
            best, best_start = (module, call), start
    return best


def _scalar_seeded(records: Sequence[RecordView]) -> tuple[RecordView, str] | None:
    """No origin, yet the sinks are non-finite: the value came from a non-finite Python scalar
    (``torch.full(..., nan)``); name the first op that used one."""
    for r in records:
        if not r.finite and r.role is Role.OUTPUT and r.nonfinite_scalar is not None:
            if all(records[i].finite for i in r.inputs):
                return r, "nan" if r.has_nan else "inf"
    return None
