"""The first node of a compiled forward graph whose value the failing backend makes non-finite while eager keeps
it finite, named by the user's module and line.

torch hands a backend the graph dynamo captured (its nodes carry ``nn_module_stack``, the modules the call ran
in, and ``stack_trace``, the user's frames). The graph run eagerly (an :class:`fx.Interpreter`) on one call's
inputs says which nodes are finite as eager computes them: a node eager makes non-finite too (a causal mask's
``-inf``, on purpose) is no candidate. A prefix of that graph, up to one node and returning that node's value,
compiled by the same backend and run on the same inputs (and random state), says whether that value is finite
as the backend computes it. A binary search over the prefixes of the candidates that lead to an output the
backend makes non-finite finds such a node in about log2(nodes) compiles; then its inputs are checked, and
while one that eager keeps finite is non-finite under the backend the search moves to it: the node named is
non-finite under the backend, finite in eager, and its inputs are as finite under the backend as in eager.

What it cannot see: a value inside a fused kernel that no node returns as it is in the whole graph (a prefix
ends the fusion at its last node, so its value is computed as the kernel's output, not its intermediate), the
backward graph (only the forward is searched), and a step whose forward is finite on the calls kept.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .._util._compiled import CompileSpec, GraphCall, compile_graph, rng_state, set_rng_state
from .._util._dispatch import nonfinite_kinds
from ..records import GraphNode

__all__ = ["Found", "first_nonfinite_node", "module_of", "source_of"]

_PATH_HEAD = re.compile(r"^L\['[^']*'\]\.?")  # dynamo's name of the module it was called on
_INDEX = re.compile(r"\[(\d+)\]")
_CHILD = re.compile(r"\._modules\['([^']*)'\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def module_of(node: fx.Node) -> tuple[str, str] | None:
    """The innermost module ``node`` ran in, as ``(named_modules() name, class name)``; None outside any."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    name = _CHILD.sub(r".\1", _INDEX.sub(r".\1", _PATH_HEAD.sub("", str(path)))).lstrip(".")
    return name, getattr(cls, "__qualname__", None) or str(cls)


def source_of(node: fx.Node) -> str | None:
    """The user's line that made ``node``: the last frame of its stack trace, as ``"file:line in function"``."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    file, line, fn = frames[-1]
    return f"{file}:{line} in {fn}"


def _candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes whose value is one floating-point tensor (what finiteness is about)."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if n.op in ("call_function", "call_method", "call_module") and isinstance(v, torch.Tensor) \
                and v.dtype.is_floating_point:
            out.append(n)
    return out


def _prefix(gm: fx.GraphModule, last: fx.Node) -> fx.GraphModule:
    """The graph up to ``last``, returning its value; every placeholder kept, so it takes the same inputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        env[n] = graph.node_copy(n, lambda x: env[x])
        if n is last:
            break
    graph.output(env[last])
    return fx.GraphModule(gm, graph)


def _peak(value: Any) -> torch.Tensor | None:
    """A floating tensor's largest magnitude, on its device (NaN when it holds one); None for anything else."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
        peak: torch.Tensor = torch.linalg.vector_norm(value.detach(), math.inf)
        return peak
    return None


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    return [value]


class _Eager(fx.Interpreter):
    """The graph run eagerly, keeping each node's peak (not its value: the interpreter frees values as it goes)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.peaks: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        peak = _peak(out)
        if peak is not None:
            self.peaks[n] = peak
        return out


def _run(fn: Callable[..., Any], call: GraphCall) -> Any:
    set_rng_state(call.rng)  # the draws of the call captured (dropout's mask)
    # the inputs as the step gave them, each run on its own copies (a graph may write into its inputs)
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in call.inputs]
    autocast = call.autocast
    with torch.no_grad(), torch.autocast(autocast[0] if autocast else "cpu", dtype=autocast[1] if autocast else None,
                                         enabled=autocast is not None):
        return fn(*args)


def _eager_kinds(gm: fx.GraphModule, call: GraphCall) -> dict[fx.Node, str | None]:
    """Each floating node's ``"nan"`` / ``"inf"`` / None (finite) as eager computes it, read from the device once."""
    eager = _Eager(gm)
    _run(eager.run, call)
    return dict(zip(eager.peaks, nonfinite_kinds(list(eager.peaks.values()))))


@dataclasses.dataclass(frozen=True)
class Found:
    """The node found, and what reproduces it: the graph's prefix up to it, the graph's inputs as the step gave
    them, the autocast they ran under."""

    node: GraphNode
    prefix: fx.GraphModule
    inputs: tuple[Any, ...]
    autocast: tuple[str, torch.dtype] | None


