"""nanhunt.Guard rollback: back to the last good pre-update state, bit for bit, then on with the next batch."""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import math
import os
import random
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.guard.guard import GuardWarning

from tests._support.guard import batch as mlp_batch
from tests._support.guard import guard_for, mlp_setup
from tests._support.dist import finish_rank, meet_again

Batch = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ a model with every kind of state
def _net(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """BatchNorm (buffers a forward writes), Dropout (torch's RNG), Adam (state), a GradScaler."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=1024.0)


def _batch(i: int, *, bad: bool = False) -> Batch:
    g = torch.Generator().manual_seed(10 + i)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    if bad:
        x = torch.full_like(x, 1e5)  # Inf once autocast casts it to float16: the loss is NaN
    return x, y


def _amp_step(guard: nanhunt.Guard | None, model: nn.Module, opt: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler, b: Batch, *, host_rng: bool = False,
              dtype: torch.dtype = torch.float16) -> None:
    """One AMP step, guarded or not; ``host_rng``: it also draws from Python's and NumPy's generators."""
    x, y = b
    with guard.step(b) if guard is not None else contextlib.nullcontext():
        opt.zero_grad(set_to_none=True)
        if host_rng:  # an augmentation drawn in the step
            x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape)).float() + 0.01 * random.random()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(model(x), y)
        if guard is not None:
            loss = guard.loss(loss)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if guard is not None:
            guard.check_grads()
        scaler.step(opt)
        scaler.update()


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, b: Batch) -> None:
    """The snapshot tests' step, unguarded: bfloat16, no GradScaler."""
    x, y = b
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()


# ------------------------------------------------------------------ state, compared bit for bit
def _bits(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        t = v.detach().clone()
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) \
            if t.is_floating_point() else t
    if isinstance(v, dict):
        return {k: _bits(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_bits(x) for x in v)
    return copy.deepcopy(v)


def _state(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    return _bits({
        "params": dict(model.named_parameters()),
        "buffers": dict(model.named_buffers()),
        "optimizer": opt.state_dict(),
        "scaler": None if scaler is None else (scaler._scale, scaler._growth_tracker),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1],
    })


def _same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} != {b.keys()}"
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


def _objects(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> list[int]:
    """The ids of every tensor the user and the optimizer hold."""
    ts: list[Any] = [*model.parameters(), *model.buffers()]
    ts += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if scaler is not None:
        ts += [scaler._scale, scaler._growth_tracker]
    return [id(t) for t in ts]


def _all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


# ------------------------------------------------------------------ (a) a non-finite loss, with a GradScaler
@pytest.mark.parametrize("on_fail", ["raise", "rollback"])
def test_nan_loss_rolled_back_bit_for_bit_then_the_loop_equals_a_run_without_the_bad_batch(
        tmp_path: Path, on_fail: str) -> None:
    # GIVEN an AMP loop (float16, GradScaler, Adam, BatchNorm, Dropout) whose batch 3 makes the loss NaN, and
    # with on_fail="rollback" an augmentation drawn from Python's and NumPy's generators in every step
    host = on_fail == "rollback"
    model, opt, scaler = _net()
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail=on_fail)  # type: ignore[arg-type]
    random.seed(1)
    np.random.seed(1)
    entry: dict[str, Any] = {}
    ids: list[int] = []
    stepped: list[bool] = []
    # WHEN it runs 7 batches; with on_fail="raise" the loop catches the GuardError and calls guard.rollback()
    for i in range(7):
        if i == 3:
            entry, ids = _state(model, opt, scaler), _objects(model, opt, scaler)
        try:
            if host:
                with pytest.warns(GuardWarning) if i == 3 else warnings.catch_warnings():
                    if i != 3:
                        warnings.simplefilter("error")
                    _amp_step(guard, model, opt, scaler, _batch(i, bad=i == 3), host_rng=True)
            else:
                _amp_step(guard, model, opt, scaler, _batch(i, bad=i == 3))
        except nanhunt.GuardError:
            assert i == 3 and not _all_finite(model)  # the BatchNorm statistics hold NaN now
            guard.rollback()
        stepped.append(guard.stepped)
        if i == 3:
            # THEN right after the rollback every tensor is back, bit for bit, in the same objects, RNG included,
            # and no gradient is left
            _same(entry, _state(model, opt, scaler))
            assert _objects(model, opt, scaler) == ids
            assert all(p.grad is None for p in model.parameters())
    # THEN the step counts are those of a run that never saw batch 3
    assert stepped == [True, True, True, False, True, True, True]
    assert (guard.iterations, guard.updates, guard.skipped, guard.rollbacks) == (7, 6, 0, 1)
    assert [(e.step, e.kind) for e in guard.events] == [(3, "loss"), (3, "rollback")]
    rb = guard.events[1]
    assert (rb.restored_step, rb.updates, rb.skipped, rb.rollbacks, rb.scale) == (3, 3, 0, 1, 1024.0)
    assert rb.checkpoint == guard.events[0].checkpoint and rb.checkpoint is not None
    # AND the weights, buffers, optimizer, scaler and RNG equal, bit for bit, those of that run
    ref_model, ref_opt, ref_scaler = _net()
    random.seed(1)
    np.random.seed(1)
    for i in (0, 1, 2, 4, 5, 6):
        _amp_step(None, ref_model, ref_opt, ref_scaler, _batch(i), host_rng=host)
    _same(_state(ref_model, ref_opt, ref_scaler), _state(model, opt, scaler))
    # AND the rollback log holds the event, which reads back equal
    lines = (tmp_path / "rollbacks.jsonl").read_text().splitlines()
    assert len(lines) == 1
    assert nanhunt.GuardEvent.from_dict(json.loads(lines[0])) == rb


def test_skipped_step_scale_backoff_is_undone(tmp_path: Path) -> None:
    # GIVEN on_fail="dump": the failing step runs to its end, GradScaler skips it and halves its scale
    model, opt, scaler = _net()
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail="dump")
    _amp_step(guard, model, opt, scaler, _batch(0))
    entry = _state(model, opt, scaler)
    _amp_step(guard, model, opt, scaler, _batch(1, bad=True))
    assert (float(scaler._scale), guard.skipped, guard.stepped) == (512.0, 1, False)
    # WHEN the loop rolls it back
    ev = guard.rollback()
    # THEN the scale is 1024 again, the skip is no longer counted, and everything else is as step 1 began
    assert (float(scaler._scale), guard.skipped, guard.updates, guard.rollbacks) == (1024.0, 0, 1, 1)
    assert guard.scale_history == [(0, 1024.0)]  # the scale in use: step 2 runs with 1024, as steps 0 and 1
    _same(entry, _state(model, opt, scaler))
    assert "rolled back (#1) to the state step 1 began with, step 1 undone and skipped" in ev.describe()
    # AND a second call has nothing left to roll back
    with pytest.raises(RuntimeError, match="nothing to roll back"):
        guard.rollback()


