"""A verified minimal repro: the origin op alone, on its saved inputs, in a script that needs only torch.

:func:`nanhunt.hunt.pipeline.hunt` takes the origin op's call from the replay's second run: the tracer
keeps the call of the op that makes the culprit's record, its arguments cloned *before* the op runs
(an in-place op overwrites them), exactly as the kernel received them, that is after autocast cast
them. :func:`capture_origin_call` does the same in one more traced run, for a caller that has only
an occurrence.

:func:`write_repro` saves them (narrowed to the smallest slice that still
reproduces when they exceed the size cap) with a standalone ``repro.py``;
:func:`verify_repro` runs that script in a fresh Python process, and only a run
that prints the same kind of non-finite value marks the repro verified.
:func:`make_repro` does all three.

Example::

    step = Step.of(model, (x, y), loss_fn=loss_fn, dtype=torch.float16)
    report = hunt(step)
    rp = make_repro(step, report.first, "bundle/")
    report = dataclasses.replace(report, repro=rp)   # rp.verified: a fresh process reproduced it

(``hunt(step, bundle="bundle/")`` does the same in one call.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._util import _dispatch
from .._util._bundle import INPUTS, SCRIPT, claim
from .._util._tree import iter_leaves, iter_tensors, map_tensors
from .._util._files import new_file, write_file
from .._util._text import dtype_name
from ..capture.capture import split_batch
from ..tracing._ops import read_tensors
from ..tracing.locate import FACTORS, factor_negative, origin_kind
from ..records import Level, Occurrence, Phase, Record, Repro, Role
from ..tracing.stats import PendingStats
from ..step.step import Step
from ..tracing.tracer import Trace

__all__ = ["OriginCall", "capture_origin_call", "write_repro", "verify_repro", "make_repro", "DEFAULT_CAP",
           "VERDICT_SOURCE", "SCRIPT", "INPUTS"]

DEFAULT_CAP = 16 * 2**20  # bytes of saved inputs: small enough to attach to a ticket
_MARK = "nanhunt-repro:"
_MAX_TRIALS = 2000


@dataclass
class OriginCall:
    """One call of an aten op, with its arguments as the kernel received them (cloned)."""

    func: Any  # the OpOverload, e.g. torch.ops.aten.addmm.default
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    phase: Phase
    device_type: str
    autocast_dtype: torch.dtype | None  # the step's autocast dtype in forward/loss; None: autocast off
    ordinal: int = 0  # how many earlier calls of this op the same phase and module made
    notes: list[str] = field(default_factory=list)

    @property
    def op(self) -> str:
        return str(self.func._schema.name)

    @property
    def overload(self) -> str:
        return str(self.func._overloadname)

    def run(self, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
        """Run the op on fresh clones of the arguments; the floating outputs (written arguments included)."""
        a, k = _clone((self.args if args is None else args, self.kwargs if kwargs is None else kwargs))
        with torch.no_grad(), torch.autocast(self.device_type, dtype=self.autocast_dtype or torch.float32,
                                             enabled=self.autocast_dtype is not None):
            out = self.func(*a, **k)
        return _outputs(self.func, out, a, k)


# ------------------------------------------------------------------ catching the call


def _clone(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())


def _outputs(func: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    info = _dispatch.op_info(func)
    outs = list(iter_tensors(out))
    for i in info.written_args:
        if i < len(args):
            outs += list(iter_tensors(args[i]))
    for k in info.written_kwargs:
        outs += list(iter_tensors(kwargs.get(k)))
    seen: set[int] = set()
    return [o for o in outs if o.is_floating_point() and not (id(o) in seen or seen.add(id(o)))]  # type: ignore[func-returns-value]


def _born(call: OriginCall, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The op, run on these arguments, makes ``kind`` that they cannot explain: the tracer's origin rule
    (:func:`nanhunt.tracing.locate.origin_kind`) on their min / max, as the trace measures them."""
    outs = call.run(args, kwargs)
    ins = read_tensors(_dispatch.op_info(call.func), args, kwargs)
    pending = PendingStats()
    for i, t in enumerate([*ins, *outs]):
        pending.add(i, t)
    ranges = pending.read()
    scalars = list(iter_leaves((args, kwargs), float))
    scalar = "nan" if any(math.isnan(s) for s in scalars) else "inf" if any(math.isinf(s) for s in scalars) else None
    negated = call.op in FACTORS and factor_negative(call.op, args, kwargs)

    def record(i: int, t: torch.Tensor, role: Role) -> Record:
        return Record(index=i, phase=call.phase, module=None, call_index=0, op=call.op, role=role, dtype="",
                      shape=tuple(t.shape), min=ranges[i][0], max=ranges[i][1],
                      inputs=tuple(range(len(ins))) if role is Role.OUTPUT else (), nonfinite_scalar=scalar)

    records = [record(i, t, Role.INPUT) for i, t in enumerate(ins)]
    return any(origin_kind(out, [*records, out], negated=negated) == kind
               for out in (record(len(ins) + k, o, Role.OUTPUT) for k, o in enumerate(outs)))


