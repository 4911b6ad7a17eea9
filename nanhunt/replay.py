"""Deterministic one-step replay, with every piece of user state restored afterwards."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import torch
from torch import nn

from ._errors import CommandError
from ._interrupt import atomic, deferred_interrupts
from .capture import rng_state, set_rng_state, split_batch
from .precision import float32_master, float32_weights, fp32_call, to_fp32
from .records import Occurrence, Phase, Record, Report, Role, Verdict
from .graph import loss_index
from .tracer import Trace

__all__ = ["replay", "StepState", "run_step", "environment"]


class StepState:
    """A snapshot of everything one training step can change, restorable in place.

    Covers parameter and buffer values *and* the objects registered on each module
    (a step may rebind a buffer), ``.grad`` references, ``requires_grad``,
    ``training`` flags, optimizer state and hyper-parameters, GradScaler state,
    the RNG (torch's, CUDA's, Python's ``random`` and NumPy's global one) and the
    grad mode. Tensors the optimizer updates outside the model (a loss module's
    weights) are parameters too.

    :meth:`reset` and :meth:`restore` run to their end despite Ctrl-C: a SIGINT that
    arrives meanwhile is delivered (``KeyboardInterrupt``) once the state is back.
    As a context manager it also restores on leaving the block, and Ctrl-C is held
    from a restore's first instruction (called alone, a SIGINT just before it
    installs its handler leaves the restore not started, never half done)::

        with StepState(model, optimizer, scaler) as state:
            ...  # run steps; state.reset() between them
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.grad_enabled = torch.is_grad_enabled()
        self.rng = rng_state(python_numpy=True)
        self.modules = [(m, dict(m._parameters), dict(m._buffers), m.training) for m in model.modules()]
        # Hooks and plain attributes a forward may add or change (a counter, a cache, a hook it registers).
        self.hooks = [(d, dict(d)) for m in model.modules() for d in _hook_dicts(m)]
        self.attrs = [(m, {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}) for m in model.modules()]
        self.values: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for _, params, buffers, _ in self.modules:
            for t in (*params.values(), *buffers.values()):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.values.append((t, t.detach().clone()))
        self.params: list[torch.Tensor] = [p for p in model.parameters()]
        if optimizer is not None:
            known = {id(p) for p in self.params}
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if isinstance(p, torch.Tensor) and id(p) not in known:
                        known.add(id(p))
                        self.params.append(p)
                        if id(p) not in seen:
                            seen.add(id(p))
                            self.values.append((p, p.detach().clone()))
        self.param_hooks = [(p, _param_hooks(p)) for p in self.params]
        self.grads = [p.grad for p in self.params]
        self.requires_grad = [p.requires_grad for p in self.params]
        self.opt_state: dict[Any, dict[str, Any]] | None = None
        self.opt_groups: list[dict[str, Any]] | None = None
        if optimizer is not None:
            self.opt_state = {p: {k: _clone(v) for k, v in s.items()} for p, s in optimizer.state.items()}
            self.opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.scaler_dict: dict[str, Any] | None = None
        if scaler is not None:
            self.scaler_dict = {k: _clone(v) for k, v in vars(scaler).items()}
        self._interrupts: deferred_interrupts | None = None

    def __enter__(self) -> StepState:
        if self._interrupts is not None:
            raise RuntimeError("this StepState is already in use as a context manager")
        interrupts = deferred_interrupts()
        interrupts.__enter__()  # nothing has changed yet: a Ctrl-C before this point needs no restore
        self._interrupts = interrupts
        return self

    @atomic
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        interrupts, self._interrupts = self._interrupts, None
        try:
            self.restore()
        finally:
            if interrupts is not None:
                interrupts.__exit__(None, None, None)  # puts the SIGINT handler back; a held Ctrl-C raises here

    @atomic
    def reset(self, rng: Mapping[str, Any] | None = None) -> None:
        """Back to the snapshot, with no ``.grad`` (a replayed step starts from zero gradients)."""
        self.restore()
        for p in self.params:
            p.grad = None
        if rng is not None:
            set_rng_state(rng)

    @atomic
    def restore(self) -> None:
        for d, saved_hooks in self.hooks:
            if d.keys() != saved_hooks.keys():
                d.clear()
                d.update(saved_hooks)
        for param, registries in self.param_hooks:
            for name, (obj, content) in registries.items():
                if obj is None:
                    if getattr(param, name) is not None:
                        setattr(param, name, None)
                else:
                    obj.clear()
                    obj.update(content)
                    if getattr(param, name) is not obj:
                        setattr(param, name, obj)
        for m, attrs in self.attrs:
            current = vars(m)
            for k in [k for k in current if k not in attrs and k not in _MODULE_INTERNALS]:
                del current[k]
            for k, v in attrs.items():
                if current.get(k, _MISSING) is not v:
                    current[k] = v
        for m, params, buffers, training in self.modules:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            m.training = training
        with torch.no_grad():
            for t, saved in self.values:
                t.data.copy_(saved)
        for param, grad, rg in zip(self.params, self.grads, self.requires_grad):
            param.grad = grad
            param.requires_grad_(rg)
        opt = self.optimizer
        if opt is not None and self.opt_state is not None and self.opt_groups is not None:
            for p in list(opt.state.keys()):
                if p not in self.opt_state:
                    del opt.state[p]
            for p, saved_state in self.opt_state.items():
                cur = opt.state.get(p)
                if cur is None:
                    opt.state[p] = {k: _clone(v) for k, v in saved_state.items()}
                    continue
                for k in list(cur):
                    if k not in saved_state:
                        del cur[k]
                for k, v in saved_state.items():
                    old = cur.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                        old.data.copy_(v)
                    else:
                        cur[k] = _clone(v)
            for g, saved_group in zip(opt.param_groups, self.opt_groups):
                for k in list(g):
                    if k != "params" and k not in saved_group:
                        del g[k]
                g.update(copy.deepcopy(saved_group))
        if self.scaler is not None and self.scaler_dict is not None:
            for k, v in self.scaler_dict.items():
                cur = getattr(self.scaler, k, None)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    cur.data.copy_(v)
                else:
                    setattr(self.scaler, k, _clone(v))
        set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad_enabled)


