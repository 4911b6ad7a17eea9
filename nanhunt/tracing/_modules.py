"""Module hooks: the names and call indices of module calls, the records at module boundaries,
and the gradients the backward makes there.

At op level the hooks only keep the module stack (ops are attributed to the call on top) and
record the tensors that enter a call. At module level they are the whole trace: a module call's
output is a record made from its arguments and its children's outputs, its gradient a record of
its backward, and a parameter's accumulated ``.grad`` a record of the parameter's module.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .._util import _dispatch
from .._util._subclass import parts
from ._ops import OpRecorder
from ._phases import PhaseTracker
from ._records_store import Raw, RecordStore
from ._scope import ScopeGate, in_scope
from ._tensors import floatish, layout, tensors
from ._watch import OriginWatch
from .._util._wrappers import user_class, user_named_modules
from ..records import Level, Phase, Role

__all__ = ["ModuleHooks"]

_version = _dispatch.tensor_version
_grad_enabled = torch.is_grad_enabled


def _stashed(module: nn.Module) -> list[torch.Tensor]:
    """Tensors with a graph that a module and its submodules keep as plain attributes (a cache,
    an auxiliary output read later): their backward runs through the module's nodes too."""
    return [v for m in module.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and v.grad_fn is not None]


# what a module-level trace says a sharded gradient arrived through
SHARDED_GRAD = "reduce-scatter (FSDP2; module level: this rank's own part not told apart, use level='op')"


