"""torch.compile's machinery, in one place: what a compiled module was compiled with, compiling a module or a
graph again the same way, inductor's precision-cast emulation, and the graphs dynamo hands a backend.

torch keeps the backend a ``torch.compile``d module runs with inside its wrapper (``OptimizedModule``), behind
private attributes; this module reads them and nothing else does. What it reads becomes a :class:`CompileSpec`,
plain data but for a backend given as a callable, which a capture records by its name only.

A capture's record is untrusted: inductor's options reach the C++ compiler's command line (``cpp.cxx``,
``cpp.march``) and the disk (``trace.debug_dir``). :func:`settle` keeps of a record only what cannot name a
program, a path, a compiler flag or a directory (:data:`SAFE_OPTIONS`, :data:`SAFE_MODES`, the dynamic flag),
unless you confirm the file's settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import fx, nn

from ._dispatch import all_finite
from ._text import escaped
from ._tree import iter_tensors

__all__ = ["CompileSpec", "TORCH_BACKENDS", "SAFE_OPTIONS", "SAFE_MODES", "settle", "replay_flags", "spec_of",
           "record_of", "read_record", "compile_module", "compile_graph", "reset", "emulating_precision_casts",
           "GraphCapture", "GraphCall", "RngState", "rng_state", "set_rng_state", "graph_source"]

# torch's own backends: a name from a file that is one of these is used as it is; any other needs confirming
TORCH_BACKENDS = ("inductor", "aot_eager", "eager")

# The options a capture's file may set unconfirmed, each with why it is safe. Every one is a bool that changes
# which of torch's own kernels runs, or how one rounds, orders or draws what it computes (what a compiled NaN
# depends on); none names a path, a program, a compiler flag or a directory, and a bool cannot smuggle one in.
# Any other option is used only when you confirm the file's settings: cpp.cxx and cpp.march reach the C++
# compiler's command line, trace.debug_dir and the cache options the disk, and most of the rest are strings,
# numbers or lists whose effect nobody has read line by line.
SAFE_OPTIONS: Mapping[str, str] = MappingProxyType({
    "max_autotune": "picks among torch's own kernels by timing them: another kernel, other rounding",
    "max_autotune_pointwise": "the same choice for element-wise ops and reductions",
    "max_autotune_gemm": "the same choice for matrix multiplications",
    "coordinate_descent_tuning": "tunes the block sizes of torch's own kernels: another order of their sums",
    "split_reductions": "splits a long reduction over several kernels: another order of its sums",
    "aggressive_fusion": "fuses more ops into one kernel: more intermediates stay float32",
    "epilogue_fusion": "fuses element-wise ops into a matmul's kernel: its result is not rounded in between",
    "emulate_precision_casts": "rounds float32 intermediates to the half dtype where eager stores them",
    "fallback_random": "draws random numbers with eager's generator instead of inductor's own",
    "deterministic": "skips the on-device benchmarks whose choice changes the numbers from run to run",
    "triton.cudagraphs": "launches the same kernels as one CUDA graph (mode reduce-overhead), whose reused "
                         "output buffers are themselves a known source of wrong values",
})

# torch.compile's documented modes: each names a fixed set of options from torch's own table (all of them on
# SAFE_OPTIONS), never the file's; any other mode needs confirming. The dynamic flag (True, False, None) is used
# as recorded: it decides whether kernels are specialised to the shapes, which changes only what they compute.
SAFE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """How a module was compiled: ``backend`` a name (torch's own, or ``package.module:function`` for a callable),
    ``mode`` (inductor folds its mode into ``options``), ``options`` (JSON values only), ``dynamic``; ``fn`` the
    backend callable itself when it is live (a model compiled in this process), else None."""

    backend: str
    mode: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dynamic: bool | None = None
    fn: Callable[..., Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "mode": self.mode, "options": dict(self.options), "dynamic": self.dynamic}

    def with_backend(self, backend: str) -> CompileSpec:
        """The same settings on another of torch's backends (inductor's options do not apply to the others)."""
        if backend == self.backend:
            return self
        return CompileSpec(backend, self.mode if backend == "inductor" else None,
                           self.options if backend == "inductor" else {}, self.dynamic)

    def target(self) -> str | Callable[..., Any]:
        """What ``torch.compile(backend=)`` takes."""
        return self.fn if self.fn is not None else self.backend

    def settings(self) -> dict[str, Any]:
        """What ``torch.compile`` takes besides the backend and the dynamic flag: the options, else the mode.
        Inductor given both gets its mode's options under them, as torch itself folds them."""
        if self.options and self.mode not in (None, "default") and self.backend == "inductor":
            from torch._inductor import list_mode_options

            modes = list_mode_options(None, self.dynamic)
            if self.mode not in modes:
                raise ValueError(f"unknown mode {self.mode!r}: torch's are {', '.join(modes)}")
            return {"options": {**modes[self.mode], **self.options}}
        if self.options:
            return {"options": dict(self.options)}
        return {"mode": self.mode} if self.mode is not None else {}


