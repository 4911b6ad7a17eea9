"""Ctrl-C at any point of a restore, or of a Guard step's entry and exit, leaves everything as it was.

Interrupts are injected from a trace function at the N-th line event nanhunt executes inside the target. The
restores are hit with real signals (``signal.raise_signal(SIGINT)`` goes through the installed SIGINT handler,
as a Ctrl-C does); the Guard, which holds nothing back, with a KeyboardInterrupt raised at the line. After each
interrupt the model (parameters, BatchNorm buffers, ``.grad``), optimizer, GradScaler and torch / Python / NumPy
RNG are compared bit for bit with what they were.
"""

from __future__ import annotations

import dis
import functools
import importlib
import math
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.step import snapshot as step_module
from nanhunt.hunt.bisection import bisect
from nanhunt.guard.guard import _StepContext
from nanhunt.step.step import Step, StepState

NANHUNT = os.path.dirname(os.path.abspath(nanhunt.__file__)) + os.sep
RESTORES = {StepState.restore.__code__, StepState._restore.__code__, StepState._unspill_grads.__code__,
            StepState.reset.__code__, StepState.__exit__.__code__}
ENTER, EXIT = {_StepContext.__enter__.__code__}, {_StepContext.__exit__.__code__}
Event = tuple[int, str, int]  # (which top-level call of a target, file, line)


# ------------------------------------------------------------------ injection
class _Inject:
    """sys.settrace function: ``fire()`` at the ``at``-th line event nanhunt runs (in ``files``: paths or
    folders) while a target is on the stack (``at=None``: only record the events).

    Skipped: line events where no interrupt can happen, and where an exception raised by a trace function lands
    outside the enclosing ``with``/``try`` (CPython 3.11), which no real Ctrl-C can do: a NOP (it only carries a
    line number: a bare ``try:``, the end of a loop) and the normal exit of a ``with`` block (``LOAD_CONST None``
    three times, then the ``__exit__`` call: a Ctrl-C there is handled inside ``__exit__`` or after it).
    """

    def __init__(self, targets: set[CodeType], fire: Callable[[], None], at: int | None = None, *,
                 files: tuple[str, ...] = (NANHUNT,)) -> None:
        self.targets, self.fire, self.at, self.files = targets, fire, at, files
        self.inside = 0  # target frames on the stack
        self.entries = 0  # top-level target calls so far
        self.events: list[Event] = []
        self.fired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:  # the 'call' events
        if not frame.f_code.co_filename.startswith(self.files):
            return None
        if frame.f_code in self.targets:
            self.entries += self.inside == 0
            self.inside += 1
            return self._target
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.inside and not self.fired and frame.f_lasti not in _no_interrupt(frame.f_code):
            self.events.append((self.entries, frame.f_code.co_filename, frame.f_lineno))
            if len(self.events) == self.at:
                self.fired = True
                self.fire()
        return self._line

    def _target(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.inside -= 1
        else:
            self._line(frame, event, arg)
        return self._target


@functools.cache
def _no_interrupt(code: CodeType) -> frozenset[int]:
    ins = list(dis.get_instructions(code))
    out = {i.offset for i in ins if i.opname == "NOP"}
    for k in range(len(ins) - 3):
        if all(i.opname == "LOAD_CONST" and i.argval is None for i in ins[k:k + 3]) \
                and ins[k + 3].opname in ("PRECALL", "CALL"):
            out.add(ins[k].offset)
    return frozenset(out)


def _inject_everywhere(targets: set[CodeType], fire: Callable[[], None], run: Callable[[_Inject], None], *,
                       every_event: bool = True, files: tuple[str, ...] = (NANHUNT,)) -> int:
    """``run(inject)`` once per injection point; returns how many. ``every_event``: every line event (a line
    in a loop once per pass); otherwise the first event of each line of code in each top-level target call.
    ``files``: where line events count (:class:`_Inject`)."""
    survey = _Inject(targets, lambda: None, files=files)
    run(survey)
    events = survey.events
    assert events, "the target never ran"
    first: dict[Event, int] = {}
    for i, e in enumerate(events, 1):
        first.setdefault(e, i)
    points = range(1, len(events) + 1) if every_event else sorted(first.values())
    for n in points:
        inject = _Inject(targets, fire, at=n, files=files)
        run(inject)
        assert inject.events == events[:n], f"line event {n} of {len(events)} moved: the runs are not deterministic"
    return len(points)


def _traced(inject: _Inject, fn: Callable[[], Any]) -> Any:
    sys.settrace(inject)
    try:
        return fn()
    finally:
        sys.settrace(None)


def _sigint() -> None:
    signal.raise_signal(signal.SIGINT)  # the handler runs before the traced line does


def _raise() -> None:
    raise KeyboardInterrupt


# ------------------------------------------------------------------ a model and its state
def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    _train(model, opt, scaler, _batch(1))  # gradients, Adam moments, BatchNorm statistics, a scale tensor
    return model, opt, scaler


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
           b: tuple[torch.Tensor, torch.Tensor]) -> None:
    """An AMP step that changes every kind of state, the RNGs included."""
    x, y = b
    opt.zero_grad(set_to_none=True)  # new gradient tensors, as a replayed step makes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    torch.rand(1), random.random(), np.random.rand()