_MISSING = object()
# A module's own bookkeeping, restored separately (parameters, buffers, training) or never
# changed by a forward (the submodules).
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "training"})
_HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _hook_dicts(m: nn.Module) -> list[dict[Any, Any]]:
    """A module's hook registries (kept as objects: RemovableHandles point at them)."""
    return [d for d in (getattr(m, name, None) for name in _HOOK_ATTRS) if isinstance(d, dict)]


def _param_hooks(p: torch.Tensor) -> dict[str, tuple[dict[Any, Any] | None, dict[Any, Any]]]:
    """A parameter's hook registries: ``None`` until a hook is registered, then a dict."""
    out: dict[str, tuple[dict[Any, Any] | None, dict[Any, Any]]] = {}
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        d = getattr(p, name, None)
        out[name] = (d, dict(d)) if isinstance(d, dict) else (None, {})
    return out


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return copy.deepcopy(v)


def _call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        shape = "keyword arguments " + ", ".join(kwargs) if kwargs else f"{len(args)} positional argument(s)"
        raise CommandError(f"the batch gives {shape}, which {type(model).__name__}.forward does not take ({e})") from e
    except ValueError:  # no signature available
        pass
    return model(*args, **kwargs)


def _loss_of(output: Any, targets: Any, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output) if targets is None else loss_fn(output, targets)  # type: ignore[no-any-return]
    loss = output
    if not isinstance(loss, torch.Tensor):
        if isinstance(output, Mapping) and "loss" in output:
            loss = output["loss"]
        elif getattr(output, "loss", None) is not None:
            loss = output.loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(output).__name__ if not isinstance(output, torch.Tensor) else f"tensor of shape {tuple(output.shape)}"
        raise CommandError(f"the model returned a {what}, not a loss; give a loss function (--loss package.module:fn)")
    return loss


def _backward(t: torch.Tensor) -> None:
    # Tensor.backward is unannotated in torch. Cast it rather than call torch.autograd.backward(t):
    # a __torch_function__ override (tensor subclass or mode) still sees Tensor.backward, as before.
    cast("Callable[[], None]", t.backward)()