def settle(spec: CompileSpec, *, trusted: bool) -> tuple[CompileSpec, tuple[str, ...]]:
    """The settings of a recorded ``spec`` that its replay uses, and those it leaves out (``key=value``, escaped
    and cut short). ``trusted`` (you confirmed the file's settings): all of them. Else its dynamic flag, its mode
    when one of :data:`SAFE_MODES` and its options on :data:`SAFE_OPTIONS` with a bool value."""
    if trusted:
        return spec, ()

    def safe(key: str, value: Any) -> bool:
        return key in SAFE_OPTIONS and isinstance(value, bool)

    left = [f"{_short(escaped(k), 60)}={_short(json.dumps(v), 100)}" for k, v in spec.options.items()
            if not safe(k, v)]
    if spec.mode is not None and spec.mode not in SAFE_MODES:
        left.insert(0, f"mode={_short(json.dumps(spec.mode), 100)}")  # JSON text: ASCII, every control escaped
    used = CompileSpec(spec.backend, spec.mode if spec.mode in SAFE_MODES else None,
                       {k: v for k, v in spec.options.items() if safe(k, v)}, spec.dynamic, fn=spec.fn)
    return used, tuple(left)


def replay_flags(record: Mapping[str, Any]) -> list[str]:
    """The flags a replay of a capture holding ``record`` (what :func:`record_of` gave) needs to compile as the
    step ran: ``--compile NAME`` for a backend of yours, ``--trust-compile-options`` for settings that
    :func:`settle` leaves out (a backend you name gets none of them unconfirmed)."""
    spec = read_record(record)
    if spec is None:
        return []
    own = spec.backend in TORCH_BACKENDS
    left = settle(spec, trusted=False)[1] if own else spec.options or spec.mode is not None
    return ([] if own else ["--compile", spec.backend]) + (["--trust-compile-options"] if left else [])


def _short(text: str, n: int) -> str:
    """``text`` cut at ``n`` characters (a value from a file may be megabytes long)."""
    return text if len(text) <= n else text[:n] + "..."


def _json_value(v: Any) -> bool:
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _name_of(fn: Any) -> str:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return type(fn).__qualname__
    return f"{module}:{qualname}"


def spec_of(model: nn.Module) -> CompileSpec | None:
    """How ``model`` (an ``OptimizedModule``, or a LightningModule that Lightning's Trainer took out of one) was
    compiled; None for a module that is not compiled or whose wrapper this torch lays out differently."""
    ctx = getattr(model, "dynamo_ctx", None)
    lightning = getattr(model, "_compiler_ctx", None)  # Lightning unwraps a compiled module it is given, keeping this
    if ctx is None and isinstance(lightning, Mapping):
        ctx = lightning.get("dynamo_ctx")
    backend = getattr(ctx, "callback", None)
    for _ in range(8):  # torch wraps the backend a few times (error catching, the minifier's debug wrapper)
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    if backend is None:
        return None
    dynamic = getattr(backend, "dynamic", None)
    dynamic = dynamic if isinstance(dynamic, bool) else None
    if type(backend).__name__ == "_TorchCompileInductorWrapper":  # the mode is already in its config
        config = getattr(backend, "config", {}) or {}
        return CompileSpec("inductor", None, {k: v for k, v in config.items() if _json_value(v)}, dynamic)
    name, fn = getattr(backend, "compiler_name", None), getattr(backend, "compiler_fn", None)
    if not isinstance(name, str) or fn is None:
        return None
    kwargs = getattr(backend, "kwargs", {}) or {}
    mode = kwargs.get("mode") if isinstance(kwargs.get("mode"), str) else None
    options = {k: v for k, v in (kwargs.get("options") or {}).items() if _json_value(v)}
    if name in TORCH_BACKENDS:
        return CompileSpec(name, mode, options, dynamic)
    return CompileSpec(_name_of(fn), mode, options, dynamic, fn=fn)


def record_of(model: nn.Module) -> dict[str, Any] | None:
    """What a capture records of how ``model`` was compiled (plain data), None when it was not; the model a
    Guard or callback watches may be the compiled wrapper itself or hold it (DDP's ``module``)."""
    for _ in range(4):
        spec = spec_of(model)
        if spec is not None:
            return spec.to_dict()
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