def _bits(v: Any) -> Any:
    """A copy in which every tensor is its bits (NaN payloads and -0.0 included) as integers."""
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous().clone()
        if not t.is_floating_point():
            return t
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    if isinstance(v, dict):
        return {k: _bits(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_bits(x) for x in v)
    return v


def _state(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict[str, Any]:
    params = list(model.parameters())
    return _bits({
        "param_ids": [id(p) for p in params],
        "params": params,
        "buffers": dict(model.named_buffers()),
        "grads": [p.grad for p in params],
        "grad_ids": [id(p.grad) for p in params],
        "requires_grad": [p.requires_grad for p in params],
        "training": [m.training for m in model.modules()],
        "optimizer": opt.state_dict(),
        "scaler": dict(vars(scaler)),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "grad_mode": torch.is_grad_enabled(),
    })


def _same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(autouse=True)
def _one_thread_default_sigint() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny steps: intra-op threads only contend
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
        # THEN (every test) the handler in place is the one that was there before
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the SIGINT handler was not put back"
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, previous)
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ restores
@pytest.mark.slow
@pytest.mark.parametrize("snapshot", [None, "disk"])
def test_step_state_holds_sigint_at_every_line_event_of_reset_and_restore(
        snapshot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a trained model, Adam and a GradScaler, and a StepState of them used as a context manager, its copies
    # in memory or (every tensor, the .grad ones too) in a mapped temporary file
    monkeypatch.setattr(step_module, "_DISK_MIN_BYTES", 0)
    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)
    rng = {"torch": torch.get_rng_state()}

    def run(inject: _Inject) -> None:
        try:
            with StepState(model, opt, scaler, snapshot=snapshot, directory=str(tmp_path)) as state:
                assert (state.on_disk > 0) == (snapshot == "disk")
                _train(model, opt, scaler, _batch(2))
                _traced(inject, lambda: state.reset(rng))
                _train(model, opt, scaler, _batch(3))
                sys.settrace(inject)  # and through the restore on leaving the block
        except KeyboardInterrupt:
            interrupted = True
        else:
            interrupted = False
        finally:
            sys.settrace(None)
        # THEN the interrupt propagates, after a restore that put back every bit
        assert interrupted == inject.fired
        _same(before, _state(model, opt, scaler))

    # WHEN Ctrl-C arrives at each line event of reset() and of the final restore
    assert _inject_everywhere(RESTORES, _sigint, run) > 500
    assert os.listdir(tmp_path) == []  # and no file is left


@pytest.mark.slow
def test_replay_holds_sigint_at_every_line_of_its_restores() -> None:
    # GIVEN the state after training
    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)

    def run(inject: _Inject) -> None:
        try:
            _traced(inject, lambda: nanhunt.replay(model, _batch(4), loss_fn=F.mse_loss, dtype=torch.bfloat16,
                                                   scaler=scaler, optimizer=opt))
        except KeyboardInterrupt:
            assert inject.fired
        else:
            assert not inject.fired
        # THEN KeyboardInterrupt propagated, and replay left every bit as it was
        _same(before, _state(model, opt, scaler))

    # WHEN Ctrl-C arrives at each line of code of replay()'s restores: the reset before each traced run and
    # the restore at the end (each line once per restore: a step of a loop is the line already tested)
    assert _inject_everywhere(RESTORES, _sigint, run, every_event=False) > 100


