"""Local float32: run chosen submodules with autocast disabled and float32 inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from .._util._tree import iter_tensors, map_tensors
from .._util._wrappers import user_modules

__all__ = ["keep_fp32", "keep_fp32_permanently", "fp32_call", "float32_weights", "float32_master", "has_half_weights",
           "to_fp32",
           "LOSS_REGION", "UPDATE_REGION", "REGIONS"]

LOSS_REGION = "<loss>"  # the loss function, as a bisection candidate
# the optimizer's update on float32 master copies of a half-precision model's parameters, gradients and
# state (Adam's eps=1e-8 is 0 in float16), as a bisection candidate
UPDATE_REGION = "<update>"
REGIONS = (LOSS_REGION, UPDATE_REGION)
_LOW = (torch.float16, torch.bfloat16)


def to_fp32(obj: Any) -> Any:
    """``obj`` with its float16/bfloat16 tensors cast to float32 (nested tuples, lists, dicts)."""
    return map_tensors(obj, lambda t: t.float() if t.dtype in _LOW else t)


def has_half_weights(module: nn.Module) -> bool:
    """Some float16/bfloat16 parameter or buffer in ``module``'s subtree (a ``model.half()`` model)."""
    return any(t.dtype in _LOW for t in (*module.parameters(), *module.buffers()))


@contextlib.contextmanager
def float32_weights(model: nn.Module, *, enabled: bool = True,
                    optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Inside the block, the model's float16/bfloat16 parameters and buffers hold float32 copies
    (``.data`` swapped, gradients and updates in float32 too), and so does ``optimizer``'s state of
    them (float32 master copies: the update runs in float32); on exit each gets back its original
    tensor, untouched, and ``.grad`` and the optimizer's state are what they were before. For a float32
    control of a ``model.half()`` model, and the ``<update>`` region of a bisection."""
    swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    states: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if enabled:
        seen: set[int] = set()
        params: list[torch.Tensor] = list(model.parameters())
        if optimizer is not None:
            params += [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
        for t in (*params, *model.buffers()):
            if id(t) in seen or t.dtype not in _LOW:
                continue
            seen.add(id(t))
            swapped.append((t, t.data, t.grad))
            t.grad = None
            t.data = t.data.float()
            if optimizer is not None and t in optimizer.state:
                st = optimizer.state[t]
                states.append((st, dict(st)))
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dtype in _LOW:
                        st[k] = v.float()
    try:
        yield
    finally:
        for st, before in reversed(states):
            st.clear()
            st.update(before)
        for t, data, grad in reversed(swapped):
            t.grad = None
            t.data = data
            t.grad = grad


@contextlib.contextmanager
def float32_master(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, the optimizer updates float32 master copies of its float16/bfloat16 parameters
    (their gradients and state cast to float32); on exit each parameter takes its updated master's value
    in its own dtype, as mixed-precision training with master weights does, and gets back its gradient.
    The optimizer's state stays float32 (a bisection trial restores it)."""
    swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    seen: set[int] = set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if not isinstance(p, torch.Tensor) or id(p) in seen or p.dtype not in _LOW:
                continue
            seen.add(id(p))
            swapped.append((p, p.data, p.grad))
            grad = p.grad
            p.grad = None
            p.data = p.data.float()
            p.grad = None if grad is None else grad.float()
            st = optimizer.state.get(p)
            if st:
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.dtype in _LOW:
                        st[k] = v.float()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, half, grad in reversed(swapped):
                master = p.data
                p.grad = None
                p.data = half
                half.copy_(master)
                p.grad = grad


def _fp32_weights_in(module: nn.Module) -> Callable[[], None]:
    """Make the half-precision parameters and buffers of ``module``'s subtree float32 for one call:
    each entry is swapped for a float32 copy made in the graph (its gradient flows back, cast,
    to the original parameter). Returns the undo, which also writes in-place buffer updates
    (BatchNorm running stats) back to the original buffers."""
    swaps: list[tuple[dict[str, Any], str, torch.Tensor, bool]] = []
    for mod in module.modules():
        tables: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers)  # a plain tensor in place of the Parameter
        for table in tables:
            for name, t in list(table.items()):
                if isinstance(t, torch.Tensor) and t.dtype in _LOW:
                    table[name] = t.float()
                    swaps.append((table, name, t, table is mod._buffers))

    def undo() -> None:
        for table, name, orig, is_buffer in reversed(swaps):
            cur = table.get(name)
            # running stats are updated in place without a version bump: always write buffers back
            if is_buffer and isinstance(cur, torch.Tensor):
                with torch.no_grad():
                    orig.copy_(cur)
            table[name] = orig

    return undo