def read_record(d: Any) -> CompileSpec | None:
    """The :class:`CompileSpec` a capture recorded, as the file says (untrusted: every field type-checked, nothing
    imported; a backend that is not one of :data:`TORCH_BACKENDS` is a name only, which ``--compile NAME``
    confirms, and what is used of the settings :func:`settle` says); None when the step did not run compiled."""
    if d is None:
        return None
    if not isinstance(d, Mapping) or not isinstance(d.get("backend"), str):
        raise ValueError("its 'compile' is not a record of a compilation (a backend name and its settings)")
    mode, options, dynamic = d.get("mode"), d.get("options") or {}, d.get("dynamic")
    if mode is not None and not isinstance(mode, str) or dynamic is not None and not isinstance(dynamic, bool) \
            or not isinstance(options, Mapping) or not all(isinstance(k, str) and _json_value(v)
                                                           for k, v in options.items()):
        raise ValueError("its 'compile' holds a mode, options or dynamic flag of the wrong type")
    return CompileSpec(str(d["backend"]), mode, dict(options), dynamic)


def compile_module(module: nn.Module, spec: CompileSpec) -> nn.Module:
    """``module`` compiled as ``spec`` says (it shares the module's parameters and buffers)."""
    compiled = torch.compile(module, backend=spec.target(), dynamic=spec.dynamic, **spec.settings())
    assert isinstance(compiled, nn.Module)  # torch.compile of a module gives its OptimizedModule
    return compiled


def compile_graph(gm: fx.GraphModule, spec: CompileSpec) -> Callable[..., Any]:
    """A graph dynamo captured, compiled again by ``spec``'s backend and settings (static shapes: the inputs are
    fixed)."""
    return torch.compile(gm, backend=spec.target(), dynamic=False, **spec.settings())


def graph_source(gm: fx.GraphModule) -> str:
    """``gm`` as the source of a module class ``Repro`` with its imports (torch's own repro writer, the one
    its accuracy minifier writes its scripts with)."""
    from torch._dynamo.debug_utils import NNModuleToString

    return str(NNModuleToString.convert(gm))


def reset() -> None:
    """Forget every compiled graph (the next call compiles anew)."""
    import torch._dynamo

    torch._dynamo.reset()


@contextlib.contextmanager
def emulating_precision_casts() -> Iterator[None]:
    """Inductor rounds its float32 intermediates to the half dtype where eager would store them."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=True):
        yield


# torch's generator state, and every CUDA device's when CUDA is in use (a graph's dropout draws from them)
RngState = tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One call of a graph dynamo captured: its inputs (detached copies, as the step gave them), the autocast it
    ran under (device type, dtype; None: off) and the random number generators' state it started from."""

    inputs: tuple[Any, ...]
    autocast: tuple[str, torch.dtype] | None
    rng: RngState


def rng_state() -> RngState:
    """The state of torch's generators a graph may draw from."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    return torch.get_rng_state(), tuple(torch.cuda.get_rng_state_all()) if cuda else None


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class GraphCapture:
    """A dynamo backend that runs each graph it is given compiled again by ``spec``'s backend (the step's own
    failure; None: as it is, dynamo's ``eager``) and keeps one call of each graph: the first whose output is
    non-finite, else the first (a graph reused by several layers may fail in a later one only). ``graphs``:
    (graph, call) in the order of the calls kept. Until a graph's non-finite call is kept, each call's inputs
    are copied before it runs and its output read once (a replay's cost, never a training run's)."""

    def __init__(self, device_type: str, spec: CompileSpec | None = None) -> None:
        self._kept: list[tuple[int, fx.GraphModule, GraphCall, bool]] = []  # (call number, graph, call, non-finite)
        self._calls = 0
        self._device_type = device_type
        self._spec = spec

    @property
    def graphs(self) -> list[tuple[fx.GraphModule, GraphCall]]:
        return [(gm, call) for _, gm, call, _ in sorted(self._kept, key=lambda k: k[0])]

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        fn = gm.forward if self._spec is None else compile_graph(gm, self._spec)
        slot: int | None = None  # this graph's place in self._kept

        def run(*args: Any) -> Any:
            nonlocal slot
            if slot is not None and self._kept[slot][3]:
                return fn(*args)
            on = torch.is_autocast_enabled(self._device_type)
            call = GraphCall(tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                             (self._device_type, torch.get_autocast_dtype(self._device_type)) if on else None,
                             rng_state())
            out = fn(*args)
            nonfinite = not all_finite([t.detach() for t in iter_tensors(out)])
            self._calls += 1
            if slot is None:
                slot = len(self._kept)
                self._kept.append((self._calls, gm, call, nonfinite))
            elif nonfinite:
                self._kept[slot] = (self._calls, gm, call, True)
            return out

        return run