# ------------------------------------------------------------------ (b) an update that wrote non-finite weights
def _lr_bomb(guard: nanhunt.Guard, model: nn.Module, opt: torch.optim.Optimizer, steps: range, bad: int,
             entries: dict[int, dict[str, Any]], *, rollback: bool = True) -> None:
    """SGD (momentum), bfloat16, no scaler: a broken schedule gives step ``bad`` lr=1e36 (finite gradients, Inf
    update). The loop sets the learning rate before each step, rolls back after a detection, and goes on."""
    for i in steps:
        for g in opt.param_groups:
            g["lr"] = 1e36 if i == bad else 1e-2
        entries[i] = _state(model, opt, None)
        with guard.step(mlp_batch(i, big_target=i == bad)):
            x, y = mlp_batch(i, big_target=i == bad)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = guard.loss(F.mse_loss(model(x), y))
            loss.backward()
            guard.check_grads()
            opt.step()
        if rollback and guard.events and guard.events[-1].kind != "rollback":
            guard.rollback()


@pytest.mark.parametrize("check_params", [True, False])
def test_poisoned_update_rolled_back_from_the_snapshot(tmp_path: Path, check_params: bool) -> None:
    # GIVEN snapshot_every=1 and an update at step 3 that writes Inf into the weights; found at the end of step 3
    # (check_params=True) or when step 4's loss comes out non-finite (the default)
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, snapshot_every=1, check_params=check_params, on_fail="dump")
    entries: dict[int, dict[str, Any]] = {}
    _lr_bomb(guard, model, opt, range(4 if check_params else 5), 3, entries)
    # THEN the rollback restored, bit for bit, the state step 3 began with (lr=1e36 included: it was set before
    # the step), into the tensors the optimizer holds; the steps since are undone
    last = 3 if check_params else 4
    assert [(e.step, e.kind) for e in guard.events] == [(last, "params"), (last, "rollback")]
    assert guard.events[1].restored_step == 3
    _same(entries[3], _state(model, opt, None))
    assert opt.param_groups[0]["lr"] == 1e36
    assert all(s["momentum_buffer"] is opt.state[p]["momentum_buffer"] for p, s in zip(model.parameters(),
                                                                                       opt.state.values()))
    assert (guard.iterations, guard.updates, guard.skipped, guard.rollbacks, guard.stepped) == (last + 1, 3, 0, 1,
                                                                                                False)
    # WHEN the loop goes on for 3 more batches
    _lr_bomb(guard, model, opt, range(last + 1, last + 4), -1, entries)
    # THEN weights and momentum equal those of a run that skipped the batches of steps 3..last
    ref_model, ref_opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    for i in [0, 1, 2, *range(last + 1, last + 4)]:
        for g in ref_opt.param_groups:
            g["lr"] = 1e-2
        _plain_step(ref_model, ref_opt, mlp_batch(i))
    want, got = _state(ref_model, ref_opt, None), _state(model, opt, None)
    _same({k: want[k] for k in ("params", "buffers", "optimizer")}, {k: got[k] for k in ("params", "buffers",
                                                                                        "optimizer")})
    assert (guard.updates, guard.rollbacks) == (6, 1)