def run_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    loss_fn: Callable[..., Any] | None,
    dtype: torch.dtype,
    device_type: str,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer | None,
    fp32_loss: bool = False,
    fp32_update: bool = False,
) -> torch.Tensor:
    """One step as training runs it: forward and loss under autocast, scaled backward, update.
    ``fp32_loss`` computes the loss with autocast off on float32 inputs, ``fp32_update`` runs the update
    on float32 master copies of half-precision parameters (bisection trials)."""
    if fp32_loss and loss_fn is not None:
        loss_fn = fp32_call(loss_fn, device_type)
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        loss = _loss_of(_call_model(model, inputs), targets, loss_fn)
    if loss.requires_grad:
        _backward(scaler.scale(loss) if scaler is not None else loss)
        if optimizer is not None:
            with float32_master(optimizer) if fp32_update else contextlib.nullcontext():
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
    return loss


def environment(device_type: str) -> dict[str, str]:
    from . import __version__

    env = {
        "nanhunt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "device_type": device_type,
    }
    if device_type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    else:
        env["device"] = _cpu_name()
    if torch.version.cuda:
        env["cuda"] = str(torch.version.cuda)
    if getattr(torch.version, "hip", None):
        env["rocm"] = str(torch.version.hip)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def _bisect(model: nn.Module, batch: tuple[Any, Any], status: str, first: Occurrence | None, *,
            loss_fn: Callable[..., Any] | None, dtype: torch.dtype, device_type: str,
            scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer | None,
            rng: Mapping[str, Any], progress: Callable[[int, str], None] | None, level: str,
            allow: tuple[str, ...], train: bool | None, origins: Sequence[Occurrence]) -> Verdict:
    from .bisect import bisect

    if status != "nonfinite":
        return Verdict(kind=status)

    def locate_fp32() -> Occurrence | None:
        # Really float32, as bisect's control: half-precision weights and batch cast for this replay.
        with float32_weights(model):
            return replay(model, to_fp32(batch), loss_fn=loss_fn, dtype=torch.float32, device_type=device_type,
                          scaler=scaler, optimizer=optimizer, level=level, train=train, rng=rng, allow=allow).first

    return bisect(model, batch, origin=first, loss_fn=loss_fn, dtype=dtype, device_type=device_type, scaler=scaler,
                  optimizer=optimizer, rng=rng, progress=progress, locate_fp32=locate_fp32, train=train,
                  origins=origins)


def _state_notes(config: Mapping[str, Any], compiled: bool) -> tuple[str, ...]:
    """What the step was replayed from that the findings alone do not say."""
    out: list[str] = []
    scale = config.get("scaler_scale")
    if isinstance(scale, float) and not math.isfinite(scale):
        # GradScaler makes its scale tensor inside the step, as a literal: no op is its origin
        out.append(f"the GradScaler's scale is {scale}: every scaled loss and gradient is non-finite before any "
                   "op runs; fix the scaler state (nanhunt inspect flags it)")
    if compiled:
        out.append("the model is torch.compile'd: the eager original was replayed")
    return tuple(out)


def _sinks_finite(records: Sequence[Record]) -> bool:
    """The loss value, the gradients and the update are finite. Intermediate values of the loss and of
    backward are no sinks: a checkpoint's recomputed -inf attention mask sits there on purpose."""
    loss = loss_index(records)
    return (loss is None or records[loss].finite) and all(
        r.finite for r in records if r.phase is Phase.UPDATE or r.role is Role.GRAD)


def _module_status(records: Sequence[Record], tainted: frozenset[int], classes: Mapping[str, str]) -> dict[str, str]:
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


