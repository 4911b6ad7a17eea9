"""The first node of a compiled forward graph whose value the failing backend makes non-finite, named by the
user's module and line.

torch hands a backend the graph dynamo captured (its nodes carry ``nn_module_stack``, the modules the call ran
in, and ``stack_trace``, the user's frames). A prefix of that graph, up to one node and returning that node's
value, compiled by the same backend and run on the graph's inputs as the step gave them, says whether that value
is finite as the backend computes it. A binary search over the prefixes finds the first node that is not, in
log2(nodes) compiles. What it cannot see: a value inside a fused kernel that no node returns as it is in the
whole graph (a prefix ends the fusion at its last node, so its value is computed as the kernel's output, not
its intermediate), the backward graph (only the forward is searched), and a step whose forward is finite.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .._util._compiled import CompileSpec, compile_graph
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


def _kind(value: Any) -> str | None:
    """``"nan"`` / ``"inf"`` for a tensor (or tensors) holding one, None when all is finite."""
    tensors = [v for v in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return "nan" if bool(torch.isnan(t).any()) else "inf"
    return None


def _run(fn: Callable[..., Any], inputs: Sequence[Any], autocast: tuple[str, torch.dtype] | None) -> Any:
    # the inputs as the step gave them, each call on its own copies (a graph may write into its inputs)
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in inputs]
    with torch.no_grad(), torch.autocast(autocast[0] if autocast else "cpu", dtype=autocast[1] if autocast else None,
                                         enabled=autocast is not None):
        return fn(*args)


@dataclasses.dataclass(frozen=True)
class Found:
    """The node found, and what reproduces it: the graph's prefix up to it, the graph's inputs as the step gave
    them, the autocast they ran under."""

    node: GraphNode
    prefix: fx.GraphModule
    inputs: tuple[Any, ...]
    autocast: tuple[str, torch.dtype] | None


def first_nonfinite_node(graphs: Sequence[tuple[fx.GraphModule, tuple[Any, ...], tuple[str, torch.dtype] | None]],
                         spec: CompileSpec, *, reset: Callable[[], None]) -> Found | str:
    """The first node, in the first graph whose output ``spec``'s backend makes non-finite, whose own value is
    non-finite; a sentence saying why there is none otherwise. ``graphs``: what :class:`GraphCapture` kept.
    ``reset`` forgets compiled graphs between compiles (each prefix is a graph of its own)."""
    for index, (gm, inputs, autocast) in enumerate(graphs):
        nodes = _candidates(gm)
        if not nodes:
            continue
        reset()
        if _kind(_run(compile_graph(gm, spec), inputs, autocast)) is None:
            continue
        compiles = 1
        found: tuple[fx.Node, str] | None = None
        lo, hi = 0, len(nodes) - 1  # the answer lies in [lo, hi] if any node is non-finite
        last_kind: str | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            reset()
            kind = _kind(_run(compile_graph(_prefix(gm, nodes[mid]), spec), inputs, autocast))
            compiles += 1
            if kind is not None:
                found, last_kind, hi = (nodes[mid], kind), kind, mid - 1
            else:
                lo = mid + 1
        if found is None:
            return (f"graph {index + 1} of {len(graphs)} has a non-finite output under {spec.backend}, but no node "
                    f"returned alone is: the value goes non-finite inside a fused kernel, between nodes")
        node = found[0]
        module = module_of(node)
        return Found(GraphNode(node=node.name, target=_target(node), module=module[0] if module else None,
                               module_class=module[1] if module else None, source=source_of(node),
                               kind=last_kind or "nan", graph=index + 1, graphs=len(graphs), nodes=len(nodes),
                               compiles=compiles),
                     _prefix(gm, node), inputs, autocast)
    return (f"every forward graph's output is finite under {spec.backend}: the non-finite value is born in the "
            "compiled backward or the update, which this localisation does not search")


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return f"Tensor.{t}" if node.op == "call_method" else t
    name = getattr(t, "__name__", None) or str(t)
    if getattr(torch, name, None) is t:  # torch.exp, whose __module__ is torch's C extension
        return f"torch.{name}"
    module = getattr(t, "__module__", None)
    return f"{module}.{name}" if module else name
