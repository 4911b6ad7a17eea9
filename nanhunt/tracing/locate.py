"""First-occurrence rules: records -> origins -> the first one.

An **origin** is a record whose non-finite value was created there: an op output
holding a kind of non-finite value (NaN, +Inf, -Inf) that the op's inputs (tensors
or Python scalars) cannot explain: a NaN while none of them holds one, a -Inf while
all of them are finite, a +Inf while none holds +Inf (nor a NaN, which hides the
infinities) and none holds a -inf the op could turn into +inf (an overflow behind
an intentional -inf mask is born where it overflows: exp of masked logits); or a
tensor that entered the step non-finite (batch, weights, optimizer state).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import networkx as nx

from .graph import SINKS, loss_index, nonfinite_graph, propagation_path, reached_sinks
from ..records import Level, Occurrence, Phase, Record, RecordView, Role

__all__ = ["LocateResult", "locate", "leading_origin", "origin_kind", "is_allowed", "FACTORS", "factor_negative"]

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


def _with_inplace(*names: str) -> tuple[str, ...]:
    return tuple(f"aten::{n}{u}" for n in names for u in ("", "_"))


# Ops that cannot turn a -inf argument into +inf, at some of their arguments: a +Inf they make there is an
# overflow (or comes from a +Inf argument), even when an intentional -inf mask is among their inputs. Positions
# count the op's floating tensor inputs in argument order (as records link them); None: every input. Any other
# op may turn a -inf into +inf (neg, abs, pow, a matmul with a negative weight, rsub): a -inf input explains it.
_KEEPS_NEG_INF: dict[str, tuple[int, ...] | None] = {
    **dict.fromkeys(_with_inplace("exp", "exp2", "expm1", "cumsum"), None),
    **dict.fromkeys(("aten::_to_copy", "aten::copy_", "aten::sum", "aten::mean", "aten::logsumexp"), None),
    # the attention mask (bias): the softmax's weights it makes are in [0, 1]; -inf in q or k may become +inf
    **dict.fromkeys(("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                     "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
                     "aten::_scaled_dot_product_fused_attention_overrideable", "aten::_efficient_attention_forward"),
                    (3,)),
}
_ADDS = frozenset(_with_inplace("add"))  # x + alpha * y
_SUBS = frozenset(_with_inplace("sub"))  # x - alpha * y
_MULS = frozenset(_with_inplace("mul"))
_DIVS = frozenset(_with_inplace("div"))
_ADDMMS = frozenset(_with_inplace("baddbmm", "addmm", "addbmm", "addmv"))  # beta * self + alpha * (a @ b)
# Where the factor that may negate an input sits: a keyword argument, or a position among all the arguments.
FACTORS: dict[str, str | int] = {**dict.fromkeys(_ADDS, "alpha"), **dict.fromkeys(_ADDMMS, "beta"),
                                 **dict.fromkeys(_MULS | _DIVS, 1)}

_RULED = frozenset(_KEEPS_NEG_INF) | frozenset(FACTORS) | _SUBS  # ops _keeps_neg_inf may say yes for


def factor_negative(op: str, args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
    """Whether the factor of an op of :data:`FACTORS` may be negative (``alpha`` of add, ``beta`` of addmm and
    baddbmm, the second operand of mul and div): a negative number, or anything but a Python number (a tensor:
    a floating one is measured by its own record). Absent, it is its default, 1."""
    where = FACTORS[op]
    v = kwargs.get(where, 1) if isinstance(where, str) else args[where] if len(args) > where else 1
    return not (isinstance(v, (int, float)) and v >= 0)


def _keeps_neg_inf(r: RecordView, pos: int, records: Sequence[RecordView], negated: bool) -> bool:
    """Op ``r`` cannot turn a -inf of its input at ``pos`` into +inf. ``negated``: its factor may be negative
    (:func:`factor_negative`). Positions are the schema's only when every tensor argument is floating: where a
    non-floating one may have shifted them, only what holds for every position counts."""
    op = r.op
    n = len(r.inputs)
    if op in _ADDS:
        return not negated
    if op in _SUBS:
        return pos == 0 and n == 2  # x's -inf stays: -inf - finite
    if op in _MULS:  # by a Python number >= 0, or by a tensor holding no negative value
        return not negated if n == 1 else n == 2 and records[r.inputs[1 - pos]].min >= 0
    if op in _DIVS:  # a denominator's -inf makes 0 or NaN; a numerator's stays -inf over a positive denominator
        return not negated if n == 1 else n == 2 and (pos == 1 or records[r.inputs[1]].min > 0)
    if op in _ADDMMS:
        return pos == 0 and not negated
    keep = _KEEPS_NEG_INF.get(op or "", ())
    return keep is None or pos in keep


def _explains_pos_inf(r: RecordView, pos: int, x: RecordView, records: Sequence[RecordView], negated: bool) -> bool:
    """Input ``x`` of ``r`` (at ``pos``; holding no NaN) can explain a +Inf of ``r``'s output."""
    return x.max == math.inf or (x.min == -math.inf and not _keeps_neg_inf(r, pos, records, negated))