def test_poisoned_update_without_a_snapshot_is_refused_in_one_line(tmp_path: Path) -> None:
    # GIVEN no snapshot_every and an update that wrote Inf into the weights (on_fail="dump")
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, check_params=True, on_fail="dump")
    _lr_bomb(guard, model, opt, range(4), 3, {}, rollback=False)
    poisoned = _state(model, opt, None)
    # WHEN the loop asks for a rollback
    with pytest.raises(nanhunt.GuardError) as info:
        guard.rollback()
    # THEN it is refused in one line that names the fix, and nothing was restored
    msg = str(info.value)
    assert "\n" not in msg
    assert ("cannot roll back: the update of step 3 wrote the weights and no snapshot holds them from before it: "
            "pass snapshot_every=1 to nanhunt.Guard") in msg
    _same(poisoned, _state(model, opt, None))
    assert (guard.rollbacks, guard.updates, guard.events[-1].kind) == (0, 4, "rollback")
    assert guard.events[-1].rollback_error is not None
    # AND with on_fail="rollback" the step itself raises it (no silent continuation)
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path / "auto", check_params=True, on_fail="rollback")
    with pytest.raises(nanhunt.GuardError, match="pass snapshot_every=1"):
        _lr_bomb(guard, model, opt, range(4), 3, {}, rollback=False)


