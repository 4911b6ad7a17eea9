"""Dataflow among records (networkx): where a non-finite value went after it was born."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from ..records import Phase, RecordView, Role

__all__ = ["nonfinite_graph", "reached_sinks", "propagation_path", "loss_index"]

# What a value "reaching" means, in the order a report names them.
SINKS = ("output", "loss", "gradients", "update")


def nonfinite_graph(records: Sequence[RecordView]) -> nx.DiGraph:
    """Producer -> consumer edges between non-finite records only. A NaN output with a NaN input is
    explained by that input (NaN propagates whatever the others hold): an input holding only Inf is
    then no edge, so an absorbed Inf does not "reach" what another origin's NaN made non-finite."""
    g: nx.DiGraph = nx.DiGraph()
    for r in records:
        if r.finite:
            continue
        g.add_node(r.index)
        bad = [i for i in r.inputs if not records[i].finite]
        if r.has_nan and any(records[i].has_nan for i in bad):
            bad = [i for i in bad if records[i].has_nan]
        for i in bad:
            g.add_edge(i, r.index)
    return g


# Ops whose output values do not depend on their input's values: backward()'s gradient
# seed (ones_like(loss)) is one, made after the loss.
_VALUE_FREE = frozenset({"aten::ones_like", "aten::zeros_like", "aten::full_like", "aten::empty_like",
                         "aten::new_ones", "aten::new_zeros", "aten::new_full", "aten::new_empty"})


def loss_index(records: Sequence[RecordView]) -> int | None:
    """The loss value: the last value computed in phase loss (with a GradScaler, the scaled loss); when the model
    computes its own loss (an HF model's ``.loss``, a scalar it returns), none is, and the loss is what backward's
    gradient seed (``ones_like(loss)``, in phase loss) was made from."""
    for r in reversed(records):
        if r.phase is Phase.LOSS and r.op not in _VALUE_FREE:
            return r.index
    for r in reversed(records):
        if r.phase is Phase.LOSS and r.op in _VALUE_FREE and r.inputs:
            return r.inputs[0]
    return None


def _sink_kind(r: RecordView, root_outputs: frozenset[int], loss: int | None) -> str | None:
    """What the step hands on: the model's output, the loss value, the parameters'
    gradients, the update. Intermediate values of the loss or of backward are not sinks:
    a NaN that a later op absorbs there is silent."""
    if r.phase is Phase.UPDATE:
        return "update"
    if r.role is Role.GRAD:
        return "gradients"
    if r.index == loss:
        return "loss"
    if r.index in root_outputs:
        return "output"
    return None


def reached_sinks(
    g: nx.DiGraph, records: Sequence[RecordView], origin: int, root_outputs: frozenset[int], loss: int | None
) -> tuple[tuple[str, ...], int | None]:
    """Which sinks the origin's non-finite value reached, and the first sink record reached."""
    if origin not in g:
        return (), None
    found: dict[str, int] = {}
    for i in sorted({origin} | nx.descendants(g, origin)):
        kind = _sink_kind(records[i], root_outputs, loss)
        if kind is not None and kind not in found:
            found[kind] = i
    reached = tuple(k for k in SINKS if k in found)
    target = None
    for k in ("loss", "output", "gradients", "update"):
        if k in found:
            target = found[k]
            break
    return reached, target


def propagation_path(g: nx.DiGraph, origin: int, target: int | None) -> tuple[int, ...]:
    """Record indices from the origin to ``target`` through non-finite values only."""
    if target is None or origin not in g:
        return (origin,)
    try:
        return tuple(nx.shortest_path(g, origin, target))
    except nx.NetworkXNoPath:
        return (origin,)