def test_bisect_holds_sigint_at_every_line_of_its_restores() -> None:
    # GIVEN the state after training, and a bisection: each trial resets and restores, then a final restore
    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)
    last = 0

    def run(inject: _Inject) -> None:
        nonlocal last
        try:
            verdict = _traced(inject, lambda: bisect(Step.of(model, _batch(5), loss_fn=F.mse_loss, dtype=torch.bfloat16,
                                                             scaler=scaler, optimizer=opt), origin=None))
        except KeyboardInterrupt:
            # THEN a Ctrl-C in the final restore goes on to the caller once the restore is done ...
            assert inject.fired and inject.events[-1][0] == last
        else:
            # ... and one in a trial's reset or restore ends the search with what it found, as during its step
            assert verdict.interrupted == inject.fired
            assert not inject.fired or inject.events[-1][0] < last
            last = last or inject.entries
        # ... and every bit is as it was
        _same(before, _state(model, opt, scaler))

    # WHEN Ctrl-C arrives at each line of code of each of its restores
    assert _inject_everywhere(RESTORES, _sigint, run, every_event=False) > 200


def test_restore_called_alone_is_never_half_done() -> None:
    # GIVEN a StepState, a training step, and restore() called without the with-block
    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)
    state = StepState(model, opt, scaler)
    restored = 0

    def run(inject: _Inject) -> None:
        nonlocal restored
        _train(model, opt, scaler, _batch(2))
        stepped = _state(model, opt, scaler)
        try:
            _traced(inject, state.restore)
        except KeyboardInterrupt:
            assert inject.fired
        # THEN restored, or (a Ctrl-C before its handler is in place) not started: never a mix of the two
        if _same_bool(before, _state(model, opt, scaler)):
            restored += 1
        else:
            _same(stepped, _state(model, opt, scaler))
            state.restore()

    # WHEN Ctrl-C arrives at each line event of it
    points = _inject_everywhere(RESTORES, _sigint, run)
    assert points > 200
    assert points - restored <= 12  # not started: the few lines before its SIGINT and SIGTERM handlers are installed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_custom_handler_is_called_after_the_restore_and_put_back(signum: int) -> None:
    # GIVEN a SIGINT or SIGTERM handler of the user's that records instead of raising
    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)
    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(len(_state(model, opt, scaler)["params"]))  # what the handler saw: state restored?
        calls.append(int(_same_bool(before, _state(model, opt, scaler))))

    previous = signal.signal(signum, handler)
    try:
        # WHEN the signal arrives in the middle of the restore on leaving the block
        with StepState(model, opt, scaler):
            _train(model, opt, scaler, _batch(2))
            sys.settrace(_Inject(RESTORES, lambda: signal.raise_signal(signum), at=40))
        sys.settrace(None)
        # THEN the user's handler ran once, after the restore was complete, and is in place again
        assert calls == [len(before["params"]), 1]
        assert signal.getsignal(signum) is handler
        _same(before, _state(model, opt, scaler))
    finally:
        sys.settrace(None)
        signal.signal(signum, previous)


def test_sigterm_ends_a_bisection_once_its_restore_is_done() -> None:
    # GIVEN SIGTERM raising, as the command line has it, and a bisection (whose trials end the search with what
    # they found on a Ctrl-C)
    from nanhunt._util._interrupt import Terminated, terminate_raises

    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)
    with terminate_raises():
        # WHEN SIGTERM arrives in the middle of a trial's reset
        inject = _Inject(RESTORES, lambda: signal.raise_signal(signal.SIGTERM), at=60)
        with pytest.raises(Terminated):
            _traced(inject, lambda: bisect(Step.of(model, _batch(5), loss_fn=F.mse_loss, dtype=torch.bfloat16,
                                                   scaler=scaler, optimizer=opt), origin=None))
    # THEN it ends the bisection itself (no verdict), once every bit is put back; the default handler is back
    assert inject.fired
    _same(before, _state(model, opt, scaler))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _same_bool(a: Any, b: Any) -> bool:
    try:
        _same(a, b)
    except AssertionError:
        return False
    return True