def test_rollback_mode_without_a_scaler_holds_the_condemned_update(tmp_path: Path) -> None:
    # GIVEN on_fail="rollback", no GradScaler, no snapshot, and a loop that calls optimizer.step() whatever
    # check_grads said; step 2's gradients are NaN
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, on_fail="rollback")
    entry: dict[str, Any] = {}
    for i in range(4):
        if i == 2:
            entry = _state(model, opt, None)
        x, y = mlp_batch(i)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with guard.step((x, y)):
                opt.zero_grad(set_to_none=True)
                loss = F.mse_loss(model(x), y) * (math.nan if i == 2 else 1.0)
                loss.backward()
                opt.step()  # the guard's pre-update check finds the NaN gradients
        if i == 2:
            # THEN the update did not happen (the guard dropped the gradients first), the step was rolled back
            # from the live state, with a warning, and no snapshot was needed
            assert [type(w.message) for w in caught] == [GuardWarning]
            _same(entry, _state(model, opt, None))
    assert (guard.iterations, guard.updates, guard.rollbacks) == (4, 3, 1)
    assert [(e.step, e.kind) for e in guard.events] == [(2, "grads"), (2, "rollback")]


# ------------------------------------------------------------------ max_rollbacks, and counters for a scheduler
def test_on_fail_rollback_is_bounded_by_max_rollbacks(tmp_path: Path) -> None:
    # GIVEN on_fail="rollback", max_rollbacks=2, a scheduler stepped when guard.stepped, bad batches at 1, 3 and 5
    model, opt, scaler = _net()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail="rollback",
                          max_rollbacks=2)
    # WHEN it runs
    with pytest.raises(nanhunt.GuardError) as info, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(7):
            _amp_step(guard, model, opt, scaler, _batch(i, bad=i in (1, 3, 5)))
            if guard.stepped:
                sched.step()
    # THEN the first two go on with a warning each; the third raises, as on_fail="raise" would
    assert [str(w.message).split(";")[0] for w in caught] == ["nanhunt.Guard: non-finite loss at step 1",
                                                              "nanhunt.Guard: non-finite loss at step 3"]
    assert "cannot roll back: max_rollbacks=2 reached" in str(info.value)
    # AND the counters are exact: 3 updates stand (steps 0, 2, 4), 2 rollbacks, and step 5, not rolled back,
    # stays a GradScaler skip; the scheduler stepped once per real update
    assert (guard.iterations, guard.updates, guard.skipped, guard.rollbacks) == (6, 3, 1, 2)
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3
    kinds = [(e.step, e.kind, e.rollback_error is None) for e in guard.events]
    assert kinds == [(1, "loss", True), (1, "rollback", True), (3, "loss", True), (3, "rollback", True),
                     (5, "loss", True), (5, "rollback", False)]
    logged = [json.loads(line) for line in (tmp_path / "rollbacks.jsonl").read_text().splitlines()]
    assert [(d["step"], d["rollbacks"], d["rollback_error"]) for d in logged] == [
        (1, 1, None), (3, 2, None), (5, 2, "max_rollbacks=2 reached (pass a larger max_rollbacks to nanhunt.Guard)")]


# ------------------------------------------------------------------ changes of policy are recorded
def test_keep_fp32_permanently_before_or_after_the_rollback_is_recorded(tmp_path: Path) -> None:
    # GIVEN a loop whose batch 1 overflows the first Linear in float16 (on_fail="dump")
    model, opt, scaler = _net()
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail="dump")
    _amp_step(guard, model, opt, scaler, _batch(0))
    _amp_step(guard, model, opt, scaler, _batch(1, bad=True))
    # WHEN the user keeps that Linear in float32, then rolls back with a note
    undo = nanhunt.keep_fp32_permanently(model, ["0"])
    ev = guard.rollback(change="lr 1e-2 -> 5e-3")
    # THEN the rollback's event records both changes, as an experiment
    assert ev.changes == ("lr 1e-2 -> 5e-3", "float32 region added: 0 (nanhunt.keep_fp32_permanently)")
    assert "changes before resuming (an experiment): lr 1e-2 -> 5e-3; float32 region added: 0" in ev.describe()
    # WHEN the region is taken away again before the loop resumes
    undo()
    _amp_step(guard, model, opt, scaler, _batch(2))
    # GIVEN another overflow, rolled back first, then a float32 region, a note, and the loop resumes in bfloat16
    _amp_step(guard, model, opt, scaler, _batch(3, bad=True))
    assert guard.rollback().changes == ()
    nanhunt.keep_fp32_permanently(model, ["4"])
    guard.note_change("batch size 16 -> 8")
    _amp_step(guard, model, opt, scaler, _batch(4), dtype=torch.bfloat16)
    # THEN the changes made after a rollback are recorded when the loop resumes (steps 2 and 4)
    changes = [(e.step, e.changes) for e in guard.events if e.kind == "change"]
    assert changes == [(2, ("float32 region removed: 0",)),
                       (4, ("batch size 16 -> 8", "float32 region added: 4 (nanhunt.keep_fp32_permanently)")),
                       (4, ("autocast dtype float16 -> bfloat16",))]
    assert guard.events[-1].describe() == ("nanhunt.Guard: change of policy before step 4 (an experiment): "
                                           "autocast dtype float16 -> bfloat16")
    # AND the log holds the two rollbacks and the two changes, in order
    logged = [json.loads(line) for line in (tmp_path / "rollbacks.jsonl").read_text().splitlines()]
    assert [(d["step"], d["kind"]) for d in logged] == [(1, "rollback"), (2, "change"), (3, "rollback"),
                                                        (4, "change"), (4, "change")]