def first_nonfinite_node(graphs: Sequence[tuple[fx.GraphModule, GraphCall]], spec: CompileSpec, *,
                         reset: Callable[[], None]) -> Found | str:
    """Where the value goes non-finite in the first graph with an output ``spec``'s backend makes non-finite and
    eager keeps finite: a node on the way to that output, non-finite under the backend, finite in eager, its
    inputs as finite under the backend as in eager; a sentence saying why there is none otherwise. ``graphs``: what
    :class:`GraphCapture` kept. ``reset`` forgets compiled graphs between compiles (each prefix is a graph of its
    own). The process's random state is as it was afterwards."""
    saved = rng_state()
    try:
        for index, (gm, call) in enumerate(graphs):
            found = _search(gm, call, spec, reset)
            if found is None:
                continue
            if isinstance(found, str):
                return f"graph {index + 1} of {len(graphs)} {found}"
            node, kind, compiles = found
            module = module_of(node)
            return Found(GraphNode(node=node.name, target=_target(node), module=module[0] if module else None,
                                   module_class=module[1] if module else None, source=source_of(node), kind=kind,
                                   graph=index + 1, graphs=len(graphs), nodes=len(_candidates(gm)),
                                   compiles=compiles),
                         _prefix(gm, node), call.inputs, call.autocast)
    finally:
        set_rng_state(saved)
    return (f"no forward graph's output was non-finite under {spec.backend} where eager's is finite, on the inputs "
            "kept; the backward and the update were not searched")


def _search(gm: fx.GraphModule, call: GraphCall, spec: CompileSpec, reset: Callable[[], None],
            ) -> tuple[fx.Node, str, int] | str | None:
    """The node of one graph, with its kind and the compiles it took; a sentence when the graph's output goes
    non-finite between nodes; None when no output eager keeps finite is non-finite under ``spec``'s backend."""
    nodes = _candidates(gm)
    if not nodes:
        return None
    eager = _eager_kinds(gm, call)
    finite = {n for n in nodes if n in eager and eager[n] is None}  # a value eager makes non-finite is no answer
    reset()
    outs = [(n, v) for n, v in zip(_flat(next(n for n in gm.graph.nodes if n.op == "output").args[0]),
                                   _flat(_run(compile_graph(gm, spec), call)))
            if n in finite and isinstance(v, torch.Tensor)]
    failing = [n for (n, _), kind in zip(outs, nonfinite_kinds([v for _, v in outs])) if kind is not None]
    if not failing:
        return None
    compiles = 1
    known: dict[fx.Node, str | None] = {}

    def judge(n: fx.Node) -> str | None:
        """``n``'s value under the backend: the graph up to it, compiled and run."""
        nonlocal compiles
        if n not in known:
            reset()
            value = _run(compile_graph(_prefix(gm, n), spec), call)
            known[n] = next(filter(None, nonfinite_kinds([v for v in _flat(value) if isinstance(v, torch.Tensor)])),
                            None)
            compiles += 1
        return known[n]

    # the candidates: finite in eager, on a path to an output the backend makes non-finite (the last one is such
    # an output: every other leads to one)
    behind: set[fx.Node] = set()
    todo = list(failing)
    while todo:
        n = todo.pop()
        if n not in behind:
            behind.add(n)
            todo.extend(n.all_input_nodes)
    path = [n for n in nodes if n in finite and n in behind]
    if judge(path[-1]) is None:
        return (f"has an output {spec.backend} makes non-finite and eager keeps finite, but no node returned alone "
                "is: the value goes non-finite inside a fused kernel, between nodes")
    lo, hi = 0, len(path) - 1  # path[hi] is non-finite under the backend
    while lo < hi:
        mid = (lo + hi) // 2
        if judge(path[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    # non-finite under the backend does not stay so (a softmax of an overflow may be finite again): the node
    # found is checked, and while one of its inputs that eager keeps finite is not under the backend, that input
    # is where the value went non-finite first
    node = path[lo]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    while True:
        worse = next((i for i in sorted(node.all_input_nodes, key=order.__getitem__)
                      if i in finite and judge(i) is not None), None)
        if worse is None:
            break
        node = worse
    kind = known[node]
    assert kind is not None  # every node the search stands on was judged non-finite
    return node, kind, compiles


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return f"Tensor.{t}" if node.op == "call_method" else t
    name = getattr(t, "__name__", None) or str(t)
    if getattr(torch, name, None) is t:  # torch.exp, whose __module__ is torch's C extension
        return f"torch.{name}"
    module = getattr(t, "__module__", None)
    return f"{module}.{name}" if module else name