def test_restore_in_another_thread_leaves_the_handler_alone() -> None:
    # GIVEN a StepState used from a thread that is not the main one (signals reach only the main thread)
    model, opt, scaler = _setup()
    before = _state(model, opt, scaler)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with StepState(model, opt, scaler):
                _train(model, opt, scaler, _batch(2))
        except BaseException as e:  # noqa: BLE001  (reported to the test below)
            errors.append(e)

    # WHEN it runs and restores there
    t = threading.Thread(target=work)
    t.start()
    t.join()
    # THEN it restored, and touched no signal handler
    assert errors == []
    _same(before, _state(model, opt, scaler))


# ------------------------------------------------------------------ Guard
def _guard(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, dump_dir: Path,
           **kw: Any) -> nanhunt.Guard:
    # the headroom history on every step: each run of a test takes the same path (one in 16 would alternate)
    kw.setdefault("headroom_every", 1)
    return nanhunt.Guard(model, opt, scaler, dump_dir=dump_dir, loss_fn=F.mse_loss, on_fail="dump", **kw)


def _guarded_step(guard: nanhunt.Guard, model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                  b: tuple[torch.Tensor, torch.Tensor], *, nan_loss: bool = False,
                  then: Callable[[], None] = lambda: None, batch: Any = None) -> None:
    x, y = b
    with guard.step(b if batch is None else batch):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        if nan_loss:
            guard.loss(loss * math.nan)  # checked at the step's exit (no check_grads in this step)
        else:
            guard.loss(loss)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            guard.check_grads()
            scaler.step(opt)
            scaler.update()
        then()


def _usable(guard: nanhunt.Guard, model: nn.Module, opt: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler) -> None:
    """A following ordinary step works and is counted once."""
    n, updates = guard.iterations, guard.updates
    _guarded_step(guard, model, opt, scaler, _batch(7))
    assert (guard.iterations, guard.updates, guard.stepped) == (n + 1, updates + 1, True)


def test_guard_entry_interrupted_at_every_line_leaves_it_usable(tmp_path: Path) -> None:
    # GIVEN a Guard with BatchNorm buffers to copy at entry and a snapshot to take (snapshot_every=1)
    model, opt, scaler = _setup()
    guard = _guard(model, opt, scaler, tmp_path, snapshot_every=1, check_params=True)
    for i in range(2):  # past the first steps, which copy every buffer: every run below takes the same path
        _guarded_step(guard, model, opt, scaler, _batch(i))

    def run(inject: _Inject) -> None:
        before, n = _state(model, opt, scaler), guard.iterations
        try:
            _traced(inject, lambda: _guarded_step(guard, model, opt, scaler, _batch(3)))
        except KeyboardInterrupt:
            # THEN the interrupt propagates; the step never began: nothing counted, nothing changed
            assert inject.fired
            assert guard.iterations == n
            _same(before, _state(model, opt, scaler))
        # and the next step works
        _usable(guard, model, opt, scaler)

    # WHEN a KeyboardInterrupt is raised at each line event nanhunt runs entering `with guard.step(batch)`
    assert _inject_everywhere(ENTER, _raise, run) > 30
    assert guard.events == []