def replay(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[..., Any] | None = None,
    dtype: torch.dtype = torch.float16,
    device_type: str = "cpu",
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    level: str = "op",
    train: bool | None = None,
    rng: Mapping[str, Any] | None = None,
    allow: Iterable[str] = (),
    command: str | None = None,
    notes: Sequence[str] = (),
    bisect: bool = False,
    progress: Callable[[int, str], None] | None = None,
) -> Report:
    """Replay one training step twice inside :func:`nanhunt.trace` and report where NaN/Inf was born.

    ``batch`` is ``(inputs, targets)``; ``inputs`` a tensor, a tuple of positional
    arguments or a dict of keyword arguments; ``loss_fn(output, targets)`` gives
    the loss, or with no ``loss_fn`` the model's output is the loss (a scalar,
    ``.loss`` or ``["loss"]``). Forward and loss run under autocast
    (``dtype=torch.float32`` disables it), backward is ``scaler.scale(loss)``
    with the scaler's current scale, and with an optimizer the update runs too
    (phase ``update``). Both runs start from the same weights, buffers, RNG state
    (``rng`` or the current one) and scaler state; the model, optimizer and
    scaler are restored exactly afterwards, also on an exception.

    With ``bisect=True`` and a non-finite step, :func:`nanhunt.bisect.bisect`
    then proves why: ``report.verdict`` names a minimal set of modules whose
    float32 execution makes the step finite (``progress(n, label)`` is called
    before each of its replays).

    Example::

        report = nanhunt.replay(model, (x, y), loss_fn=F.cross_entropy, dtype=torch.float16)
        print(report.first)
    """
    inputs, targets = batch if isinstance(batch, tuple) and len(batch) == 2 else split_batch(batch)
    allow = tuple(allow)
    state = StepState(model, optimizer, scaler)
    start_rng = dict(rng) if rng is not None else state.rng
    config: dict[str, Any] = {
        "dtype": str(dtype).replace("torch.", ""),
        "device_type": device_type,
        "level": level,
        "train": model.training if train is None else train,
        "loss_fn": getattr(loss_fn, "__qualname__", None) or (type(loss_fn).__name__ if loss_fn is not None else None),
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }
    if scaler is not None:
        config["scaler_scale"] = float(scaler.get_scale()) if scaler.is_enabled() else None
        config["scaler_growth_tracker"] = int(scaler.state_dict().get("_growth_tracker", 0)) if scaler.is_enabled() else None
    traces: list[Trace] = []
    loss_value: float | None = None
    with state:
        zoom: frozenset[int] = frozenset()
        for _ in range(2):
            state.reset(start_rng)
            if train is not None:
                model.train(train)
            # the second run measures the culprit in full (zoom): no need to hold tensors
            t = Trace(model, level=level, allow=allow, full_stats=False, _zoom=zoom)
            with t:
                loss = run_step(model, inputs, targets, loss_fn=loss_fn, dtype=dtype, device_type=device_type,
                                scaler=scaler, optimizer=optimizer)
            loss_value = float(loss.detach().float())
            traces.append(t)
            first = t.first
            if first is not None:
                zoom = frozenset((first.output.index, *first.output.inputs))

    a, b = traces
    runs = (a.first, b.first)
    reproducible = _same(a, b)
    final = b if reproducible else a
    records = final.records
    grads = [r for r in records if r.role is Role.GRAD]
    config["grads_finite"] = all(r.finite for r in grads)
    if scaler is not None:
        config["scaler_would_skip"] = not config["grads_finite"]
    first = final.first
    if not reproducible:
        status = "not-reproducible"
    elif first is None and all(o.harmless for o in final.origins) and _sinks_finite(records):
        status = "clean"
    else:
        status = "nonfinite"
    verdict = None
    if bisect:
        verdict = _bisect(model, (inputs, targets), status, first, loss_fn=loss_fn, dtype=dtype,
                          device_type=device_type, scaler=scaler, optimizer=optimizer, rng=start_rng,
                          progress=progress, level=level, allow=allow, train=train, origins=tuple(final.origins))
    if verdict is not None and verdict.silent and first is not None:
        # which values the silent origin corrupted: those that took its non-finite values in, finite again
        said = (f"{records[i].phase.value} {records[i].module or '<root>'} {records[i].op or records[i].role.value} "
                f"(|x| max {records[i].absmax:.3g})" for i in first.absorbed)
        verdict = dataclasses.replace(verdict, corrupted=tuple(dict.fromkeys(said)))
    timeline = tuple(
        (r.index, r.phase.value, r.absmax if r.finite else math.nan, "finite" if r.finite else ("nan" if r.has_nan else "inf"))
        for r in records
    )
    return Report(
        timeline=timeline,
        verdict=verdict,
        status=status,
        first=first,
        origins=tuple(final.origins),
        path=tuple(final.path),
        runs=runs,
        loss=loss_value,
        config=config,
        modules=_module_status(records, final.tainted, final.module_classes()),
        module_classes=final.module_classes(),
        environment=environment(device_type),
        command=command,
        notes=tuple(notes) + _state_notes(config, final.compiled),
        n_records=len(records),
    )
