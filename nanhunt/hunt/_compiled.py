"""A compiled model's step, replayed the way it ran: the ladder eager -> aot_eager -> the recorded backend.

The traced replay runs the eager original (compiled kernels hide their ops). When that stays finite, the step
is run compiled from the same state, each rung ``repeat`` times: ``aot_eager`` (dynamo's and AOTAutograd's
graphs on eager kernels: what the capture and the graph transformations change) and the backend the model was
compiled with. A rung whose step is non-finite while eager was finite makes the verdict ``compile-induced``;
then the failing backend's forward graph is searched for its first non-finite node
(:func:`~nanhunt.tracing._graph_nodes.first_nonfinite_node`), and two ways out are tried: inductor's
``emulate_precision_casts`` (its float32 intermediates rounded where eager rounds them) and the located node's
module run in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch
from torch import nn

from .._util._compiled import (CompileSpec, GraphCapture, compile_module,
                               emulating_precision_casts, reset)
from .._util._dispatch import all_finite
from ..records import GraphNode, Repro, Rung, Verdict, VerdictKind
from ..step.step import Step
from ..tracing._graph_nodes import Found, first_nonfinite_node
from ._graph_repro import make_graph_repro

__all__ = ["Ladder", "climb"]


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The compiled rungs (eager's is the traced replay), how long they took, and the verdict when one failed."""

    rungs: tuple[Rung, ...]
    seconds: float
    verdict: Verdict | None
    repro: Repro | None = None  # the compiled graph's repro, with a bundle


def _finite_step(model: nn.Module, loss: torch.Tensor) -> bool:
    """The loss, every gradient and every parameter after the update are finite (one read of the device)."""
    return all_finite([loss.detach(), *(p.detach() for p in model.parameters()),
                       *(p.grad for p in model.parameters() if p.grad is not None)])


@contextlib.contextmanager
def _compiled_step(step: Step, spec: CompileSpec) -> Iterator[Step]:
    """``step`` whose model is its eager original compiled by ``spec`` (same parameters, same snapshot)."""
    reset()
    try:
        yield dataclasses.replace(step, model=compile_module(step.model, spec))
    finally:
        reset()


def _rung(step: Step, spec: CompileSpec, repeat: int, fp32: tuple[str, ...] = ()) -> Rung:
    failed = 0
    try:
        with _compiled_step(step, spec) as compiled:
            for _ in range(repeat):
                loss = compiled.run(fp32=tuple(f"_orig_mod.{name}" if name else "_orig_mod" for name in fp32))
                failed += not _finite_step(step.model, loss)
    except Exception as e:  # the eager step ran: what fails here is the compilation (Ctrl-C still stops)
        return Rung(spec.backend, 0, 0, error=_said(e))
    return Rung(spec.backend, repeat, failed)


def _said(e: Exception) -> str:
    """An exception in one line: dynamo's first lines name the backend and the error it raised."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()][:2]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def climb(step: Step, spec: CompileSpec, *, eager_runs: int, repeat: int = 1, bundle: str | None = None) -> Ladder:
    """The ladder of ``step`` (its eager replay already finite, ``eager_runs`` times) inside ``step.isolated()``:
    each compiled rung ``repeat`` times; at the first that fails, the verdict ``compile-induced`` with the graph
    node and the alternatives, and with ``bundle`` the graph's repro written there. The state is the step's start
    before each run and after."""
    start = time.perf_counter()
    rungs = [Rung("eager", eager_runs, 0)]
    backends = ["aot_eager"] + ([spec.backend] if spec.backend not in ("aot_eager", "eager") else [])
    failing: CompileSpec | None = None
    for backend in backends:
        rung_spec = spec.with_backend(backend) if backend != spec.backend else spec
        rung = _rung(step, rung_spec, repeat)
        rungs.append(rung)
        if rung.error is not None:
            break
        if rung.nonfinite:
            failing = rung_spec
            break
    if failing is None:
        return Ladder(tuple(rungs), time.perf_counter() - start, None)
    found = _locate(step, failing)
    located = found.node if isinstance(found, Found) else found
    repro = make_graph_repro(found, failing, bundle) if isinstance(found, Found) and bundle is not None else None
    alternatives: dict[str, bool] = {}
    tried: dict[str, Rung] = {}
    if failing.backend == "inductor":
        with emulating_precision_casts():
            tried["inductor emulate_precision_casts"] = _rung(step, failing, repeat)
    if isinstance(located, GraphNode) and located.module is not None:
        tried[f"{located.module or '<root>'} in float32"] = _rung(step, failing, repeat, fp32=(located.module,))
    # a way out that could not compile answers nothing
    alternatives = {name: not r.nonfinite for name, r in tried.items() if r.error is None}
    seconds = time.perf_counter() - start
    verdict = Verdict(kind=VerdictKind.COMPILE_INDUCED, rungs=tuple(rungs), replays=sum(r.runs for r in rungs),
                      seconds=seconds, alternatives=alternatives,
                      graph_node=located if isinstance(located, GraphNode) else None,
                      graph_note=located if isinstance(located, str) else None)
    return Ladder(tuple(rungs), seconds, verdict, repro)


def _locate(step: Step, spec: CompileSpec) -> Found | str:
    """The failing backend's first non-finite forward node: the step run once by ``spec``'s backend, keeping
    dynamo's graphs and, of each, the inputs of its first non-finite call, then the graphs searched."""
    capture = GraphCapture(step.device_type, spec)
    try:
        with _compiled_step(step, CompileSpec("capture", dynamic=False, fn=capture)) as captured:
            captured.run()
        return first_nonfinite_node(capture.graphs, spec, reset=reset)
    except Exception as e:  # the ladder's finding stands without its node
        return f"the search of the compiled graph failed: {_said(e)}"
    finally:
        reset()