@pytest.mark.slow
@pytest.mark.parametrize("nan_loss", [False, True], ids=["clean-step", "capture-at-exit"])
def test_guard_exit_interrupted_at_every_line_leaves_it_usable(tmp_path: Path, nan_loss: bool) -> None:
    # GIVEN a Guard checking parameters and the handed loss at exit; with a NaN loss, exit writes a capture
    model, opt, scaler = _setup()
    guard = _guard(model, opt, scaler, tmp_path, check_params=True, max_captures=10**6)
    for i in range(2):
        _guarded_step(guard, model, opt, scaler, _batch(i))
    runs = iter(range(10**6))

    def run(inject: _Inject) -> None:
        snap: list[dict[str, Any]] = []
        n, updates = guard.iterations, guard.updates
        guard.dump_dir = str(tmp_path / str(next(runs)))

        def body_done() -> None:
            snap.append(_state(model, opt, scaler))
            sys.settrace(inject)  # from here: the exit path

        try:
            _guarded_step(guard, model, opt, scaler, _batch(3), nan_loss=nan_loss, then=body_done)
        except KeyboardInterrupt:
            assert inject.fired
        finally:
            sys.settrace(None)
        # THEN the exit path changed none of the user's state, counted the step at most once ...
        _same(snap[0], _state(model, opt, scaler))
        assert guard.iterations in (n, n + 1) and guard.updates - updates in (0, int(not nan_loss))
        # ... left a capture whole or not at all, and no temporary file ...
        files = sorted(os.listdir(guard.dump_dir)) if os.path.isdir(guard.dump_dir) else []
        stems = {f.rsplit("-", 1)[0] for f in files}
        assert all(f.endswith((".pt", ".json")) for f in files), files
        for stem in stems:
            assert {f"{stem}-checkpoint.pt", f"{stem}-batch.pt"} <= set(files), files
        # ... and the next step works
        _usable(guard, model, opt, scaler)

    # WHEN a KeyboardInterrupt is raised at each line event nanhunt runs leaving `with guard.step(batch)`
    assert _inject_everywhere(EXIT, _raise, run) > (100 if nan_loss else 20)


def test_guard_failed_batch_save_leaves_no_orphan_checkpoint(tmp_path: Path) -> None:
    # GIVEN a Guard whose step's batch cannot be saved (it holds a lambda, which torch.save cannot pickle)
    model, opt, scaler = _setup()
    guard = _guard(model, opt, scaler, tmp_path)
    x, y = _batch(2)
    # WHEN the step fails its loss check and the guard tries to capture it
    _guarded_step(guard, model, opt, scaler, (x, y), nan_loss=True, batch=(x, {"y": y, "f": lambda: 0}))
    # THEN the event says there is no capture, and there is none: no checkpoint, batch or temporary file
    (event,) = guard.events
    assert event.checkpoint is None and event.capture_error is not None
    assert "no capture" in event.describe()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ the command line's bundle
ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ("report.md", "report.json", "report.html", "report.png", "repro.py", "repro_inputs.pt")
REPLAY = ["--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss", "--no-bisect"]
# Where the command line writes the report and the bundle (the renderers are left out: no file changes there)
WRITING = tuple(NANHUNT + f for f in (os.path.join("cli", "_output.py"), os.path.join("cli", "_common.py"),
                                      os.path.join("_util", "_bundle.py"),
                                      os.path.join("_util", "_files.py"), os.path.join("_util", "_interrupt.py"),
                                      os.path.join("report", "__init__.py")))


