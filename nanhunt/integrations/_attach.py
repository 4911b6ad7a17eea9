"""The Guard attached to a training script nobody changed (``nanhunt run train.py``).

What is installed, for the script's run only, and taken out again by :meth:`Attached.close`:

- an import watch for ``transformers.trainer`` and Lightning's ``trainer.trainer`` (``lightning.pytorch`` and
  ``pytorch_lightning``): their ``Trainer.__init__`` is wrapped so that every Trainer (subclasses included: they
  call it) gets nanhunt's callback. A Trainer owns its loop: the plain-loop watch below stands down.
- for a plain loop (accelerate's too): the optimizers are noted as they are made (``torch.optim.Optimizer.__init__``
  wrapped: it only notes the instance). The model is the module the loop calls whose parameters include every
  parameter an optimizer holds (found once, when that optimizer is made, among the live modules); a forward
  pre-hook on it opens a guard step with the call's arguments as the batch. The loss is the tensor handed to
  ``GradScaler.scale`` or ``Tensor.backward``; ``GradScaler.step`` checks the gradients first (after the loop's own
  ``unscale_`` and clipping); the optimizer's update (or ``GradScaler.update``) ends the step.
- how the replay computes the loss is read from what the step did, not guessed: the model's own loss (its output,
  its ``.loss``, or the element of a tuple, list or dict it returned that the backward ran from, recorded as the
  capture's ``loss_at``); a ``torch.nn`` loss module with its default settings called on the model's output (a global
  module hook, removed once the loss is known); or ``cross_entropy`` / ``mse_loss`` applied to the output, read
  from the loss's autograd node (its saved target). Any other loss cannot be replayed from the capture: the
  message at a detection says so and what to do.
- the constructor arguments of every module of a class outside torch, noted as it is built
  (``capture._construction.ConstructionLog``): how the capture's model was built.

Nothing here reads a tensor on the host: the Guard's own checks do, once per step.
"""

from __future__ import annotations

import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._errors import InputError, GuardError, first_line, visible
from .._util._rng import rng_preserved
from ..capture._construction import ConstructionLog
from ..guard.guard import Guard
from ..step._run import loss_position
from ._run import GuardedRun, Unwatchable, output_loss

__all__ = ["Attached", "AttachOptions", "RunRefused"]

_TRAINERS = {
    "transformers.trainer": "transformers.Trainer",
    "lightning.pytorch.trainer.trainer": "Lightning",
    "pytorch_lightning.trainer.trainer": "Lightning",
}


@dataclass(frozen=True)
class AttachOptions:
    dump_dir: str
    on_fail: str = "raise"  # the Guard's on_fail (its own check judges it)
    guard_options: Mapping[str, Any] = field(default_factory=dict)