def _went(kind: str, outs: list[torch.Tensor], dtype: str | None = None, shape: tuple[int, ...] | None = None) -> bool:
    """An output (of the recorded dtype and shape, when given) holds the kind of non-finite value."""
    for o in outs:
        if dtype is not None and dtype_name(o.dtype) != dtype:
            continue
        if shape is not None and tuple(o.shape) != shape:
            continue
        if bool(o.isnan().any()) if kind == "nan" else bool(o.isinf().any()):
            return True
    return False


def origin_call(step: Step, caught: tuple[Any, tuple[tuple[Any, ...], dict[str, Any]], Phase]) -> OriginCall:
    """The call a trace kept (``Trace._zooming(catch=...)``) as an :class:`OriginCall` of ``step``: autocast
    on in forward and loss (it cast the arguments the kernel received), off elsewhere."""
    func, (args, kwargs), phase = caught
    low = step.dtype if phase in (Phase.FORWARD, Phase.LOSS) and step.dtype != torch.float32 else None
    return OriginCall(func, args, kwargs, phase, step.device_type, low)


def capture_origin_call(step: Step, occurrence: Occurrence) -> OriginCall | None:
    """Run the step again under the tracer and return the call of the op that made the occurrence's record,
    its arguments cloned before it ran (the mechanism of a replay's second run, which :func:`nanhunt.hunt.pipeline.hunt`
    uses without this extra run); ``None`` when the occurrence names no op or the call did not come again.
    The occurrence must come from an op-level trace of the same step. The step's state is restored."""
    if occurrence.op is None:
        return None
    t = Trace._zooming(step.model, (), catch=occurrence, level=Level.OP, distributed=False)
    with step.isolated():
        step.run(within=t)
    caught = t._caught
    if caught is None or str(caught[0]._schema.name) != occurrence.op:
        return None
    return origin_call(step, caught)


# ------------------------------------------------------------------ shrinking


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


_Pick = Callable[[int, torch.Tensor], list[tuple[int, int, int]]]  # (tensor index, tensor) -> (dim, start, length)s


def _narrowed(obj: Any, pick: _Pick) -> Any:
    """``obj`` with each tensor narrowed along the (dim, start, length) triples ``pick`` gives it."""

    def fn(i: int, t: torch.Tensor) -> torch.Tensor:
        for d, start, length in pick(i, t):
            t = t.narrow(d, start, length)
        return t.clone()

    index = itertools.count()  # tensors numbered depth first, as iter_tensors meets them
    return map_tensors(obj, lambda t: fn(next(index), t))