@pytest.fixture
def replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A replay command line whose hunt returns the golden report at once, its repro written into the bundle as
    make_repro writes it, and whose picture is a fixed PNG: only the command line's own writing runs."""
    from fixtures.models import MLP
    from nanhunt._util._bundle import claim
    from nanhunt.records import Report

    monkeypatch.chdir(ROOT)
    report = Report.from_json((ROOT / "tests" / "golden" / "report.json").read_text(encoding="utf-8"))
    assert report.repro is not None and set(report.repro.files) == {"repro.py", "repro_inputs.pt"}

    def hunt(step: Any, *, bundle: str | None = None, **kw: Any) -> Any:
        if bundle is not None:
            claim(bundle)
            for name in report.repro.files:  # type: ignore[union-attr]
                Path(bundle, name).write_bytes(f"new {name}\n".encode())
        return report

    # the command line imports them when it runs: patch the modules' attributes
    monkeypatch.setattr(importlib.import_module("nanhunt.hunt.pipeline"), "hunt", hunt)
    monkeypatch.setattr(importlib.import_module("nanhunt.report.picture"), "png", lambda r, **kw: b"\x89PNG picture")
    torch.save(MLP().state_dict(), tmp_path / "checkpoint.pt")
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), tmp_path / "batch.pt")
    return ["replay", str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt"), *REPLAY]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()} if d.is_dir() else {}


@pytest.mark.slow
def test_a_bundle_write_interrupted_at_every_line_leaves_the_earlier_bundle_or_the_new_one(
        replayed: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from nanhunt.cli import main
    from nanhunt.cli._output import ReplayOutput

    # GIVEN an earlier bundle nanhunt wrote, every file of which then held b"old\n"
    earlier = tmp_path / "earlier" / "bundle"
    assert main([*replayed, "--bundle", str(earlier)]) == 1
    for name in BUNDLE:
        (earlier / name).write_bytes(b"old\n")
    old = _files(earlier)
    capsys.readouterr()
    new: dict[str, bytes] = {}
    runs = iter(range(10**6))
    show = {ReplayOutput.show.__code__}

    def run(inject: _Inject) -> None:
        home = tmp_path / str(next(runs))
        bundle = home / "bundle"
        shutil.copytree(earlier, bundle)
        code = _traced(inject, lambda: main([*replayed, "--bundle", str(bundle)]))
        last = capsys.readouterr().err.strip().splitlines()[-1]
        got = _files(bundle)
        if not new:  # the survey, uninterrupted: the new bundle
            assert code == 1 and not inject.fired and got != old, last
            new.update(got)
        # THEN the bundle directory holds the earlier bundle, and the last line says nothing was written ...
        if got == old:
            assert code == 130 and last == "nanhunt: interrupted; the model and files were left as they were", last
        # ... or the new bundle whole, and an interrupt's line names it as written
        else:
            assert got == new, sorted(got)
            assert code == 1 or last == (f"nanhunt: interrupted after writing {str(bundle)!r}; the model and other "
                                         "files were left as they were"), last
        # ... and nothing is left beside it
        assert sorted(p.name for p in home.iterdir()) == ["bundle"]

    # WHEN Ctrl-C arrives at each line event of the command line writing the report and the bundle
    # (each line once: a loop's next pass writes nothing the first did not)
    assert _inject_everywhere(show, _sigint, run, every_event=False, files=WRITING) > 100


SLEEPY = """
import os
import time

from torch import nn


class Sleepy(nn.Module):
    # fixtures.models.MLP's layout; its forward says it started, then waits for the signal
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)

    def forward(self, x):
        open(os.environ["NANHUNT_TEST_STARTED"], "w").close()
        time.sleep(120)
        return self.fc2(self.act(self.fc1(x)))
"""


@pytest.mark.subprocess
def test_sigterm_during_a_replay_puts_everything_back_and_exits_143(tmp_path: Path) -> None:
    import subprocess
    import time

    from fixtures.models import MLP

    # GIVEN a replay with a bundle whose model is running when SIGTERM arrives (a job scheduler's stop)
    (tmp_path / "sleepy.py").write_text(SLEEPY, encoding="utf-8")
    torch.save(MLP().state_dict(), tmp_path / "checkpoint.pt")
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), tmp_path / "batch.pt")
    started = tmp_path / "started"
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanhunt", "replay", "checkpoint.pt", "batch.pt", "--model",
         f"{tmp_path / 'sleepy.py'}:Sleepy", "--loss", "torch.nn.functional:mse_loss", "--no-bisect",
         "--snapshot", "disk", "--bundle", str(out / "bundle")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "NANHUNT_TEST_STARTED": str(started), "TMPDIR": str(out)})
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), proc.communicate(timeout=60)
        # WHEN it arrives
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # THEN the restore ran and the command says so in one line, exit 143 (128 + SIGTERM), no traceback ...
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "nanhunt: terminated (SIGTERM); the model and files were left as they were"
    assert "Traceback" not in err
    # ... and no bundle, no half-written one beside it, no snapshot file is left
    assert list(out.iterdir()) == [], err