class RunRefused(InputError):
    """``nanhunt run`` refuses what the script does, from inside the script's run (a Trainer made under
    ``--on-fail rollback``): the command's one line and exit 2, not the script's own failure."""


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any

    def undo(self) -> None:
        setattr(self.owner, self.name, self.original)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``action(module)`` right after one of the watched modules is first executed."""

    def __init__(self, actions: Mapping[str, Callable[[types.ModuleType], None]]) -> None:
        self.actions = dict(actions)
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        action = self.actions.get(fullname)
        if action is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders (this one answers None meanwhile)
        finally:
            self._busy.discard(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            action(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's loader only
        return spec


class Attached:
    """Everything ``nanhunt run`` put into this process; :meth:`close` takes it all out (also after an error)."""

    def __init__(self, options: AttachOptions) -> None:
        self.options = options
        self.framework: str | None = None  # the Trainer found, if any
        self.gave_up = ""  # why a framework run was not watched, or ""
        self.own_callback = False  # the script attached nanhunt's callback itself
        self.callbacks: list[Any] = []  # the framework callbacks made
        self._framework_guards: list[Guard] = []  # their Guards, kept: a callback lets go of its own at the end
        self.loop = _PlainLoop(self)
        self._patches: list[_Patch] = []
        self._finder: _AfterImport | None = None
        self._built = ConstructionLog()  # each module's constructor arguments, noted as it is built

    # ----------------------------------------------------------------- install / remove
    def install(self) -> Attached:
        actions = {name: functools.partial(self._patch_trainer, kind=kind) for name, kind in _TRAINERS.items()}
        for name, action in actions.items():
            module = sys.modules.get(name)
            if module is not None:
                action(module)  # imported already
        self._finder = _AfterImport({k: v for k, v in actions.items() if k not in sys.modules})
        sys.meta_path.insert(0, self._finder)
        self.loop.install()
        self._built.install(self.patch)
        return self

    def close(self, exc: BaseException | None = None) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        try:
            self.loop.close(exc)
            for cb in self.callbacks:
                run = getattr(cb, "run", None)
                if run is not None:
                    run.close(exc)
        finally:
            self._built.close()
            for p in reversed(self._patches):
                p.undo()
            self._patches.clear()

    def patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, make(original))
        self._patches.append(_Patch(owner, name, original))

    # ----------------------------------------------------------------- events
    @property
    def guards(self) -> list[Guard]:
        """The Guards made for the run (a callback's, once its training started; the plain loop's)."""
        return self._framework_guards + self.loop.guards

    @property
    def events(self) -> list[Any]:
        return [e for g in self.guards for e in g.events]

    def guard_options(self) -> dict[str, Any]:
        return {**self.options.guard_options, "on_fail": self.options.on_fail}

    # ----------------------------------------------------------------- frameworks
    def _patch_trainer(self, module: types.ModuleType, *, kind: str) -> None:
        cls = getattr(module, "Trainer", None)
        if not isinstance(cls, type) or "__init__" not in cls.__dict__:
            return
        self.patch(cls, "__init__", lambda init: self._wrapped_init(init, kind))

    def _wrapped_init(self, init: Callable[..., None], kind: str) -> Callable[..., None]:
        attached = self

        @functools.wraps(init)
        def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(trainer, "_nanhunt_attached", False):  # a subclass's __init__ calling this one again
                init(trainer, *args, **kwargs)
                return
            trainer._nanhunt_attached = True
            if kind == "Lightning":
                given = kwargs.get("callbacks")
                given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
                if not attached._has_own(given, kind):
                    kwargs["callbacks"] = [*given, attached._callback(kind)]
                init(trainer, *args, **kwargs)
                return
            init(trainer, *args, **kwargs)
            if not attached._has_own(trainer.callback_handler.callbacks, kind):
                trainer.add_callback(attached._callback(kind))

        return __init__

    def _has_own(self, callbacks: list[Any], kind: str) -> bool:
        """The script gives the Trainer nanhunt's callback itself: that one watches (no second Guard)."""
        if kind == "Lightning":
            from .lightning import NanhuntCallback as Own
        else:
            from .transformers import NanhuntCallback as Own  # type: ignore[assignment]
        if not any(isinstance(c, Own) for c in callbacks):
            return False
        self.framework = kind
        self.loop.stand_down()
        self.own_callback = True
        return True

    def _callback(self, kind: str) -> Any:
        if self.options.on_fail == "rollback":
            raise RunRefused(f"--on-fail rollback is for plain training loops: a {kind} owns its loop, so "
                             "nanhunt cannot skip a batch and go on; use --on-fail stop or continue")
        self.framework = kind
        self.loop.stand_down()
        options = self.guard_options()
        callback: Any
        if kind == "Lightning":
            from .lightning import NanhuntCallback as LightningCallback

            callback = LightningCallback(dump_dir=self.options.dump_dir, **options)
        else:
            from .transformers import NanhuntCallback as TrainerCallback

            callback = TrainerCallback(dump_dir=self.options.dump_dir, **options)
        begin = "on_train_start" if kind == "Lightning" else "on_train_begin"
        setattr(callback, begin, self._started(callback, getattr(callback, begin)))
        self.callbacks.append(callback)
        return callback

    def _started(self, callback: Any, begin: Callable[..., None]) -> Callable[..., None]:
        """The callback's start: its Guard is kept (its events and steps, said at the end); where the callback
        refuses a run it cannot watch (:class:`Unwatchable`: Lightning's manual optimization, two optimizers),
        the refusal is said and the run goes on unwatched."""

        @functools.wraps(begin)
        def call(*args: Any, **kwargs: Any) -> None:
            try:
                begin(*args, **kwargs)
            except Unwatchable as e:
                reason = first_line(e).partition(": ")[2]  # the refusal's own words: its type says nothing more
                self.gave_up = f"nanhunt did not watch the {self.framework} run: {reason}"
                print(f"nanhunt run: {visible(self.gave_up)}; the script goes on unwatched", file=sys.stderr)
                return
            run = callback.run
            if run is not None and run.guard not in self._framework_guards:
                self._framework_guards.append(run.guard)

        return call


