"""Prove why: replay the step with module sets in float32 until a minimal set makes it finite.

Each trial replays the same step from the same state and RNG (no tracing: one
question, is the whole step finite?) with the chosen modules run by
:func:`nanhunt.keep_fp32`. The search descends the module tree from coarse to
fine, trying the child on the path to the origin first, then splitting the
children in halves; with one culprit it costs about two trials per tree level
plus two per halving, i.e. it grows with log(modules), not with their number.

The set found is the proof; the fix proposed is then measured, in a traced replay with it in float32: the
origins still born there (silent ones included) extend it, a few rounds at most, and those it cannot remove are
said (``Verdict.remaining``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._util._dispatch import all_finite, local_tensor
from .._util._wrappers import user_modules
from ..step._float8 import float8_fix, float8_layers, out_of_float8
from ..step.precision import LOSS_REGION, REGIONS, UPDATE_REGION, has_half_weights
from .._util._errors import InputError
from ..records import Level, Occurrence, Phase, Verdict, VerdictKind
from ..step.step import Step
from ..tracing.tracer import Trace

__all__ = ["bisect", "suggested_fix"]


class _Interrupted(Exception):
    pass


class Team(Protocol):
    """The ranks of a distributed replay bisecting together (``nanhunt.hunt._dist_replay``): rank 0 leads, decides
    each trial and sends it; every rank runs it; its finiteness is agreed, so every rank's collectives meet."""

    leads: bool

    def send(self, order: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """The leader's ``order``, on every rank (the others pass None)."""
        ...

    def all_finite(self, ok: bool) -> bool:
        """Whether the trial was finite on every rank."""
        ...


class _Trials:
    """Runs one finite/non-finite trial of the step per call and counts them."""

    def __init__(self, step: Step, progress: Callable[[int, str], None] | None, team: Team | None = None, *,
                 level: Level = Level.OP, allow: Sequence[str] = ()) -> None:
        self.step, self.progress, self.team = step, progress, team
        self.level, self.allow = level, tuple(allow)  # the hunt's trace: what counts as an origin
        self.count = 0
        self.cache: dict[tuple[Any, ...], bool] = {}
        # a silent origin (the step stays finite): a trial is "finite" when that origin is gone too
        self.watch: Occurrence | None = None

    def finite(self, fp32: frozenset[str], *, dtype: torch.dtype | None = None, unscaled: bool = False,
               label: str = "", called: set[str] | None = None, hp: frozenset[str] = frozenset(),
               rowwise: frozenset[str] = frozenset()) -> bool:
        """``dtype=torch.float32`` is the float32 control: the model's half-precision weights and
        the batch run in float32 too. ``called`` collects the names of the modules the step calls. ``hp``: float8
        layers run as ``nn.Linear``; ``rowwise``: float8 layers run with the rowwise recipe."""
        key = (fp32, dtype, unscaled, hp, rowwise)
        if key in self.cache and called is None:
            return self.cache[key]
        self.count += 1
        if self.progress is not None:
            self.progress(self.count, label or ", ".join(sorted(n or "<root>" for n in fp32)) or "original")
        if self.team is not None:
            self.team.send(("trial", fp32, dtype, unscaled, self.watch, hp, rowwise))
        ok = self.run(fp32, dtype=dtype, unscaled=unscaled, watch=self.watch, called=called, hp=hp, rowwise=rowwise)
        if self.team is not None:
            ok = self.team.all_finite(ok)
        self.cache[key] = ok
        return ok

    def run(self, fp32: frozenset[str], *, dtype: torch.dtype | None, unscaled: bool, watch: Occurrence | None,
            called: set[str] | None = None, hp: frozenset[str] = frozenset(),
            rowwise: frozenset[str] = frozenset()) -> bool:
        """One trial on this rank, uncached."""
        step = self.step
        handles: list[RemovableHandle] = []
        result: list[bool] = []
        undo: list[Callable[[], None]] = []

        def hooks() -> None:
            if called is not None:
                handles.extend(_record_calls(step.model, called))
            # before the float32 regions wrap their modules: a layer both out of float8 and in float32 is both
            undo.extend(self._float8(hp, rowwise))

        # the origin's module alone is traced (op level): the question is only whether it is still born
        tracer = None if watch is None else Trace(step.model, level=Level.OP, scope=[watch.module] if watch.module else ())
        try:
            # A Ctrl-C held while the state was put back arrives when the reset returns: inside this try,
            # so the search ends with what it found, as on a Ctrl-C during the step.
            step.run(fp32=fp32, dtype=dtype, unscaled=unscaled, within=tracer, before=hooks,
                     after=lambda loss: result.append(_step_finite(step.model, loss, step.optimizer)))
        except KeyboardInterrupt as e:
            raise _Interrupted from e
        finally:
            for u in undo:
                u()
            for h in handles:
                h.remove()
        return result[0] and not (tracer is not None and watch is not None
                                  and any(_same_place(o, watch) for o in tracer.origins))

    def measure(self, fp32: frozenset[str], *, hp: frozenset[str] = frozenset(),
                rowwise: frozenset[str] = frozenset()) -> tuple[bool, tuple[Occurrence, ...]]:
        """One traced replay of the whole step with ``fp32`` in float32 (``hp``, ``rowwise``: float8 layers as in
        :meth:`finite`; counted, never cached): whether the step is finite, and the origins born in it (leading and
        silent; harmless and allowed ones are no question)."""
        self.count += 1
        if self.progress is not None:
            what = [*sorted(n or "<root>" for n in fp32), *(f"{n} as nn.Linear" for n in sorted(hp)),
                    *(f"{n} rowwise" for n in sorted(rowwise))]
            self.progress(self.count, "the fix, traced: " + ", ".join(what))
        if self.team is not None:
            self.team.send(("measure", fp32, hp, rowwise))
        ok, origins = self.traced(fp32, hp=hp, rowwise=rowwise)
        if self.team is not None:
            ok = self.team.all_finite(ok)
        return ok, origins

    def traced(self, fp32: frozenset[str], *, hp: frozenset[str] = frozenset(),
               rowwise: frozenset[str] = frozenset()) -> tuple[bool, tuple[Occurrence, ...]]:
        """:meth:`measure` on this rank."""
        step = self.step
        tracer = Trace(step.model, level=self.level, allow=self.allow)
        result: list[bool] = []
        undo: list[Callable[[], None]] = []
        try:
            step.run(fp32=fp32, within=tracer, before=lambda: undo.extend(self._float8(hp, rowwise)),
                     after=lambda loss: result.append(_step_finite(step.model, loss, step.optimizer)))
        except KeyboardInterrupt as e:
            raise _Interrupted from e
        finally:
            for u in undo:
                u()
        return result[0], tuple(o for o in tracer.origins if not o.harmless and not o.allowed)

    def _float8(self, hp: frozenset[str], rowwise: frozenset[str]) -> list[Callable[[], None]]:
        """Take ``hp`` out of float8 and give ``rowwise`` the rowwise recipe; the undo to call after the run."""
        if not hp and not rowwise:
            return []
        return [out_of_float8(float8_layers(self.step.model), hp, rowwise)]


def _same_place(o: Occurrence, watch: Occurrence) -> bool:
    """``o`` is the watched silent origin born again: same phase and module (and op, outside modules)."""
    return (not o.allowed and not o.harmless and o.phase is watch.phase and o.module == watch.module
            and (watch.module is not None or o.op == watch.op))


def _step_finite(model: nn.Module, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> bool:
    """Loss, every gradient, parameter and buffer (after the update) and the optimizer's state finite: one host
    read (:func:`~nanhunt._util._dispatch.all_finite`)."""
    # a DTensor (FSDP2) is judged by this rank's shard: a distributed bisection agrees on every rank's answer
    tensors = [local_tensor(loss.detach())]
    for p in model.parameters():
        tensors.append(local_tensor(p.detach()))
        if p.grad is not None:
            tensors.append(local_tensor(p.grad))
    tensors += [local_tensor(b) for b in model.buffers()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return all_finite(tensors)


def suggested_fix(culprits: Sequence[str], classes: Sequence[str] = ()) -> str | None:
    """The code to paste for ``culprits`` (modules, ``<loss>``, ``<update>``) and every module of ``classes``
    (``"package.module:Class"``; ``__main__``'s: the training script's own, not imported) in float32."""
    mods = [c for c in culprits if c not in REGIONS]
    lines = []
    if mods or classes:
        lines.append("import nanhunt")
        for path in classes:
            module, _, qualname = path.partition(":")
            if module != "__main__":
                lines.append(f"from {module} import {qualname.split('.')[0]}")
        items = [path.partition(":")[2] for path in classes] + [repr(m) for m in mods]
        lines.append(f"nanhunt.keep_fp32_permanently(model, [{', '.join(items)}])  # after building the model")
    if LOSS_REGION in culprits:
        lines.append("# compute the loss in float32, outside autocast:")
        lines.append("with torch.autocast(device_type, enabled=False):")
        lines.append("    loss = loss_fn(output.float(), targets)")
    if UPDATE_REGION in culprits:
        lines.append("# update float32 master weights: keep the model's parameters (and so the optimizer's state)")
        lines.append("# in float32 instead of model.half(), and run the forward under torch.autocast")
    return "\n".join(lines) or None


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called themselves: their forward runs nothing


def _record_calls(model: nn.Module, called: set[str]) -> list[RemovableHandle]:
    """Forward pre-hooks adding each called module's name to ``called``; returns their handles."""
    handles: list[RemovableHandle] = []
    for name, mod in user_modules(model).items():
        def hook(_m: nn.Module, _args: Any, name: str = name) -> None:
            called.add(name)

        handles.append(mod.register_forward_pre_hook(hook))
    return handles


def _children(model: nn.Module, called: Collection[str] | None = None) -> dict[str, list[str]]:
    """Module tree for the search; containers, and modules the step never calls (a plain
    nn.Module used as a namespace, ``called`` known), are transparent: their children move up.
    keep_fp32 on such a module would change nothing. Names as a trace gives them: torch's wrappers (DDP,
    FSDP1, torch.compile) are transparent too."""
    modules = user_modules(model)
    names = {id(m): n for n, m in modules.items()}

    def transparent(m: nn.Module) -> bool:
        return m is not model and (id(m) not in names or isinstance(m, _CONTAINERS)
                                   or (called is not None and names.get(id(m)) not in called))

    def kids(m: nn.Module) -> list[str]:
        out: list[str] = []
        for c in m.children():
            if transparent(c):
                out.extend(kids(c))
            elif id(c) in names:
                out.append(names[id(c)])
        return out

    return {n: kids(m) for n, m in modules.items() if not transparent(m)}


def bisect(
    step: Step,
    *,
    origin: Occurrence | None,
    origins: Sequence[Occurrence] = (),
    progress: Callable[[int, str], None] | None = None,
    locate_fp32: Callable[[], Occurrence | None] | None = None,
    team: Team | None = None,
    level: Level = Level.OP,
    allow: Sequence[str] = (),
) -> Verdict:
    """Find a minimal set of modules (and the regions ``<loss>``, ``<update>``) whose float32 execution makes
    ``step`` finite.

    ``origin`` is the leading origin, ``origins`` all of them (default: ``origin`` alone); ``level`` and
    ``allow`` as the hunt traced them (the fix's traced replay finds origins as it did). Restores the
    model, optimizer, scaler and RNG afterwards, also on Ctrl-C (the verdict then says ``interrupted``
    and holds what was found so far).

    ``team``: a distributed replay, every rank calling this at once: rank 0 (``team.leads``, given the leading
    origin of the rank that went first) runs the search and sends each trial; the others run them and
    return the verdict rank 0 sends at the end.
    """
    trials = _Trials(step, progress, team, level=level, allow=allow)
    if team is not None and not team.leads:
        return _follow(trials, team, locate_fp32)
    if team is not None:
        locate_fp32 = _announced(team, locate_fp32)
    proof = _Proof(step, origin, tuple(origins) or ((origin,) if origin is not None else ()), trials)
    try:
        verdict = _bisect(step, proof, locate_fp32)
    except BaseException:
        if team is not None:
            team.send(("done", None))  # no rank is left waiting for an order
        raise
    if team is not None:
        team.send(("done", verdict))
    return verdict


def _bisect(step: Step, proof: _Proof, locate_fp32: Callable[[], Occurrence | None] | None) -> Verdict:
    with step.isolated():  # restored on leaving, also on Ctrl-C (held until the restore is complete)
        try:
            return proof.run(locate_fp32)
        except _Interrupted:
            return proof.verdict(proof.found_kind if proof.found else VerdictKind.INTERRUPTED, tuple(proof.found),
                                 origin_alone_fixes=proof.origin_alone, interrupted=True)


def _announced(team: Team, locate_fp32: Callable[[], Occurrence | None] | None,
               ) -> Callable[[], Occurrence | None] | None:
    """The leader's float32 control: the other ranks are told to trace it too (its trace gathers every rank)."""
    if locate_fp32 is None:
        return None
    inner = locate_fp32

    def locate() -> Occurrence | None:
        team.send(("locate",))
        return inner()

    return locate


def _follow(trials: _Trials, team: Team, locate_fp32: Callable[[], Occurrence | None] | None) -> Verdict:
    """A rank other than the leader: run each trial the leader sends until it sends its verdict."""
    with trials.step.isolated():
        while True:
            order = team.send(None)
            if order[0] == "trial":
                _, fp32, dtype, unscaled, watch, hp, rowwise = order
                try:
                    ok = trials.run(fp32, dtype=dtype, unscaled=unscaled, watch=watch, hp=hp, rowwise=rowwise)
                except _Interrupted:
                    ok = False
                team.all_finite(ok)
            elif order[0] == "measure":  # the leader's origins decide the fix; this rank's trace takes part
                try:
                    ok = trials.traced(order[1], hp=order[2], rowwise=order[3])[0]
                except _Interrupted:
                    ok = False
                team.all_finite(ok)
            elif order[0] == "locate" and locate_fp32 is not None:
                locate_fp32()
            elif order[0] == "done":
                verdict = order[1]
                if not isinstance(verdict, Verdict):
                    raise InputError("rank 0's bisection failed (its error says why); the other ranks stopped")
                return verdict


class _Proof:
    """One bisection: its trials, what it found so far, and the verdict it gives."""

    def __init__(self, step: Step, origin: Occurrence | None, origins: tuple[Occurrence, ...],
                 trials: _Trials) -> None:
        self.step, self.origin, self.origins = step, origin, origins
        self.trials = trials
        # The first origin whose value reached the loss or the gradients; silent ones were absorbed.
        self.reaching = next((o for o in origins if not o.silent), None)
        # Only silent origins: the step stays finite, and the question becomes "is the origin gone?"
        # (harmless ones, feeding only indices, are no question).
        self.silent = None if self.reaching is not None else next(
            (o for o in origins if not o.harmless and not o.allowed), None)
        self.trials.watch = self.silent
        self.t0 = time.perf_counter()
        self.alternatives: dict[str, bool] = {}
        model = step.model
        self.children = _children(model)
        self.root = ""  # the model, or the module a torch wrapper wraps (named as a trace names it)
        self.table = user_modules(model)
        self.modules = set(self.table)
        self.with_loss = step.loss_fn is not None
        # a half-precision model's update is a candidate of its own: float32 master copies (the fix)
        self.with_update = step.optimizer is not None and has_half_weights(model)
        self.regions = ([LOSS_REGION] if self.with_loss else []) + ([UPDATE_REGION] if self.with_update else [])
        self.origin_mod = origin.module if origin is not None else None
        self.found: list[str] = []
        self.found_kind = VerdictKind.PRECISION  # what ``found`` holds: float32 regions, or float8 layers
        self.origin_alone: bool | None = None
        self.float8 = frozenset(float8_layers(model))

    def verdict(self, kind: VerdictKind, culprits: tuple[str, ...] = (), *, fix: _Fix | None = None,
                remaining: tuple[Occurrence, ...] | None = None, code: str | None = None, **kw: Any) -> Verdict:
        """``fix``: the one measured (``remaining`` what it left); else, on a ``precision`` verdict, the culprits.
        ``code``: the fix of a ``float8-induced`` one."""
        proposed = fix or _Fix(frozenset(culprits), ())
        text = suggested_fix(sorted(proposed.named, key=_region_last), [p for p, _ in proposed.classes])
        float8 = kind == VerdictKind.FLOAT8_INDUCED
        return Verdict(kind=kind, culprits=culprits, replays=self.trials.count, seconds=time.perf_counter() - self.t0,
                       alternatives=dict(self.alternatives), fix=text if kind == VerdictKind.PRECISION else code,
                       candidates=len(self.float8) if float8 else len(self.children) + len(self.regions),
                       silent=self.silent is not None and kind in (VerdictKind.PRECISION, VerdictKind.FLOAT8_INDUCED),
                       fix_regions=tuple(sorted(proposed.regions(self.table), key=_region_last)) if fix else (),
                       fix_classes=tuple(p for p, _ in proposed.classes), remaining=remaining, **kw)

    def fix(self, found: Sequence[str]) -> tuple[_Fix, tuple[Occurrence, ...]]:
        """The fix to propose, from ``found`` (the proof), and the origins a traced replay with it still has:
        while some remain, it grows (:meth:`grow`) and is measured again, :data:`FIX_ROUNDS` times at most; a
        growth is kept when that replay is finite and left fewer origins, or others (it moved them on)."""
        fix = _Fix(frozenset(found), ())
        left = self.trials.measure(fix.regions(self.table))[1]
        for _ in range(FIX_ROUNDS):
            grown = self.grow(fix, left) if left else None
            if grown is None:
                break
            ok, after = self.trials.measure(grown.regions(self.table))
            if not ok or len(after) > len(left) or _places(after) == _places(left):
                break
            fix, left = grown, after
        return fix, left

    def grow(self, fix: _Fix, left: Sequence[Occurrence]) -> _Fix | None:
        """``fix`` with the places of the origins ``left`` added (their modules; ``<loss>``, ``<update>``). A class
        whose modules hold two or more of the step's origins, and are most of its modules, is named instead of
        them (every RMSNorm). None: nothing to add."""
        named = set(fix.named)
        for o in left:
            if o.module is not None and o.module in self.modules:
                named.add(o.module)
            elif o.module is None and o.phase is Phase.LOSS and self.with_loss:
                named.add(LOSS_REGION)
            elif o.phase is Phase.UPDATE and self.with_update:
                named.add(UPDATE_REGION)
        held = {o.module for o in (*self.origins, *left) if o.module}  # not the root: no class to name
        classes = dict(fix.classes)
        same: dict[type[nn.Module], list[str]] = {}
        for n in named & held & self.modules:
            same.setdefault(type(self.table[n]), []).append(n)
        for cls, names in same.items():
            path = _class_path(cls)
            of_class = sum(isinstance(m, cls) for m in self.table.values())
            if path is not None and len(names) >= 2 and 2 * len(names) > of_class:
                classes[path] = cls
        kept = _Fix(frozenset(n for n in named if not (n in self.table and isinstance(
            self.table[n], tuple(classes.values())))), tuple(sorted(classes.items(), key=lambda kv: kv[0])))
        return None if kept.regions(self.table) == fix.regions(self.table) else kept

    def alone(self) -> bool | None:
        """Does the origin's module (or region) alone in float32 fix the step? One replay; None: no such place.

        A backward origin outside every module (a scaled gradient cast back to float16: the loss scale's
        multiply, autocast's cast of the loss's input) is in the backward of the loss: its place is ``<loss>``,
        and with no loss function the model, whose output is the loss."""
        origin, trials = self.origin, self.trials
        if self.origin_mod is not None and self.origin_mod in self.modules:
            return trials.finite(frozenset({self.origin_mod}), label=f"{self.origin_mod or '<root>'} alone")
        if origin is None:
            return None
        phase = origin.phase
        if self.with_loss and (phase is Phase.LOSS or (phase is Phase.BACKWARD and origin.module is None)):
            return trials.finite(frozenset({LOSS_REGION}), label="<loss> alone")
        if phase is Phase.BACKWARD and origin.module is None and self.root in self.modules:
            return trials.finite(frozenset({self.root}), label="<root> alone")
        if phase is Phase.UPDATE and self.with_update:
            return trials.finite(frozenset({UPDATE_REGION}), label="<update> alone")
        return None

    def target(self) -> str | None:
        """What the search tries first: the origin's module, <loss> for an origin in the loss, <update> for
        one in a half-precision model's update."""
        o = self.origin
        if o is not None and self.origin_mod is None and o.phase.value == "loss" and self.with_loss:
            return LOSS_REGION
        if o is not None and o.phase.value == "update" and self.with_update:
            return UPDATE_REGION
        return self.origin_mod

    def run(self, locate_fp32: Callable[[], Occurrence | None] | None) -> Verdict:
        step, trials, model = self.step, self.trials, self.step.model
        # With half-precision weights (model.half()) the original is no float32 run even without autocast.
        # float32 everywhere is no float8 either: every float8 layer runs as the nn.Linear it was
        if ((step.dtype != torch.float32 or has_half_weights(model))
                and not trials.finite(frozenset(), dtype=torch.float32, hp=self.float8, label="float32 everywhere")):
            self.origin_alone = self.alone()
            return self.verdict(VerdictKind.NOT_PRECISION, float32_first=locate_fp32() if locate_fp32 else None,
                                origin_alone_fixes=self.origin_alone)
        called: set[str] = set()
        if trials.finite(frozenset(), label="original configuration", called=called):
            if self.origins and self.reaching is None and self.silent is None:
                # Every origin fed only indices (harmless) and the step is finite, as traced:
                # nothing for float32 to fix.
                return self.verdict(VerdictKind.CLEAN)
            return self.verdict(VerdictKind.NOT_REPRODUCIBLE)
        self.origin_alone = self.alone()
        self.children = _children(model, called)
        if step.dtype == torch.float16:
            self.alternatives["bfloat16"] = trials.finite(frozenset(), dtype=torch.bfloat16, label="bfloat16 instead")
        scaler = step.scaler
        if scaler is not None and scaler.is_enabled():
            self.alternatives["scale 1"] = trials.finite(frozenset(), unscaled=True, label="loss scale 1")
            if self.alternatives["scale 1"] and self.reaching is not None and self.reaching.phase.value == "backward":
                return self.verdict(VerdictKind.SCALE_INDUCED, origin_alone_fixes=self.origin_alone)
        if self.float8:
            verdict = self.out_of_float8()
            if verdict is not None:
                return verdict
        target = self.target()
        top = [self.root] + self.regions
        if not trials.finite(frozenset(top), label="whole model and loss"):
            return self.verdict(VerdictKind.NOT_PRECISION, origin_alone_fixes=self.origin_alone)
        self.found = _search(trials, top, frozenset(), self.children, target)
        self.found = _refine(trials, self.found, self.children, target)
        self.found = _prune(trials, self.found)
        # The confirmation is one more clean run of exactly that set, not a cached answer.
        trials.cache.pop((frozenset(self.found), None, False), None)
        confirmed = trials.finite(frozenset(self.found), label="confirm (clean run)")
        fix, left = self.fix(self.found)
        return self.verdict(VerdictKind.PRECISION, tuple(self.found), origin_alone_fixes=self.origin_alone, confirmed=confirmed,
                            fix=fix, remaining=left)


    def out_of_float8(self) -> Verdict | None:
        """``float8-induced``: a minimal set of float8 layers whose running as ``nn.Linear`` (same weights) makes
        the step finite, confirmed by a clean run; then whether the rowwise recipe on them alone does too, and the
        fix given (rowwise where it does, else the layers left out of float8) measured in a traced replay. None:
        the step fails with every float8 layer out too (the precision search goes on)."""
        trials = self.trials
        if not trials.finite(frozenset(), hp=self.float8, label="every float8 layer as nn.Linear"):
            return None
        self.found_kind = VerdictKind.FLOAT8_INDUCED
        judge = _OutOfFloat8(trials)
        self.found = _search(judge, sorted(self.float8), frozenset(), {}, self.origin_mod)
        self.found = sorted(_prune(judge, self.found))
        found = frozenset(self.found)
        trials.cache.pop((frozenset(), None, False, found, frozenset()), None)
        confirmed = trials.finite(frozenset(), hp=found, label="confirm (clean run): " + ", ".join(self.found))
        try:
            rowwise = trials.finite(frozenset(), rowwise=found, label="rowwise: " + ", ".join(self.found))
        except RuntimeError:  # the recipe's casts need what this device lacks: not a fix here
            rowwise = False
        left = trials.measure(frozenset(), hp=frozenset() if rowwise else found,
                              rowwise=found if rowwise else frozenset())[1]
        return self.verdict(VerdictKind.FLOAT8_INDUCED, tuple(self.found), origin_alone_fixes=self.origin_alone,
                            confirmed=confirmed, remaining=left, rowwise_fixes=rowwise,
                            code=float8_fix(self.found, rowwise=rowwise))


class _Judge(Protocol):
    def finite(self, fp32: frozenset[str]) -> bool:
        """Whether the step is finite with the set given."""
        ...


class _OutOfFloat8:
    """The search's question for float8 layers: is the step finite with these run as ``nn.Linear``?"""

    def __init__(self, trials: _Trials) -> None:
        self.trials = trials

    def finite(self, fp32: frozenset[str]) -> bool:
        return self.trials.finite(frozenset(), hp=fp32, label="as nn.Linear: " + ", ".join(sorted(fp32)))


FIX_ROUNDS = 3  # growths of the proposed fix tried (one traced replay each) while origins remain


@dataclass(frozen=True)
class _Fix:
    """A proposed fix: modules and regions named one by one, and classes (``"package.module:Class"``, the class)
    whose every module runs in float32."""

    named: frozenset[str]
    classes: tuple[tuple[str, type[nn.Module]], ...]

    def regions(self, table: Mapping[str, nn.Module]) -> frozenset[str]:
        """What runs in float32, by name (as a trace names modules)."""
        kinds = tuple(c for _, c in self.classes)
        return self.named | {n for n, m in table.items() if kinds and isinstance(m, kinds)}


def _class_path(cls: type) -> str | None:
    """``"package.module:Class"``, None for a class defined in a function (nothing can import it)."""
    return None if "<locals>" in cls.__qualname__ else f"{cls.__module__}:{cls.__qualname__}"


def _places(origins: Sequence[Occurrence]) -> set[tuple[Phase, str | None, str | None]]:
    return {(o.phase, o.module, o.op) for o in origins}


def _region_last(c: str) -> tuple[bool, str]:
    return c in REGIONS, c


def _on_path(c: str, origin_mod: str | None) -> bool:
    """``c`` is the origin's module or one of its ancestors (``origin_mod`` may be ``<loss>``)."""
    if origin_mod is None:
        return False
    if c in REGIONS or origin_mod in REGIONS:
        return c == origin_mod
    return c == "" or origin_mod == c or origin_mod.startswith(c + ".")


def _order(cands: list[str], origin_mod: str | None) -> list[str]:
    """Candidates on the path to the origin first (stable otherwise)."""
    return sorted(cands, key=lambda c: not _on_path(c, origin_mod))


def _search(trials: _Judge, cands: list[str], base: frozenset[str], children: Mapping[str, list[str]],
            origin_mod: str | None) -> list[str]:
    """A minimal subset of ``cands`` that, with ``base`` in float32, makes the step finite.
    Assumes ``base | cands`` does (and that more float32 never makes it worse)."""
    cands = _order(cands, origin_mod)
    if len(cands) == 1:
        return cands
    first = cands[0]
    if _on_path(first, origin_mod) and trials.finite(base | {first}):
        return [first]
    half = len(cands) // 2
    a, b = cands[:half], cands[half:]
    if trials.finite(base | set(a)):
        return _search(trials, a, base, children, origin_mod)
    if trials.finite(base | set(b)):
        return _search(trials, b, base, children, origin_mod)
    got_a = _search(trials, a, base | set(b), children, origin_mod)
    got_b = _search(trials, b, base | set(got_a), children, origin_mod)
    return got_a + got_b


def _prune(trials: _Judge, found: list[str]) -> list[str]:
    """Drop members the step does without. The search assumes more float32 never hurts; a
    module whose float32 output is huge (a finfo.min mask) can break that."""
    result = list(found)
    for m in list(result):
        if len(result) > 1 and trials.finite(frozenset(x for x in result if x != m)):
            result.remove(m)
    return result


def _refine(trials: _Trials, found: list[str], children: Mapping[str, list[str]],
            origin_mod: str | None) -> list[str]:
    """Descend: replace each module by the fewest of its children that still make the step finite."""
    result = list(found)
    changed = True
    while changed:
        changed = False
        for m in list(result):
            kids = children.get(m, []) if m not in REGIONS else []
            if not kids:
                continue
            rest = frozenset(x for x in result if x != m)
            if not trials.finite(rest | set(kids)):
                continue  # m's own code (between its children) needs float32: keep m
            sub = _search(trials, kids, rest, children, origin_mod)
            result = [x for x in result if x != m] + sub
            changed = True
            break
    return sorted(result, key=_region_last)