class ModuleHooks:
    """Forward pre/post hooks on every module of a model, post-accumulate-grad hooks on its
    parameters and (module level) hooks on the gradients of module outputs.

    ``ops.busy`` is set while a hook runs, so that the tracer's own ops go unrecorded; ``gate``
    (``scope=``) opens at the scope's outermost call; ``watch`` looks for an origin among the new
    records (``stop_at_first``). Handles go to ``handles``.
    """

    __slots__ = ("level", "scope", "stop_at_first", "running", "names", "root_name", "direct", "mstack", "consumed",
                 "layouts", "_store", "_phases", "_ops", "_gate", "_watch", "_handles")

    def __init__(self, store: RecordStore, phases: PhaseTracker, ops: OpRecorder, gate: ScopeGate | None,
                 watch: OriginWatch, handles: list[Any], *, level: Level = Level.OP, scope: tuple[str, ...] = (),
                 stop_at_first: bool = False) -> None:
        self.level = level
        self.scope = scope
        self.stop_at_first = stop_at_first
        self.running = False
        # id(module) -> (weak reference, name): cheaper per call than a WeakKeyDictionary
        self.names: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
        self.root_name: str | None = None
        self.direct: dict[str, tuple[int, ...]] = {}  # module -> records of its own weights
        # Module level, per module call running: (start, input records, its children's output records so far).
        self.mstack: list[tuple[int, tuple[int, ...], list[int]]] = []
        self.consumed: set[int] = set()  # module level: records some module call took as an argument
        # Module level: module outputs by memory layout, for the aliases of them a module receives
        # (a user's full backward hook hands the next module a new tensor over the same memory).
        self.layouts: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._store = store
        self._phases = phases
        self._ops = ops
        self._gate = gate
        self._watch = watch
        self._handles = handles

    def install(self, model: nn.Module) -> None:
        """One walk over the modules: names, hooks, weight records, parameter grad hooks."""
        store, owners = self._store, self._phases.owners
        seen: set[int] = set()
        pre, post, grad = self._pre_hook, self._post_hook, self._grad_hook
        walk = list(user_named_modules(model))
        if self.scope:
            table = {name for name, _, _ in walk}
            missing = [n for n in self.scope if n not in table]
            if missing:
                raise KeyError(f"scope names no module of the model: {', '.join(missing)} (see model.named_modules())")
        for name, mod, wrapper in walk:
            if not wrapper:  # a wrapper's calls are its inner module's (named alike): its weights are the inner's
                self.names[id(mod)] = (weakref.ref(mod), name)
                store.classes[name] = user_class(mod).__name__  # FSDP2's FSDPLinear is your Linear
            params, buffers = _dispatch.own_weights(mod)
            if self.scope and not in_scope(name, self.scope):
                for p in params:
                    if isinstance(p, torch.Tensor) and p not in owners:
                        owners[p] = name
                continue
            direct: list[int] = []
            for role, own in ((Role.PARAM, params), (Role.BUFFER, buffers)):
                for t in own:
                    if not isinstance(t, torch.Tensor) or not floatish(t):
                        continue
                    if id(t) in seen:  # shared weights: recorded once, owned by the first module
                        ent = store.known.get(t)
                        if ent is not None:
                            direct.append(ent[0])
                        continue
                    seen.add(id(t))
                    idx = store.add(Raw(Phase.WEIGHTS, name, 0, None, role, t, (), None), t)
                    if role is Role.BUFFER and _dispatch.keeps_running_stats(mod):
                        store.not_masks.add(idx)  # running statistics: a -inf there is no mask
                    store.known[t] = (idx, _version(t))
                    if not _dispatch.is_plain(t):  # an NF4 weight: its parts are read as its values
                        for part in parts(t):
                            store.known[part] = (idx, _version(part))
                    owners[t] = name
                    direct.append(idx)
                    if role is Role.PARAM and t.requires_grad:
                        self._handles.append(t.register_post_accumulate_grad_hook(grad))  # type: ignore[no-untyped-call]
            self.direct[name] = (*self.direct.get(name, ()), *direct)  # an FSDP1 wrapper's flat parameter too
            if wrapper:
                continue
            # prepend: the user's own pre-hooks (weight_norm...) run inside the module, after ours
            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            self._handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
        self.root_name = walk[0][0] if walk else None  # "": the model, or the module its wrappers wrap

    def name_of(self, module: nn.Module) -> str | None:
        """``module``'s name in the model, ``None`` for a module not in it."""
        e = self.names.get(id(module))
        return None if e is None or e[0]() is not module else e[1]

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        e = self.names.get(id(module))
        if e is None or e[0]() is not module:
            return
        name = e[1]
        phases, ops, store = self._phases, self._ops, self._store
        module_level = self.level == Level.MODULE
        ops.busy = True
        try:
            if self._gate is not None and not phases.stack:
                self._gate.enter()
            node = _dispatch.current_autograd_node()
            if node is not None:
                # Recomputation (torch.utils.checkpoint) inside backward: same call, not a new one.
                phases.reenter(name, node)
                if module_level:
                    self.mstack.append((len(store.raws), (), []))
                return
            parent = phases.stack[-1] if phases.stack else None
            call, glue = phases.enter(name)
            ins: list[int] = []
            for t in tensors((args, kwargs)):
                if not floatish(t):
                    continue
                ent = store.known.get(t)
                if ent is not None and ent[1] == _version(t):
                    ins.append(int(ent[0]))
                    continue
                if module_level:
                    key = layout(t)
                    same = self.layouts.get(key)
                    # the same memory, layout and version as a live module output that still lies
                    # there (not re-pointed by `.data = ...`): the same values
                    if same is not None and same[2] == _version(t) >= 0 and (
                            (o := same[0]()) is not None and layout(o) == key):
                        ins.append(same[1])
                        store.known[t] = (same[1], same[2])
                        continue
                if module_level and parent is not None:
                    # Not seen at a module boundary: made by the parent's own code between child calls,
                    # from what that call had: its arguments and its children's outputs so far.
                    made = (*frame[1], *frame[2]) if (frame := self.mstack[-1] if self.mstack else None) else ()
                    raw = Raw(Phase.FORWARD, parent[0], parent[1], None, Role.OUTPUT, t, made, None)
                else:  # from outside the step (or, with scope=, from outside the scope)
                    raw = Raw(Phase.FORWARD if self.scope else Phase.INPUT, name, call, None, Role.INPUT, t, (), None)
                idx = store.add(raw, t)
                store.known[t] = (idx, _version(t))
                ins.append(idx)
            if glue:
                phases.glue_to_forward(ins, glue)
            if self._watch.held is not None:
                self._watch.module_called()  # a stop held for its phase: settled if this call took its value
            if module_level:
                self.consumed.update(ins)
                ins.extend(self.direct.get(name, ()))
                self.mstack.append((len(store.raws), tuple(ins), []))
        finally:
            ops.busy = False

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        e = self.names.get(id(module))
        if e is None or e[0]() is not module:
            return
        name = e[1]
        left = self._phases.leave(name)
        if left is None:
            return
        call, in_backward = left
        store = self._store
        self._ops.busy = True
        try:
            module_level = self.level == Level.MODULE
            start, ins, children = self.mstack.pop() if module_level and self.mstack else (0, (), [])
            if in_backward:
                return
            made = (*ins, *children)  # module level: its output came from its arguments and its children's
            if module_level:
                store.calls.append((start, len(store.raws), name, call))
            is_root = name == self.root_name
            for t in tensors(output):
                if not floatish(t):
                    continue
                if module_level:
                    ent = store.known.get(t)
                    if ent is not None and ent[1] == _version(t) and ent[0] >= start:
                        idx = int(ent[0])  # a child's output returned as is
                    else:
                        idx = store.add(Raw(Phase.FORWARD, name, call, None, Role.OUTPUT, t, made, None), t)
                        store.known[t] = (idx, _version(t))
                        store.spans[idx] = start
                        self.layouts[layout(t)] = (weakref.ref(t), idx, _version(t))
                    if t.requires_grad and _grad_enabled():
                        self._handles.append(
                            t.register_hook(self._grad_output_hook(name, call, is_root, idx)))  # type: ignore[no-untyped-call]
                    if self.mstack:
                        self.mstack[-1][2].append(idx)
                else:
                    idx = self._ops.lookup(t, Phase.FORWARD, name, call)
                if is_root:
                    store.root_outputs.add(idx)
            if self.stop_at_first and module_level:
                self._watch.check(((args, kwargs), output))
        finally:
            self._ops.busy = False
            gate = self._gate
            if gate is not None and gate.opened and not self._phases.stack:
                gate.leave((output, args, kwargs, _stashed(module)))

    def _grad_output_hook(self, name: str, call: int, is_root: bool, forward_idx: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not self.running or not floatish(grad):
                return
            store = self._store
            self._ops.busy = True
            try:
                # The gradient w.r.t. the root output is made by the loss's backward, also when the
                # root returned its child's output as is (an nn.Sequential): this child's hook fires
                # first. Unless a module took that output too (features returned beside a head's).
                root = is_root or (forward_idx in store.root_outputs and forward_idx not in self.consumed)
                phase, module = (Phase.LOSS, None) if root else (Phase.BACKWARD, name)
                # The edge from the forward output lets locate name the module whose backward made it.
                ent = store.known.get(grad)
                ver = _version(grad)
                if ent is not None and ent[1] == ver and ver >= 0:
                    # The same gradient again (a residual add hands one tensor to both branches, a
                    # container returns its child's output): same values, derived, not read again.
                    raw = Raw(phase, module, call, None, Role.GRAD_OUTPUT, grad, (forward_idx, ent[0]), None,
                              alias_of=ent[0])
                else:
                    raw = Raw(phase, module, call, None, Role.GRAD_OUTPUT, grad, (forward_idx,), None)
                idx = store.add(raw, grad)
                store.known[grad] = (idx, ver)
                if self.stop_at_first:
                    self._watch.check(((), grad))
            finally:
                self._ops.busy = False

        return hook

    def _grad_hook(self, p: torch.Tensor) -> None:
        self._phases.grad_accumulated()
        g = p.grad
        if not self.running or g is None or not floatish(g):
            return
        store = self._store
        self._ops.busy = True
        try:
            owner = self._phases.owners.get(p)
            ent = store.known.get(g)
            if ent is not None and ent[1] == _version(g):
                raw = Raw(Phase.BACKWARD, owner, 0, None, Role.GRAD, g, (int(ent[0]),), None, alias_of=int(ent[0]))
            elif ent is None and self.level == Level.MODULE and _dispatch.is_dtensor(g):
                # A sharded (FSDP2) gradient: its hook runs after the reduce-scatter that summed every rank's
                # part, which module level does not record, so it cannot tell this rank's part from the others'
                # and does not call it an origin here (level="op" records the collective and tells them apart).
                raw = Raw(Phase.BACKWARD, owner, 0, SHARDED_GRAD, Role.RECEIVED, g, (), None)
            else:
                prev = () if ent is None else (int(ent[0]),)
                raw = Raw(Phase.BACKWARD, owner, 0, None, Role.GRAD, g, prev, None)
            idx = store.add(raw, g)
            store.known[g] = (idx, _version(g))
        finally:
            self._ops.busy = False