def _candidates(optimizer: torch.optim.Optimizer) -> list[nn.Module]:
    """The live modules whose parameters include every parameter ``optimizer`` holds (the model; a wrapper of it
    made already, DDP's; outermost first)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not held:
        return []
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module) and not issubclass(type(obj), torch.jit.ScriptModule):
            try:
                ids = {id(p) for p in obj.parameters()}
            except Exception:  # a half-built module
                continue
            if held <= ids:
                found.append(obj)
    # outermost first: a module holding another candidate comes before it
    return sorted(found, key=lambda m: -sum(1 for _ in m.modules()))


def _default_loss(m: nn.Module) -> bool:
    """A torch.nn loss with its default settings: the capture names its class only, so a replay rebuilds it
    with the defaults (``label_smoothing=0.1`` or class weights would give another loss)."""
    cls = type(m)
    if not (cls.__module__ == "torch.nn.modules.loss" and cls.__name__.endswith("Loss")):
        return False
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            continue
        if not hasattr(m, p.name):
            if p.default is None:
                continue  # size_average / reduce: not kept, folded into reduction
            return False
        value = getattr(m, p.name)
        if isinstance(value, torch.Tensor) or value != p.default:
            return False
    return True


def _output_node(output: Any) -> Any:
    return output.grad_fn if isinstance(output, torch.Tensor) else None


def _below(node: Any, target: Any) -> bool:
    """``node`` takes ``target``'s result, through autocast's casts only."""
    while node is not None:
        if node is target:
            return True
        if node.name() != "ToCopyBackward0":
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        node = nexts[0] if len(nexts) == 1 else None
    return False


_LOOK_FOR_LOSS = 3  # steps in which the loss's computation is looked for (a global module hook)
_SCALINGS = ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1")


def _loss_node(loss: torch.Tensor) -> Any:
    """The autograd node that made the loss, below a division or product by a number (accelerate divides the
    loss by its accumulation steps before the backward)."""
    node = loss.grad_fn
    while node is not None and node.name() in _SCALINGS:
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            break
        node = nexts[0]
    return node


def _functional_loss(node: Any, output: Any) -> tuple[Any, Any] | None:
    """``(loss function, target)`` when ``node`` made ``F.cross_entropy(output, target)`` or
    ``F.mse_loss(output, target)`` with their default settings (read from the node's saved values)."""
    out = _output_node(output)
    if node is None or out is None:
        return None
    try:
        if node.name() == "NllLossBackward0":
            soft = [n for n, _ in node.next_functions if n is not None]
            if (len(soft) == 1 and soft[0].name() == "LogSoftmaxBackward0" and node._saved_weight is None
                    and node._saved_reduction == 1 and node._saved_ignore_index in (-100, 2**64 - 100)
                    and any(_below(n, out) for n, _ in soft[0].next_functions if n is not None)):
                return F.cross_entropy, node._saved_target
        if node.name() == "MseLossBackward0" and node._saved_reduction == 1:
            if any(_below(n, out) for n, _ in node.next_functions if n is not None):
                return F.mse_loss, node._saved_target
    except (AttributeError, RuntimeError):  # a saved tensor freed, another torch
        return None
    return None


class _PlainLoop:
    """The Guard on a loop nanhunt finds by itself (see the module docstring)."""

    def __init__(self, attached: Attached) -> None:
        self.attached = attached
        self.run: GuardedRun | None = None
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.watched: list[tuple[nn.Module, torch.optim.Optimizer]] = []
        self.hooks: list[RemovableHandle] = []
        self.index = 0  # optimizer updates so far: the step number
        self.down = False
        self.loss_known: str | None = None  # "model", "module", "functional", "unseen"
        self.loss_note = ""
        self._out: Any = None  # the model's output in the open step, until its loss is handed over
        self._calls: list[tuple[Any, nn.Module, tuple[Any, ...]]] = []  # top-level loss-like calls of the step
        self._batch: dict[str, Any] | None = None
        self._backward = False  # a backward ran since the step began (a next forward is a next micro-batch)
        self._global: RemovableHandle | None = None
        self.skipped_calls = 0
        self.gave_up = ""  # why nanhunt stopped watching (its own failure), or ""
        self.guards: list[Guard] = []  # the plain loop's guard (once made), for its events

    # ----------------------------------------------------------------- install
    def install(self) -> None:
        a = self.attached
        loop = self
        shield = self._shielded
        a.patch(torch.optim.Optimizer, "__init__", lambda init: _after(init, shield(loop._made)))
        scaler_cls = torch.amp.GradScaler
        a.patch(scaler_cls, "scale", lambda f: _before(f, shield(loop._scaled)))
        a.patch(scaler_cls, "step", lambda f: _before(f, shield(loop._scaler_step)))
        a.patch(scaler_cls, "update", lambda f: _after(f, shield(loop._scaler_update)))
        a.patch(torch.Tensor, "backward", lambda f: _before(f, shield(loop._backward_called)))

    def _shielded(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook`` run so that nanhunt's own failure never breaks the script: the watch stops, says why, and the
        script goes on as without nanhunt. A detection (:class:`GuardError`) and Ctrl-C go through."""

        @functools.wraps(hook)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                return None
            try:
                return hook(*args, **kwargs)
            except GuardError:
                raise
            except Exception as e:
                self.gave_up = f"nanhunt stopped watching the loop ({first_line(e)})"
                print(f"nanhunt run: {visible(self.gave_up)}; the script goes on unwatched", file=sys.stderr)
                self.stand_down()
                return None

        return call

    def stand_down(self) -> None:
        """A framework Trainer runs the loop: the plain-loop watch stops."""
        self.down = True
        self.close(None)

    def close(self, exc: BaseException | None) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self._drop_global()
        run, self.run = self.run, None
        if run is not None:
            run.close(exc)

    # ----------------------------------------------------------------- events of the loop
    @rng_preserved  # it scans the live objects inside the script's own optimizer construction
    def _made(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        if self.down or self.run is not None or not isinstance(optimizer, torch.optim.Optimizer):
            return
        inner: torch.optim.Optimizer = optimizer
        while isinstance(wrapped := getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = wrapped  # accelerate's AcceleratedOptimizer: the torch optimizer inside
        if inner in self.optimizers:
            return
        self.optimizers.add(inner)
        for module in _candidates(inner):
            self.watched.append((module, inner))
            self.hooks.append(module.register_forward_pre_hook(self._shielded(self._forward_begins), prepend=True,
                                                               with_kwargs=True))
            self.hooks.append(module.register_forward_hook(self._shielded(self._forward_ends)))

    def _optimizer_of(self, module: nn.Module) -> torch.optim.Optimizer | None:
        return next((o for m, o in self.watched if m is module), None)

    def _forward_begins(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.down or not module.training or not torch.is_grad_enabled():
            return
        run = self.run
        if run is None:
            optimizer = self._optimizer_of(module)
            if optimizer is None:
                return
            run = self._start(module, optimizer)
        elif run.guard.model is not module:
            return  # another candidate (the module inside a wrapper the loop calls)
        if run.open and not self._backward:
            return  # a second forward within one micro-batch
        if args and kwargs:
            self.skipped_calls += 1
            return  # positional and keyword arguments together: no batch file holds that call
        inputs: Any = dict(kwargs) if kwargs else (args[0] if len(args) == 1 and isinstance(args[0], torch.Tensor)
                                                  else tuple(args))
        self._batch = {"inputs": inputs}
        self._out, self._calls, self._backward = None, [], False
        run.begin(self._batch, self.index)
        if self.loss_known is None and self._global is None and self.index < _LOOK_FOR_LOSS:
            self._global = torch.nn.modules.module.register_module_forward_hook(self._shielded(self._any_forward))

    def _forward_ends(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        run = self.run
        if run is None or not run.open or run.guard.model is not module or self._out is not None:
            return
        self._out = output
        loss = output_loss(output)
        if isinstance(loss, torch.Tensor) and not run.loss_seen:
            self._loss(loss)

    def _any_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._out is not None and isinstance(output, torch.Tensor) and output.dim() == 0 and args:
            self._calls.append((output, module, args))

    def _scaled(self, scaler: Any, outputs: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(outputs, torch.Tensor):
            self._loss(outputs)

    def _backward_called(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        run = self.run
        if run is not None and run.open:
            self._loss(tensor)
            self._backward = True

    def _scaler_step(self, scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        run = self.run
        if run is not None and run.open and run.guard.scaler is scaler and self._holds(optimizer):
            run.check_grads()

    def _scaler_update(self, scaler: Any, *args: Any, **kwargs: Any) -> None:
        run = self.run
        if run is not None and run.guard.scaler is scaler:
            self._updated()

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        run = self.run
        if run is not None and not (run.guard.scaler is not None and run.guard.scaler.is_enabled()):
            self._updated()

    def _holds(self, optimizer: Any) -> bool:
        run = self.run
        while run is not None and optimizer is not None:
            if optimizer is run.guard.optimizer:
                return True
            optimizer = getattr(optimizer, "optimizer", None)
        return False

    def _updated(self) -> None:
        """The optimizer step is over (updated or skipped by the GradScaler): the guard step ends."""
        run = self.run
        self.index += 1
        self._out, self._calls = None, []
        self._drop_global()  # the loss is decided at its first hand-over, within the first step
        if run is not None and run.open:
            run.end()

    # ----------------------------------------------------------------- the guard
    @rng_preserved  # the Guard is made in the script's first training forward, after its seeding
    def _start(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> GuardedRun:
        scalers = [o for o in gc.get_objects() if issubclass(type(o), torch.amp.GradScaler) and o.is_enabled()]
        scaler = scalers[-1] if len(scalers) == 1 else None
        options = self.attached.guard_options()
        guard = Guard(model, optimizer, scaler, dump_dir=self.attached.options.dump_dir, **options)
        guard._rollback.no_indices = ("nanhunt run sees the inputs the model is called with, not their dataset "
                                      "indices (guard the loop with nanhunt.Guard: guard.step(batch, indices=...))")
        hooks = [optimizer.register_step_post_hook(self._shielded(self._optimizer_stepped))]
        self.guards.append(guard)
        self.run = GuardedRun(guard, "training", hooks)
        child = next(model.children(), None)
        if "dtype" not in options and child is not None:
            self.run.probe_autocast(child, self._shielded)
        return self.run

    def _loss(self, loss: torch.Tensor) -> None:
        run = self.run
        if run is None or not run.open or run.loss_seen:
            return
        if self.loss_known is None:
            self._identify(loss)
        batch = self._batch
        if batch is not None and self.loss_known in ("module", "functional"):
            target = self._target(loss)
            if target is not None:
                batch["targets"] = target
        run.loss(loss)
        self._out, self._calls = None, []

    def _target(self, loss: torch.Tensor) -> Any:
        node = _loss_node(loss)
        if self.loss_known == "module":
            hit = next((args for out, _, args in self._calls if out.grad_fn is node), None)
            return hit[1] if hit is not None and len(hit) > 1 else None
        found = _functional_loss(node, self._out)
        return found[1] if found is not None else None

    def _identify(self, loss: torch.Tensor) -> None:
        """How the replay computes the loss (the module docstring): decided at the first loss handed over."""
        out = self._out
        run = self.run
        assert run is not None
        if out is None:
            return  # a backward before the model ran: not the training loss
        node = _loss_node(loss)
        own = output_loss(out)
        call = next(((m, args) for o, m, args in self._calls if o.grad_fn is node), None)
        found = _functional_loss(node, out)
        if node is not None and node in (_output_node(out), _output_node(own)):
            self.loss_known = "model"
        elif (at := loss_position(out, node)) is not None:  # logits, loss = model(x, y)
            self.loss_known = "model"
            run.guard._capture.set_loss_at(at)
        elif call is not None and _default_loss(call[0]) and call[1][0] is out and len(call[1]) <= 2:
            self.loss_known = "module"
            run.guard._capture.set_loss_fn(call[0])
            # its targets at every step after this one (the global hook goes now)
            self.hooks.append(call[0].register_forward_hook(self._shielded(self._any_forward)))
        elif found is not None:
            self.loss_known = "functional"
            run.guard._capture.set_loss_fn(found[0])
        else:
            self.loss_known = "unseen"
            self.loss_note = _unseen_note(node, call)
        self._drop_global()

    def _drop_global(self) -> None:
        if self._global is not None:
            self._global.remove()
            self._global = None


def _unseen_note(node: Any, call: tuple[nn.Module, tuple[Any, ...]] | None) -> str:
    made = type(call[0]).__name__ if call is not None else (node.name() if node is not None else "no autograd node")
    return (f"the loss is computed from the model's output by code nanhunt cannot name ({made}); the capture holds "
            "the model's inputs only: put a nanhunt.Guard in the loop (loss_fn=...) to replay the whole step")


def _before(f: Callable[..., Any], hook: Callable[..., None]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hook(*args, **kwargs)
        return f(*args, **kwargs)

    return wrapper


def _after(f: Callable[..., Any], hook: Callable[..., None]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = f(*args, **kwargs)
        hook(*args, **kwargs)
        return result

    return wrapper