def test_rollback_is_refused_inside_a_step_and_on_fail_is_checked(tmp_path: Path) -> None:
    model, opt, scaler = _net()
    with pytest.raises(ValueError, match="max_rollbacks must be >= 0"):
        nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss, max_rollbacks=-1)
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss, on_fail="dump")
    with pytest.raises(RuntimeError, match="nothing to roll back"):
        guard.rollback()
    with guard.step(_batch(0)), pytest.raises(RuntimeError, match="after the `with guard.step"):
        guard.rollback()


# ------------------------------------------------------------------ Ctrl-C
def test_rollback_holds_sigint_at_every_line_it_runs(tmp_path: Path) -> None:
    # GIVEN a step that failed (NaN loss, on_fail="dump") after a clean one, made afresh for every interrupt, each
    # in a new dump directory (every run writes the same files: none is there before it)
    from tests.security.test_interrupts import _inject_everywhere, _Inject, _sigint, _traced

    runs = iter(range(10**6))

    def failed() -> tuple[nanhunt.Guard, nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, dict[str, Any]]:
        model, opt, scaler = _net()
        guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path / str(next(runs)), loss_fn=F.mse_loss,
                              on_fail="dump", max_captures=0)
        _amp_step(guard, model, opt, scaler, _batch(0))
        entry = _state(model, opt, scaler)
        _amp_step(guard, model, opt, scaler, _batch(1, bad=True))
        return guard, model, opt, scaler, entry

    outcomes = {"restored": 0, "not started": 0}

    def run(inject: _Inject) -> None:
        guard, model, opt, scaler, entry = failed()
        before = _state(model, opt, scaler)
        try:
            _traced(inject, guard.rollback)
        except KeyboardInterrupt:
            assert inject.fired
        else:
            assert not inject.fired
        # THEN the state is fully restored with the rollback counted and recorded, or (a Ctrl-C before the
        # restore began) fully as it was, the rollback still to do; never a mix
        now = _state(model, opt, scaler)
        if guard.rollbacks:
            _same(entry, now)
            assert (guard.skipped, [e.kind for e in guard.events]) == (0, ["loss", "rollback"])
            outcomes["restored"] += 1
        else:
            _same(before, now)
            assert (guard.skipped, [e.kind for e in guard.events]) == (1, ["loss"])
            outcomes["not started"] += 1
            guard.rollback()
            _same(entry, _state(model, opt, scaler))

    # WHEN Ctrl-C (a real SIGINT) arrives at each line nanhunt runs inside guard.rollback()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        points = _inject_everywhere({nanhunt.Guard.rollback.__code__}, _sigint, run, every_event=False)
    finally:
        signal.signal(signal.SIGINT, previous)
        torch.set_num_threads(threads)
    # (both outcomes happen: the checks before the restore, then the restore itself, which holds the signal)
    assert points > 100 and outcomes["restored"] > 50 and outcomes["not started"] > 0