def _halves(size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (0, size // 2), (size // 2, size - size // 2)


def _pick_size(size: int, a: int, n: int) -> _Pick:
    return lambda i, t: [(d, a, n) for d in range(t.dim()) if t.shape[d] == size]


def _pick_dims(pick: dict[int, int], a: int, n: int) -> _Pick:
    return lambda i, t: [(pick[i], a, n)] if i in pick else []


def _pick_one(ti: int, d: int, a: int, n: int) -> _Pick:
    return lambda i, t: [(d, a, n)] if i == ti else []


def _candidates(obj: Any) -> Iterator[Any]:
    """Halvings to try: one size halved in every tensor at once (keeps matmul and broadcast
    shapes consistent), then in two dims of equal size (a bias and its weight's columns), then
    one dim of one tensor."""
    tensors = list(iter_tensors(obj))
    dims = [(i, d, t.shape[d]) for i, t in enumerate(tensors) for d in range(t.dim()) if t.shape[d] > 1]
    for size in sorted({s for _, _, s in dims}, reverse=True):
        for a, n in _halves(size):
            yield _narrowed(obj, _pick_size(size, a, n))
    pairs = [(p, q) for k, p in enumerate(dims) for q in dims[k + 1:] if p[2] == q[2] and p[0] != q[0]]
    for p, q in sorted(pairs, key=lambda pq: -pq[0][2]):
        for a, n in _halves(p[2]):
            pick = {p[0]: p[1], q[0]: q[1]}
            yield _narrowed(obj, _pick_dims(pick, a, n))
    for ti, d, size in sorted(dims, key=lambda x: -tensors[x[0]].numel()):
        for a, n in _halves(size):
            yield _narrowed(obj, _pick_one(ti, d, a, n))


def shrink(call: OriginCall, kind: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The smallest arguments (by greedy halving) on which the op still makes ``kind`` that they cannot explain."""
    best: Any = (call.args, call.kwargs)
    trials = 0
    improved = True
    while improved and trials < _MAX_TRIALS:
        improved = False
        for cand in _candidates(best):
            trials += 1
            if trials >= _MAX_TRIALS:
                break
            if _nbytes(cand) >= _nbytes(best):
                continue
            try:
                ok = _born(call, kind, *cand)
            except Exception:  # shapes that no longer fit together: not a candidate
                ok = False
            if ok:
                best, improved = cand, True
                break
    return best[0], best[1]


# ------------------------------------------------------------------ the script


class _Unsupported(Exception):
    pass


def _literal(obj: Any, tensors: list[torch.Tensor], device_type: str) -> str:
    """Python source for an op argument; tensors become ``t[i]`` (saved in the inputs file)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return f"t[{len(tensors) - 1}]"
    if obj is None or isinstance(obj, (bool, int, str)):
        return repr(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return "float('nan')"
        if math.isinf(obj):
            return "float('inf')" if obj > 0 else "-float('inf')"
        return repr(obj)
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return str(obj)
    if isinstance(obj, torch.device):
        return "device" if obj.type == device_type else f"torch.device({str(obj)!r})"
    if isinstance(obj, (list, tuple)):
        items = [_literal(o, tensors, device_type) for o in obj]
        if isinstance(obj, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    raise _Unsupported(f"cannot write an argument of type {type(obj).__name__} into a script")


# The end of every repro script: is the output non-finite (exit 1), finite (0), or did it fail (2).
# A format string like the templates it ends, given ``mark``.
VERDICT_SOURCE = '''    nan = any(bool(o.isnan().any()) for o in outs)
    inf = any(bool(o.isinf().any()) for o in outs)
    for o in outs:
        print(f"  output: {{o.dtype}} {{list(o.shape)}} nan={{int(o.isnan().sum())}} "
              f"+inf={{int(o.isposinf().sum())}} -inf={{int(o.isneginf().sum())}}")
    if nan or inf:
        print("{mark} REPRODUCED " + ("nan" if nan else "inf") + " (nanhunt saw " + EXPECT + ")")
        return 1
    print("{mark} NOT REPRODUCED: the output is finite")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException as e:
        print(f"{mark} ERROR {{type(e).__name__}}: {{e}}", file=sys.stderr)
        code = 2
    sys.exit(code)
'''

_TEMPLATE = '''#!/usr/bin/env python3
"""Minimal repro written by nanhunt: one aten op alone, on its saved inputs. Needs only torch.

    python {script} [--device cpu|cuda]

The inputs in {inputs} are the tensors the op received (already cast by autocast);
the op runs as it ran in the step. Exit status: 1 when the output is non-finite
(reproduced), 0 when it is finite, 2 when the script could not run.
"""

import argparse
import os
import sys

import torch

OP = {op!r}
EXPECT = {expect!r}  # what nanhunt saw: "inf" or "nan"
WHERE = {where!r}
AUTOCAST_DTYPE = {autocast}  # None: autocast off for this op
RECORDED_DEVICE = {device!r}


def tensors(x):
    """The tensors in an output or argument: a tensor, or a (nested) tuple or list of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in tensors(item)]
    return []


def run(t, device):
    with torch.no_grad(), torch.autocast(device_type=torch.device(device).type,
                                         dtype=AUTOCAST_DTYPE or torch.float32,
                                         enabled=AUTOCAST_DTYPE is not None):
        out = {call}
    # The op's outputs and the arguments it writes in place (a tensor or a list of them)
    return [o for o in tensors({outputs}) if o.is_floating_point()]


def main():
    parser = argparse.ArgumentParser(description="nanhunt repro of " + OP)
    parser.add_argument("--device", default=RECORDED_DEVICE)
    device = parser.parse_args().device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: running on cpu instead (kernels can differ)")
        device = "cpu"
    here = os.path.dirname(os.path.abspath(__file__))
    t = [x.to(device) for x in torch.load(os.path.join(here, {inputs!r}), weights_only=True)]
    print(f"{{OP}} at {{WHERE}}")
    for i, x in enumerate(t):
        fin = bool(x.isfinite().all()) if x.is_floating_point() else True
        big = x.abs().max().item() if x.is_floating_point() and x.numel() else 0
        print(f"  input t[{{i}}]: {{x.dtype}} {{list(x.shape)}} max|x|={{big:.4g}} finite={{fin}}")
    outs = run(t, device)
''' + VERDICT_SOURCE


def _where(occ: Occurrence) -> str:
    where = f"phase {occ.phase.value}"
    if occ.module is not None:
        where += f", module {occ.module or '<root>'}"
        if occ.module_class:
            where += f" ({occ.module_class}, call {occ.call_index})"
    if occ.source:
        where += f", {occ.source}"
    return " ".join(where.splitlines())


def write_repro(call: OriginCall, occurrence: Occurrence, directory: str, *, cap_bytes: int = DEFAULT_CAP) -> Repro:
    """Write ``repro.py`` and ``repro_inputs.pt`` into ``directory``; the Repro is not verified yet.

    Inputs above ``cap_bytes`` are narrowed to the smallest slice that still reproduces in
    this process (:func:`shrink`); when none fits, nothing is written and ``result`` says why."""
    args, kwargs = call.args, call.kwargs
    original = tuple(tuple(t.shape) for t in iter_tensors((args, kwargs)))
    rp = Repro(op=call.op, overload=call.overload, device_type=call.device_type, autocast_dtype=_name(call.autocast_dtype))
    try:
        outs = call.run()
        if not _went(occurrence.kind, outs) and call.autocast_dtype is not None:
            # The op ran with autocast locally disabled (keep_fp32, a user's autocast(enabled=False)).
            plain = dataclasses.replace(call, autocast_dtype=None)
            if _went(occurrence.kind, plain.run()):
                call = plain
                rp = dataclasses.replace(rp, autocast_dtype=None)
    except Exception as e:
        return dataclasses.replace(rp, result=f"the op fails when run alone: {type(e).__name__}: {_first_line(e)}")
    sliced = _nbytes((args, kwargs)) > cap_bytes
    if sliced:
        args, kwargs = shrink(call, occurrence.kind)
    tensors: list[torch.Tensor] = []
    try:
        arg_src = [_literal(a, tensors, call.device_type) for a in args]
        arg_src += [f"{k}={_literal(v, tensors, call.device_type)}" for k, v in kwargs.items()]
    except _Unsupported as e:
        return dataclasses.replace(rp, result=str(e))
    rp = dataclasses.replace(rp, inputs=tuple((_name(t.dtype) or "", tuple(t.shape)) for t in tensors),
                             nbytes=_nbytes(tensors), sliced=sliced, original_shapes=original if sliced else ())
    if rp.nbytes > cap_bytes:
        return dataclasses.replace(rp, result=f"inputs of {rp.nbytes} bytes exceed the cap of {cap_bytes} bytes and "
                                              "no smaller slice reproduces")
    # The source of each written argument (``t[i]`` or a list of them): the script reads them after the op.
    written = [arg_src[i] for i in _dispatch.op_info(call.func).written_args
               if i < len(args) and any(True for _ in iter_tensors(args[i]))]
    ns, _, _ = call.op.partition("::")
    call_src = f"torch.ops.{ns}.{call.func._overloadpacket.__name__}.{call.overload}({', '.join(arg_src)})"
    source = _TEMPLATE.format(
        script=SCRIPT, inputs=INPUTS, op=call.op, expect=occurrence.kind, where=_where(occurrence),
        autocast="None" if rp.autocast_dtype is None else f"torch.{rp.autocast_dtype}",
        device=call.device_type, call=call_src, outputs="[out" + "".join(", " + w for w in written) + "]",
        mark=_MARK,
    )
    claim(directory)  # a bundle: never a directory of files nanhunt did not write
    # New files renamed onto their names: a link planted at either name is refused, never written through.
    with new_file(os.path.join(directory, INPUTS)) as f:
        # Every tensor is a clone (its own storage, strides kept): the file holds just their values.
        torch.save([t.detach().cpu() for t in tensors], f)
    write_file(os.path.join(directory, SCRIPT), source)
    device_flag = "" if call.device_type == "cpu" else f" --device {call.device_type}"
    return dataclasses.replace(rp, call=call_src, files=(SCRIPT, INPUTS), command=f"python {SCRIPT}{device_flag}")


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else dtype_name(dtype)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""


def verify_repro(directory: str, repro: Repro, kind: str, *, timeout: float = 300.0,
                 python: str | None = None) -> Repro:
    """Run the script in a fresh, isolated Python process; verified only when it reproduced ``kind``."""
    if SCRIPT not in repro.files:
        return repro
    cmd = [python or sys.executable, "-I", SCRIPT]
    if repro.device_type != "cpu":
        cmd += ["--device", repro.device_type]
    try:
        proc = subprocess.run(cmd, cwd=directory, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dataclasses.replace(repro, verified=False, result=f"the script ran past {timeout:.0f} s")
    except OSError as e:
        return dataclasses.replace(repro, verified=False, result=f"the script could not start: {e.strerror}")
    m = re.search(re.escape(_MARK) + r" REPRODUCED (nan|inf)", proc.stdout)
    if proc.returncode == 1 and m is not None:
        got = m.group(1)
        if got == kind:
            return dataclasses.replace(repro, verified=True, result=got)
        return dataclasses.replace(repro, verified=False, result=f"the script got {got}, nanhunt saw {kind}")
    if proc.returncode == 0:
        return dataclasses.replace(repro, verified=False, result="the script ran and its output was finite")
    err = (proc.stderr.strip().splitlines() or ["no message"])[-1]
    return dataclasses.replace(repro, verified=False, result=f"the script failed (exit {proc.returncode}): {err}")


def make_repro(
    step: Step,
    occurrence: Occurrence | None,
    directory: str,
    *,
    cap_bytes: int = DEFAULT_CAP,
    verify: bool = True,
    call: OriginCall | None = None,
    rerun: bool = True,
) -> Repro | None:
    """Catch the origin op, write its repro into ``directory`` and run it in a fresh process.

    ``None`` when there is no op to reproduce (a clean step, or a value that entered the step
    non-finite: batch, weights, optimizer state). Otherwise a :class:`Repro`; put it in the report
    with ``dataclasses.replace(report, repro=...)``. ``call``: the origin's call when a trace already caught
    it (a replay's second run); otherwise the step runs once more to catch it, unless ``rerun`` is False (one
    rank of a distributed replay: a run of its own would wait in collectives no other rank joins).
    """
    if occurrence is None or occurrence.op is None:
        return None
    if call is None and not rerun:
        return Repro(op=occurrence.op, device_type=step.device_type,
                     result="the replay's second run did not catch the op's call; for a repro, replay this rank's "
                     "batch in one process (--rank R --bundle DIR)")
    if call is None:
        call = capture_origin_call(step, occurrence)
    if call is None:
        return Repro(op=occurrence.op, device_type=step.device_type,
                     result="no call of the op matched the origin when the step ran again")
    rp = write_repro(call, occurrence, directory, cap_bytes=cap_bytes)
    return verify_repro(directory, rp, occurrence.kind) if verify else rp