def _device_type(args: Any, module: nn.Module | None) -> str:
    stack = [args]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            return o.device.type
        if isinstance(o, (tuple, list)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    p = None if module is None else next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def fp32_call(fn: Callable[..., Any], device_type: str | None = None) -> Callable[..., Any]:
    """``fn`` run with autocast off and half-precision floating arguments cast to float32."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type or _device_type((args, kwargs), None), enabled=False):
            return fn(*to_fp32(args), **to_fp32(kwargs))

    return call


def _nothing() -> None:
    pass


def _low_dtype(obj: Any) -> torch.dtype | None:
    """The float16/bfloat16 dtype of the first such tensor in ``obj`` (nested containers), or None."""
    return next((t.dtype for t in iter_tensors(obj) if t.dtype in _LOW), None)


def _wrap(module: nn.Module) -> Callable[[], None]:
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    orig = module.forward
    # float32 inputs need float32 weights: a model.half() module would otherwise fail on the dtype
    # mismatch. Looked at once, before any is held in float32 (_hold_float32): a float32 module (the usual case)
    # pays nothing per call, and a half one's output goes back to its weights' dtype.
    half = next((t.dtype for t in (*module.parameters(), *module.buffers()) if t.dtype in _LOW), None)

    def forward(*args: Any, **kwargs: Any) -> Any:
        device_type = _device_type((args, kwargs), module)
        outer_autocast = torch.is_autocast_enabled(device_type)
        # the half tensors not held in float32 for the region's lifetime (a keep_fp32 block, a tied weight)
        undo_weights = _fp32_weights_in(module) if half is not None else _nothing
        try:
            with torch.autocast(device_type, enabled=False):
                out = orig(*to_fp32(args), **to_fp32(kwargs))
        finally:
            undo_weights()
        # Without autocast nothing downstream casts for us: a half-precision model's next module (half
        # weights) would fail on a float32 input. The region hands back the dtype it was handed (its inputs',
        # else its weights'), as the module would have; a parameter-free one (a dropout) has only its inputs.
        # The cast is in the graph, so gradients flow back into the region in float32, and out of it (to_fp32's
        # cast) in the input's dtype.
        home = None if outer_autocast else _low_dtype((args, kwargs)) or half
        if home is not None:
            out = map_tensors(out, lambda t: t.to(home) if t.dtype == torch.float32 else t)
        return out

    forward.__nanhunt_fp32__ = True  # type: ignore[attr-defined]
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = cast("Callable[..., Any]", previous)  # present in __dict__ when `had`
        else:
            module.__dict__.pop("forward", None)

    return undo


def _hold_float32(model: nn.Module, modules: list[nn.Module],
                  optimizer: torch.optim.Optimizer | None) -> Callable[[], None]:
    """The float16/bfloat16 parameters and buffers of ``modules``' subtrees hold float32 copies from now on
    (``.data`` swapped: the same objects, as ``module.float()`` leaves them), so the modules' gradients and updates
    are float32 too, and ``optimizer``'s state of them is cast along. A weight gradient that passes float16's
    maximum (a layer fed a large activation) is then no overflow, as in a module the user keeps in float32; a
    per-call float32 copy would cast it back to the parameter's dtype. A tensor some module outside them holds too
    (a tied embedding) stays as it is: that module takes it in its dtype. Returns the undo: each tensor gets back
    its own storage holding its current value (and gradient) in its dtype, and the state its dtype."""
    inside = {id(m) for top in modules for m in top.modules()}
    shared = {id(t) for m in model.modules() if id(m) not in inside
              for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    states: list[tuple[dict[str, Any], str, torch.dtype]] = []
    seen: set[int] = set()
    for top in modules:
        for t in (*top.parameters(), *top.buffers()):
            # a DTensor shard or an FSDP view keeps its per-call copy: its storage is not its own to swap
            if id(t) in seen or id(t) in shared or t.dtype not in _LOW or type(t.data) is not torch.Tensor:
                continue
            seen.add(id(t))
            grad = t.grad
            t.grad = None
            held.append((t, t.data))
            t.data = t.data.float()
            t.grad = None if grad is None else grad.float()
            st = optimizer.state.get(t) if optimizer is not None else None
            for k, v in (st or {}).items():
                if isinstance(v, torch.Tensor) and v.dtype in _LOW and st is not None:
                    states.append((st, k, v.dtype))
                    st[k] = v.float()

    def undo() -> None:
        with torch.no_grad():
            for st, k, dtype in reversed(states):
                v = st.get(k)
                if isinstance(v, torch.Tensor):
                    st[k] = v.to(dtype)
            for t, own in reversed(held):
                grad = t.grad
                t.grad = None
                own.copy_(t.data)
                t.data = own
                t.grad = None if grad is None else grad.to(own.dtype)

    return undo


Fp32Modules = Iterable[str | type[nn.Module]]  # module names, and module classes (every module of the class)


def _modules(model: nn.Module, names: Fp32Modules) -> list[nn.Module]:
    # the names a trace gives (``fc2`` in a DDP-wrapped model) and the wrapper's own (``module.fc2``)
    table = {**dict(model.named_modules()), **user_modules(model)}
    out: dict[int, nn.Module] = {}  # once each: a module named and of a named class is wrapped once
    for n in names:
        if isinstance(n, type):
            found = [m for m in table.values() if isinstance(m, n)]
            if not found:
                raise KeyError(f"no module of the model is a {n.__qualname__}")
            out.update((id(m), m) for m in found)
            continue
        if n in REGIONS:
            continue
        if n not in table:
            raise KeyError(f"{n!r} is not a module of the model (see model.named_modules())")
        out[id(table[n])] = table[n]
    return list(out.values())


def keep_fp32_permanently(model: nn.Module, names: Fp32Modules, *,
                          optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """Run the named submodules in float32 from now on (the fix to keep). Returns an undo function.

    ``names``: ``named_modules()`` names, and module classes (every module of the model that is an instance of
    one: ``[RMSNorm]`` keeps every norm in float32).

    Under autocast a module runs with autocast off on float32 inputs. In a float16/bfloat16 model (``model.half()``,
    no autocast) its half parameters and buffers also become float32, as ``module.float()`` makes them (the same
    objects: an optimizer holding them keeps them), so its gradients and updates are float32 too; its output goes
    back to the dtype it was given, for the modules after it. An optimizer that already holds state for them (a
    resumed run) is given as ``optimizer`` to have that state cast too; before its first step there is none. The
    undo puts back each one's dtype, holding its current value.

    Example::

        nanhunt.keep_fp32_permanently(model, ["encoder.block.3.ff", RMSNorm])
    """
    return _keep(model, names, params=True, optimizer=optimizer)


def _keep(model: nn.Module, names: Fp32Modules, *, params: bool,
          optimizer: torch.optim.Optimizer | None) -> Callable[[], None]:
    modules = _modules(model, names)
    undos = [_wrap(m) for m in modules]
    if params:  # after the wraps: each looked at its weights' own dtype
        undos.append(_hold_float32(model, modules, optimizer))

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


@contextlib.contextmanager
def keep_fp32(model: nn.Module, names: Fp32Modules, *, params: bool = False,
              optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Inside the block, the named submodules run with autocast disabled and float32 inputs.

    Names are ``named_modules()`` names, or module classes (every instance in the model); everything is
    restored on exit, also on an exception. In a float16/bfloat16 model run without autocast, each region
    hands its float32 outputs back in the dtype it was given (its inputs', else its weights'), and the
    gradients flowing out of it come back in its inputs' dtype: the rest of the model sees the dtypes it had
    there. Its half weights are float32 copies made at each call, so their gradients arrive in their own dtype
    (the backward may run after the block). ``params=True`` holds them in float32 for the whole block instead, as
    :func:`keep_fp32_permanently` does (gradients and updates in float32, ``optimizer``'s state of them cast
    along; run the backward and the update inside the block): what a bisection's trial runs.

    Example::

        with nanhunt.keep_fp32(model, ["blocks.1.ff.wo"]):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
    """
    undo = _keep(model, names, params=params, optimizer=optimizer)
    try:
        yield
    finally:
        undo()
