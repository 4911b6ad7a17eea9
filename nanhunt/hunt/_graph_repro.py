"""The repro of a compile-induced NaN: the compiled graph up to its first non-finite node, with the inputs the step
gave it, compiled by the recorded backend in a script of its own (``repro.py``, ``repro_inputs.pt``), verified in
a fresh process as the op repro is (:func:`nanhunt.hunt.repro.verify_repro`).

The graph is written by torch's own repro writer (the accuracy minifier's). The script needs only torch when the
backend is torch's own; a backend of yours is imported by its name, so it must be importable where the script runs
(verification runs it isolated, ``python -I``: an installed package's backend is, a script's or a test's is not).
Its compile settings are those the replay used (a capture's settings it left out are not written).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .._util._bundle import INPUTS, SCRIPT, claim
from .._util._compiled import CompileSpec, graph_source
from .._util._files import new_file, write_file
from .._util._text import dtype_name
from ..records import Repro
from ..tracing._graph_nodes import Found
from .repro import _MARK, DEFAULT_CAP, VERDICT_SOURCE, verify_repro

__all__ = ["write_graph_repro", "make_graph_repro"]

_TEMPLATE = '''"""nanhunt repro: the compiled graph up to its first non-finite node, run on the step's inputs.

Run: python {script}   (exit 1: reproduced, 0: finite, 2: error)
"""

import functools
import importlib
import os
import sys

import torch

{module}

NODE = {node!r}  # the first non-finite node, and where it is in your code
WHERE = {where!r}
BACKEND = {backend!r}  # torch's own backend, or package.module:function
SETTINGS = {settings!r}  # torch.compile's options or mode: those the replay compiled with
EXPECT = {expect!r}  # what nanhunt saw: "inf" or "nan"
AUTOCAST = {autocast}  # (device type, dtype) the graph ran under, or None
DEVICE = {device!r}  # where the step ran


def backend():
    if ":" not in BACKEND:
        return BACKEND
    module, _, name = BACKEND.partition(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    device = DEVICE if not DEVICE.startswith("cuda") or torch.cuda.is_available() else "cpu"
    t = [x.to(device) for x in torch.load(os.path.join(here, {inputs!r}), weights_only=True)]
    fn = torch.compile(Repro(), backend=backend(), dynamic=False, **SETTINGS)
    with torch.no_grad(), torch.autocast(AUTOCAST[0] if AUTOCAST else "cpu",
                                         dtype=AUTOCAST[1] if AUTOCAST else None, enabled=AUTOCAST is not None):
        out = fn(*t)
    print(f"{{NODE}} at {{WHERE}}")
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
            if isinstance(o, torch.Tensor) and o.is_floating_point()]
''' + VERDICT_SOURCE


def write_graph_repro(found: Found, spec: CompileSpec, directory: str, *, cap_bytes: int = DEFAULT_CAP) -> Repro:
    """Write ``repro.py`` and ``repro_inputs.pt`` into ``directory``; the Repro is not verified yet."""
    n = found.node
    tensors = [a.detach().cpu() for a in found.inputs if isinstance(a, torch.Tensor)]
    device = next((str(a.device) for a in found.inputs if isinstance(a, torch.Tensor)), "cpu")
    rp = Repro(op=f"{n.target} (compiled graph {n.graph} up to node {n.node}, {spec.backend})",
               device_type=torch.device(device).type,
               autocast_dtype=dtype_name(found.autocast[1]) if found.autocast else None,
               inputs=tuple((dtype_name(t.dtype), tuple(t.shape)) for t in tensors),
               nbytes=sum(t.numel() * t.element_size() for t in tensors),
               call=f"graph {n.graph} up to node {n.node}, compiled by {spec.backend}")
    if len(tensors) != len(found.inputs):
        return dataclasses.replace(rp, result="the graph takes inputs other than tensors (symbolic sizes): no script")
    if rp.nbytes > cap_bytes:
        return dataclasses.replace(rp, result=f"the graph's inputs take {rp.nbytes} bytes, more than the cap of "
                                              f"{cap_bytes} bytes")
    try:
        module = graph_source(found.prefix)
    except Exception as e:  # torch's writer refuses some graphs (opaque constants): said, not raised
        return dataclasses.replace(rp, result=f"torch could not write the graph as a script: {type(e).__name__}")
    where = " ".join(f"module {n.module or '<root>'}, {n.source or 'no source line'}".splitlines())
    autocast = "None" if found.autocast is None else f"({found.autocast[0]!r}, torch.{dtype_name(found.autocast[1])})"
    source = _TEMPLATE.format(node=f"{n.node} ({n.target})", where=where, script=SCRIPT, module=module,
                              backend=spec.backend, settings=spec.settings(), expect=n.kind, autocast=autocast,
                              device=device, inputs=INPUTS, mark=_MARK)
    claim(directory)  # a bundle: never a directory of files nanhunt did not write
    with new_file(os.path.join(directory, INPUTS)) as f:
        torch.save(tensors, f)
    write_file(os.path.join(directory, SCRIPT), source)
    return dataclasses.replace(rp, files=(SCRIPT, INPUTS), command=f"python {SCRIPT}")


def make_graph_repro(found: Found, spec: CompileSpec, directory: str) -> Repro:
    """:func:`write_graph_repro`, then run in a fresh process: verified when it makes the node's kind again."""
    rp = write_graph_repro(found, spec, directory)
    return verify_repro(directory, rp, found.node.kind)