@dataclass(frozen=True)
class LocateResult:
    first: Occurrence | None
    origins: tuple[Occurrence, ...]
    path: tuple[int, ...]
    tainted: frozenset[int] = frozenset()  # origins and every non-finite record they fed


def origin_kind(r: RecordView, records: Sequence[RecordView], *, may_mask: bool = True,
                negated: bool = False) -> str | None:
    """``"nan"``/``"inf"`` when ``r`` creates a non-finite value its inputs cannot explain, else ``None``.
    ``may_mask=False``: ``r`` cannot be a -inf mask (a normalisation layer's running statistics).
    ``negated``: ``r``'s op has a factor that may be negative (:func:`factor_negative`)."""
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
    if r.nonfinite_scalar is not None or any(i.has_nan for i in ins):
        return None  # a non-finite scalar (its sign unknown), or a NaN that may hide an input's infinities
    if r.min == -math.inf and all(i.finite for i in ins):
        return "inf"
    if r.max == math.inf and not any(_explains_pos_inf(r, k, x, records, negated) for k, x in enumerate(ins)):
        return "inf"  # +Inf where no input holds +Inf nor a -inf the op could turn into it: an overflow
    return None


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
    level: Level,
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
    negated: AbstractSet[int] = frozenset(),
) -> LocateResult:
    """Find every origin in ``records[start:]`` in order; ``first`` is the earliest not allowed.

    ``spans`` (module level) maps a module output record to the index where its
    call began: a module is no origin when one of its children already was. ``calls`` (module
    level) holds every module call as (first record, end, module, call index); ``not_masks``, the
    records that cannot be -inf masks (running statistics). ``sinks_seen=False`` (a scoped
    trace, which records neither the loss nor the model's output): ``reached`` stays unknown.
    ``index_uses`` (op level): records taken in by ops with no floating output (a cast to an index).
    ``negated`` (op level): records of ops whose factor may be negative (:func:`factor_negative`).
    With ``final=False`` (a check while the step runs) no propagation is computed.
    ``records`` may be any :class:`RecordView`; ``materialize(i)`` gives the
    :class:`Record` of index ``i`` for the occurrences (default: ``records[i]``).
    """
    if materialize is None:
        def materialize(i: int) -> Record:
            r = records[i]
            assert isinstance(r, Record)
            return r

    module_level = level == Level.MODULE
    masks: list[tuple[RecordView, str]] = []  # module level: the first module output holding only -inf
    found = _origin_records(records, module_level=module_level, start=start, spans=spans, not_masks=not_masks,
                            negated=negated, root_outputs=root_outputs, masks_out=masks)
    if final and not found and _sinks_bad(records, root_outputs):
        seeded = _scalar_seeded(records) or (masks[0] if masks else None)
        if seeded is not None:
            found.append(seeded)
    flows = _flows(records, found, root_outputs=root_outputs, module_level=module_level, sinks_seen=sinks_seen,
                   index_uses=index_uses, negated=negated) if final else {}
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
                    not_masks: AbstractSet[int], negated: AbstractSet[int], root_outputs: frozenset[int],
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
        kind = origin_kind(r, records, may_mask=r.index not in not_masks, negated=r.index in negated)
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
           module_level: bool, sinks_seen: bool, index_uses: AbstractSet[int],
           negated: AbstractSet[int]) -> dict[int, _Flow]:
    g = nonfinite_graph(records)
    _drop_unexplaining(g, records, negated)
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


def _drop_unexplaining(g: nx.DiGraph, records: Sequence[RecordView], negated: AbstractSet[int]) -> None:
    """Drop the edges into a record holding +Inf (no NaN, no -Inf) from the inputs that explain none of it: a
    mask's -inf taken by the exp that overflowed did not make its +Inf, so whatever made that -inf (an earlier
    origin, a log(0) mask) does not reach what the overflow made non-finite."""
    for n in list(g.nodes):
        r = records[n]
        if r.op not in _RULED or r.has_nan or r.min == -math.inf or r.nonfinite_scalar is not None:
            continue  # every non-finite input may explain what it holds
        keep = {i for k, i in enumerate(r.inputs)
                if records[i].has_nan or _explains_pos_inf(r, k, records[i], records, n in negated)}
        g.remove_edges_from([(i, n) for i in list(g.predecessors(n)) if i not in keep])


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