# ------------------------------------------------------------------ frameworks own their loops
@pytest.mark.parametrize("framework", ["transformers", "lightning"])
def test_framework_callbacks_refuse_on_fail_rollback(tmp_path: Path, framework: str) -> None:
    # GIVEN a framework's callback asked to roll back (the framework, not the guard, runs the loop)
    pytest.importorskip(framework)
    callback = importlib.import_module(f"nanhunt.integrations.{framework}").NanhuntCallback
    # WHEN it is made, THEN it refuses in one line that says why and what to use
    with pytest.raises(ValueError, match=r"^on_fail='rollback' is not available in NanhuntCallback: the framework "
                                         r"owns the training loop.*use 'raise', 'dump' or 'warn'$"):
        callback(dump_dir=tmp_path, on_fail="rollback")


# ------------------------------------------------------------------ torch.distributed
def _mlp_amp_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, b: Batch) -> None:
    """tests._support.guard.train_step's numerics, unguarded."""
    x, y = b
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(opt)
    scaler.update()


def rollback_worker(rank: int, world: int, port: int, dump_dir: str, out_dir: str) -> None:
    """One gloo rank: only rank 1's batch 3 overflows; both roll back (on_fail="rollback") and go on."""
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from tests._support.guard import train_step

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        model, opt, scaler = mlp_setup()
        assert scaler is not None
        guard = guard_for(model, opt, scaler, dump_dir, on_fail="rollback")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                train_step(guard, model, opt, scaler, mlp_batch(i, big_input=rank == 1 and i == 3))
        result["warnings"] = [str(w.message) for w in caught]
        result["events"] = [(e.step, e.kind, e.ranks) for e in guard.events]
        result["counters"] = [guard.iterations, guard.updates, guard.skipped, guard.rollbacks]
        meet_again(result)
        guard.close()
        # the same rank's batches without step 3, unguarded and undistributed
        ref_model, ref_opt, ref_scaler = mlp_setup()
        assert ref_scaler is not None
        for i in (0, 1, 2, 4, 5):
            _mlp_amp_step(ref_model, ref_opt, ref_scaler, mlp_batch(i))
        want, got = _state(ref_model, ref_opt, ref_scaler), _state(model, opt, scaler)
        keys = ("params", "buffers", "optimizer", "scaler")
        _same({k: want[k] for k in keys}, {k: got[k] for k in keys})
        result["same_as_reference"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        finish_rank(out_dir, rank, result)


@pytest.mark.distributed
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_two_ranks_roll_back_together_and_go_on(tmp_path: Path) -> None:
    import multiprocessing as mp
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    dump, out = tmp_path / "caps", tmp_path / "out"
    out.mkdir()
    # GIVEN two gloo ranks with on_fail="rollback"; only rank 1's batch at step 3 overflows float16
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rollback_worker, args=(r, 2, port, str(dump), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    # WHEN they run, bounded by a timeout
    for p in procs:
        p.join(timeout=90)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"rank(s) {hung} still running after 90s"
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}
    for res in results.values():
        assert "error" not in res, res.get("error")
    # THEN both ranks rolled back step 3 with no extra collective, went on to the end and met again; each one's
    # weights, optimizer and scale equal, bit for bit, a run of its batches without step 3
    for r, res in results.items():
        assert res["events"] == [[3, "loss", [1]], [3, "rollback", [1]]]
        assert res["counters"] == [6, 5, 0, 1]
        assert len(res["warnings"]) == 1 and f"step 3 (rank {r}; seen first by rank(s) 1); rolled back" \
            in res["warnings"][0]
        assert res["after"] == 2.0 and res["same_as_reference"] is True
    # AND each rank logged its rollback in its own file
    assert sorted(f for f in os.listdir(dump) if f.endswith(".jsonl")) == ["rollbacks-rank0.jsonl",
                                                                           "rollbacks-rank1.jsonl"]
