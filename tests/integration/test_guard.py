"""nanhunt.Guard: the first bad step of a loop leaves a capture that replays to the same origin."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt.capture.capture import load_step
from nanhunt.cli import main as cli_main
from nanhunt.guard import _guard_flags

from tests._support.guard import batch, guard_for, mlp_setup, train_step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # Captures name fixtures.models:...; replay imports it from the working directory.
    monkeypatch.chdir(ROOT)


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d)) if d.exists() else []


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _replay_first(ck: str, bt: str) -> Any:
    step = load_step(ck, bt)
    rep = nanhunt.replay(step.model, (step.inputs, step.targets), loss_fn=step.loss_fn, dtype=step.dtype,
                         device_type=step.device_type, scaler=step.scaler, optimizer=step.optimizer, rng=step.rng)
    return rep


def _key(o: Any) -> tuple[Any, ...]:
    return (o.phase.value, o.module, o.op, o.kind)


# ------------------------------------------------------------------ the known bad step
def test_loop_dies_at_known_step_and_capture_replays_to_same_origin(tmp_path: Path) -> None:
    # GIVEN an AMP loop (float16, GradScaler, Adam) whose step 3 overflows fc1 in float16
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path)
    before: dict[str, Any] = {}
    live_first = None
    # WHEN it runs
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(6):
            b = batch(i, big_input=i == 3)
            if i == 3:
                before = {"model": _state(model), "opt": copy.deepcopy(opt.state_dict()), "scale": scaler.get_scale()}
                # the origin as the live step produces it (a trace of the very step the guard stops)
                with nanhunt.trace(model) as t:
                    with torch.autocast("cpu", dtype=torch.float16):
                        F.mse_loss(model(b[0]), b[1])
                live_first = t.first
            train_step(guard, model, opt, scaler, b)
    # THEN it stops at step 3 with a capture named after the step
    err = info.value
    assert isinstance(err, nanhunt.GuardError) and not isinstance(err, nanhunt.NonFiniteError)  # it names no origin
    ev = err.event
    assert (ev.step, ev.kind, ev.pre_update, ev.captured_step) == (3, "loss", True, 3)
    assert _files(tmp_path) == ["step000003-batch.pt", "step000003-checkpoint.pt", "step000003-event.json"]
    assert ev.checkpoint == str(tmp_path / "step000003-checkpoint.pt")
    assert "step 3" in str(err) and "nanhunt replay" in str(err)
    assert (guard.iterations, guard.updates, guard.skipped) == (4, 3, 0)
    # AND the capture holds the pre-update weights, optimizer state and scale
    ck = torch.load(ev.checkpoint, weights_only=True)
    for k, v in before["model"].items():
        assert torch.equal(ck["model"][k], v), k
    for idx, st in before["opt"]["state"].items():
        for name, v in st.items():
            assert torch.equal(ck["optimizer"]["state"][idx][name], v), (idx, name)
    assert ck["scaler"]["scale"] == before["scale"] == 1024.0
    assert ck["autocast"] == {"device_type": "cpu", "dtype": "float16"}
    # AND replaying it finds the origin the live step had
    assert live_first is not None and (live_first.phase.value, live_first.module) == ("forward", "fc1")
    rep = _replay_first(ev.checkpoint, str(ev.batch))
    assert rep.status == "nonfinite"
    assert _key(rep.first) == _key(live_first)


def test_transformer_loop_dies_at_known_step_and_cli_replay_names_culprit(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from fixtures.models import LMLoss, TinyTransformer

    # GIVEN the bundled transformer in an AMP loop; after step 2 something scales blocks.1.ff.wo to overflow
    # float16 (what a bad update does to T5's wo)
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss_fn = LMLoss()
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path / "caps", loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(0)
    stopped = None
    for i in range(6):
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        if i == 3:
            with torch.no_grad():
                model.blocks[1].ff.wo.weight.mul_(2e5)
        try:
            with guard.step((tokens, tokens)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss(loss_fn(model(tokens), tokens))
                scaler.scale(loss).backward()
                guard.check_grads()
                scaler.step(opt)
                scaler.update()
        except nanhunt.GuardError as e:
            stopped = e.event
            break
    # THEN the loop died at step 3, and `nanhunt replay` on what the guard wrote names the culprit
    assert stopped is not None and stopped.step == 3
    code = cli_main(["replay", str(stopped.checkpoint), str(stopped.batch), "--no-bisect"])
    out = capsys.readouterr().out
    assert code == 1
    assert "blocks.1.ff.wo" in out.splitlines()[0]


def test_exit_detection_without_check_grads_keeps_pre_update_scaler_state(tmp_path: Path) -> None:
    # GIVEN a loop that hands over the loss but never calls check_grads
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(5):
            if i == 2:
                before = _state(model)
            train_step(guard, model, opt, scaler, batch(i, big_input=i == 2), check_grads=False)
    # THEN the non-finite loss is caught when the step exits; update() already backed the scale off, but the
    # capture has the scale the step ran with, and the weights were never touched (the step was skipped)
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (2, "loss", True)
    assert guard.stepped is False
    assert scaler.get_scale() == 512.0
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert ck["scaler"]["scale"] == 1024.0
    assert all(torch.equal(ck["model"][k], v) for k, v in before.items())


# ------------------------------------------------------------------ GradScaler skips
def test_sporadic_single_skip_does_not_trigger_and_stepped_follows_it(tmp_path: Path) -> None:
    # GIVEN a loop where step 2's gradients overflow float16 (finite loss): GradScaler skips it
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path, max_consecutive_skips=2)
    stepped = []
    lr_steps = 0
    for i in range(6):
        train_step(guard, model, opt, scaler, batch(i, big_target=i == 2))
        stepped.append(guard.stepped)
        if guard.stepped:
            lr_steps += 1  # what `scheduler.step()` under `if guard.stepped:` would count
    # THEN nothing triggers, the skipped step is reported, and updates count only real updates
    assert stepped == [True, True, False, True, True, True]
    assert (guard.iterations, guard.updates, guard.skipped, lr_steps) == (6, 5, 1, 5)
    assert guard.events == [] and _files(tmp_path) == []
    assert guard.scale_history == [(0, 1024.0), (3, 512.0)]


def test_consecutive_skips_trigger_with_pre_update_capture(tmp_path: Path) -> None:
    # GIVEN max_consecutive_skips=3 and three steps in a row whose gradients overflow
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, max_consecutive_skips=3)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(8):
            if i == 4:
                before = _state(model)
            train_step(guard, model, opt, scaler, batch(i, big_target=i in (2, 3, 4)))
    # THEN the third skip trips, before its update(): the capture has that step's scale (1024 / 2 / 2)
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (4, "skips", True)
    assert "3 steps in a row" in ev.detail
    assert (guard.skipped, guard.updates) == (2, 2)  # the third never reached scaler.step()
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert ck["scaler"]["scale"] == 256.0
    assert all(torch.equal(ck["model"][k], v) for k, v in before.items())
    # AND the replay sees the same thing: finite forward and loss, gradients that overflow in backward
    rep = _replay_first(str(ev.checkpoint), str(ev.batch))
    assert rep.status == "nonfinite" and rep.first is not None
    assert rep.first.phase.value == "backward"
    assert rep.loss is not None and rep.loss == pytest.approx(F.mse_loss(torch.zeros(1), torch.full((1,), 1e5)).item(),
                                                             rel=1e-2)


def test_skip_rate_over_window_triggers(tmp_path: Path) -> None:
    # GIVEN every other step skipped, no consecutive limit, at most 40% of the last 6 steps
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path, max_consecutive_skips=None, skip_window=(6, 0.4))
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(10):
            train_step(guard, model, opt, scaler, batch(i, big_target=i % 2 == 1))
    # THEN the third skip (steps 1, 3, 5: 3 of 6 > 40%) trips
    ev = info.value.event
    assert (ev.step, ev.kind) == (5, "skips")
    assert "3 of the last 6" in ev.detail


# ------------------------------------------------------------------ no GradScaler
def test_nonfinite_grads_without_scaler_caught_before_the_update(tmp_path: Path) -> None:
    # GIVEN float32 training with no scaler, and a loop that never calls check_grads
    model, opt, _ = mlp_setup(scaler=False)
    guard = guard_for(model, opt, None, tmp_path)
    x, y = batch(2)
    x[0, 0] = float("nan")
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(4):
            b = (x, y) if i == 2 else batch(i)
            if i == 2:
                before = _state(model)
            train_step(guard, model, opt, None, b, dtype=torch.float32, check_grads=False, hand_loss=False)
    # THEN optimizer.step() itself is stopped (its pre-hook checks the gradients): the weights are untouched
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (2, "grads", True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert ck["autocast"]["dtype"] == "float32"  # the forward ran without autocast
    assert _replay_first(str(ev.checkpoint), str(ev.batch)).first.phase.value == "input"


def _lr_bomb_loop(guard: nanhunt.Guard, model: torch.nn.Module, opt: torch.optim.Optimizer, bad: int,
                  snapshots: dict[int, dict[str, torch.Tensor]]) -> nanhunt.GuardEvent:
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(6):
            for g in opt.param_groups:
                g["lr"] = 1e36 if i == bad else 1e-2  # a broken schedule: finite gradients, infinite update
            snapshots[i] = _state(model)
            train_step(guard, model, opt, None, batch(i, big_target=i == bad), dtype=torch.bfloat16)
    return info.value.event


@pytest.mark.parametrize("check_params", [True, False])
def test_poisoned_update_captured_from_the_rolling_snapshot(tmp_path: Path, check_params: bool) -> None:
    # GIVEN bfloat16 without a scaler, snapshot_every=1, and an update that writes Inf into the weights at step 3
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path, snapshot_every=1, check_params=check_params)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    state_obj, groups_obj = opt.state, opt.param_groups
    ev = _lr_bomb_loop(guard, model, opt, 3, seen)
    # THEN the guard notices at the end of step 3 (check_params=True) or when step 4's loss comes out
    # non-finite and the weights turn out to be so already (the default); either way the capture holds the
    # weights step 3 started from, before the update that wrote the Inf
    detected = 3 if check_params else 4
    assert (ev.step, ev.kind, ev.captured_step, ev.pre_update) == (detected, "params", 3, True)
    assert "start of step 3, before the update" in ev.describe() or check_params
    live_after = _state(model)
    # AND the detail says what was measured: which weights, how many non-finite values (not who wrote them)
    bad = [(k, int(v.isnan().sum()), int(v.isinf().sum()), v.numel()) for k, v in live_after.items()
           if not v.isfinite().all()]
    assert bad == [("fc1.weight", 0, 1456, 2048), ("fc1.bias", 0, 30, 32), ("fc2.weight", 0, 116, 128),
                   ("fc2.bias", 0, 4, 4)]
    assert check_params or ev.detail == ("non-finite loss; the weights were already non-finite when the step began: "
                                         "fc1.weight holds 1456 Inf (of 2048), and 3 other parameters hold "
                                         "NaN/Inf; nanhunt did not see what wrote them")
    assert not all(torch.isfinite(v).all() for v in live_after.values())
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert all(torch.equal(ck["model"][k], v) for k, v in seen[3].items())
    assert ck["optimizer"]["param_groups"][0]["lr"] == 1e36
    # AND writing it left the live model, optimizer state and groups as they were
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, live_after[k], rtol=0, atol=0, equal_nan=True)
    assert opt.state is state_obj and opt.param_groups is groups_obj
    assert opt.param_groups[0]["lr"] == (1e36 if check_params else 1e-2) and len(opt.state) == 4
    # AND replaying the capture finds the Inf born in the update
    rep = _replay_first(str(ev.checkpoint), str(ev.batch))
    assert rep.first is not None and rep.first.phase.value == "update"


def test_poisoned_update_with_sparse_snapshot_and_without(tmp_path: Path) -> None:
    # GIVEN snapshot_every=2: the last good copy is from the start of step 2 when step 3 poisons the weights
    # (the copy due at step 4 is not finite, so it is not kept)
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path / "a", snapshot_every=2)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    ev = _lr_bomb_loop(guard, model, opt, 3, seen)
    assert (ev.step, ev.kind, ev.captured_step, ev.pre_update) == (4, "params", 2, False)
    assert "start of step 2; re-run to step 4" in ev.describe()
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert all(torch.equal(ck["model"][k], v) for k, v in seen[2].items())
    # GIVEN no snapshot at all: the capture holds the poisoned weights and says so
    model, opt, _ = mlp_setup(scaler=False, optimizer="sgd")
    guard = guard_for(model, opt, None, tmp_path / "b")
    ev = _lr_bomb_loop(guard, model, opt, 3, {})
    assert (ev.kind, ev.pre_update) == ("params", False)
    assert "snapshot_every" in ev.describe()


def test_weights_poisoned_under_a_scaler_found_by_the_skip_policy(tmp_path: Path) -> None:
    # GIVEN an AMP loop that never hands over its loss, snapshot_every=1, and weights that become NaN in step 3's
    # update (written here by hand, as a broken optimizer would)
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, snapshot_every=1, max_consecutive_skips=2)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(8):
            seen[i] = _state(model)
            x, y = batch(i)
            with guard.step((x, y)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                guard.check_grads()
                scaler.step(opt)
                if i == 3:
                    with torch.no_grad():
                        model.fc2.weight[0, 0] = float("nan")
                scaler.update()
    # THEN steps 4 and 5 are skipped, the second skip trips, and the guard finds the cause: the weights were
    # already NaN when step 4 began; the capture is the last good snapshot, from before step 3's update
    ev = info.value.event
    assert (ev.step, ev.kind, ev.captured_step, ev.pre_update) == (5, "params", 3, True)
    assert "2 steps in a row" in ev.detail and "already non-finite" in ev.detail
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert all(torch.equal(ck["model"][k], v) for k, v in seen[3].items())


# ------------------------------------------------------------------ on_fail and cost
def test_on_fail_dump_and_warn_continue(tmp_path: Path) -> None:
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path / "dump", on_fail="dump")
    for i in range(5):
        train_step(guard, model, opt, scaler, batch(i, big_input=i in (1, 3)))
    # THEN both bad steps are events, only the first is written (max_captures=1), and the loop went on
    assert [(e.step, e.kind) for e in guard.events] == [(1, "loss"), (3, "loss")]
    assert guard.events[1].capture_error is not None
    assert _files(tmp_path / "dump") == ["step000001-batch.pt", "step000001-checkpoint.pt", "step000001-event.json"]
    assert (guard.iterations, guard.updates, guard.skipped) == (5, 3, 2)

    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path / "warn", on_fail="warn")
    with pytest.warns(nanhunt.guard.guard.GuardWarning, match="non-finite loss at step 0"):
        train_step(guard, model, opt, scaler, batch(0, big_input=True))
    assert guard.stepped is False


@pytest.mark.parametrize("check_params", [False, True])
def test_check_grads_reads_back_once_and_clean_loop_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   check_params: bool) -> None:
    # GIVEN a count of every host read a tensor offers
    reads = {"n": 0}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            reads["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # (as on a GPU, where each read waits for the device: on the CPU the Guard reads its scalars one by one)
    monkeypatch.setattr(_guard_flags, "free_read", lambda t: False)
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, check_params=check_params)
    for i in range(3):
        x, y = batch(i)
        with guard.step((x, y)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.loss(F.mse_loss(model(x), y))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            reads["n"] = 0
            guard.check_grads()
            # THEN check_grads reads back exactly once, whatever the number of parameters
            assert reads["n"] == 1
            scaler.step(opt)
            scaler.update()
            reads["n"] = 0
        # AND the end of the step reads nothing more, or once for the parameter check
        assert reads["n"] == int(check_params)
    assert guard.events == [] and _files(tmp_path) == []


# ------------------------------------------------------------------ misuse and cleanup
def test_misuse_fails_loudly_and_close_removes_hooks(tmp_path: Path) -> None:
    model, opt, scaler = mlp_setup()
    with pytest.raises(ValueError, match="not a lambda"):
        nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=lambda a, b: (a - b).sum())
    with pytest.raises(ValueError, match="on_fail"):
        nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, on_fail="ignore")  # type: ignore[arg-type]
    guard = guard_for(model, opt, scaler, tmp_path)
    with pytest.raises(RuntimeError, match="inside"):
        guard.check_grads()
    with pytest.raises(RuntimeError, match="nest"):
        with guard.step(batch(0)):
            with guard.step(batch(1)):
                pass
    assert guard.iterations == 1  # the outer step ended with the error
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(model._forward_pre_hooks) == 1
    guard.close()
    guard.close()
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    assert len(model._forward_pre_hooks) == 0
    with pytest.raises(RuntimeError, match="closed"):
        guard.step(batch(0))


def test_user_exception_in_step_propagates_without_checks(tmp_path: Path) -> None:
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path)
    with pytest.raises(KeyError):
        with guard.step(batch(0)):
            raise KeyError("user")
    assert (guard.iterations, guard.updates, guard.events) == (1, 0, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(guard, model, opt, scaler, batch(1))
    assert guard.stepped


def test_consecutive_skips_count_across_accumulation_micro_batches(tmp_path: Path) -> None:
    # GIVEN gradient accumulation over 2 micro-batches (check_grads and the update on every 2nd) and every
    # update overflowing in float16, max_consecutive_skips=3
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, max_consecutive_skips=3)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(20):
            x, y = batch(i, big_target=True)
            with guard.step((x, y)):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss(F.mse_loss(model(x), y) / 2)
                scaler.scale(loss).backward()
                if i % 2 == 1:
                    guard.check_grads()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
    # THEN the micro-batches in between neither count as skips nor break the run: the third update trips
    ev = info.value.event
    assert (ev.step, ev.kind, ev.skipped) == (5, "skips", 2)
    assert "3 steps in a row" in ev.detail


def test_nonfinite_loss_then_user_exception_keeps_the_user_exception(tmp_path: Path) -> None:
    # GIVEN on_fail="raise" and a step whose loss goes non-finite, then raises before check_grads
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path)
    x, y = batch(0, big_input=True)
    with pytest.raises(KeyError) as info:
        with guard.step((x, y)):
            with torch.autocast("cpu", dtype=torch.float16):
                guard.loss(F.mse_loss(model(x), y))
            raise KeyError("user")
    # THEN the user's exception propagates, naming the capture the guard wrote for the non-finite loss
    assert [(e.step, e.kind, e.pre_update) for e in guard.events] == [(0, "loss", True)]
    assert guard.events[0].checkpoint is not None and os.path.exists(guard.events[0].checkpoint)
    if hasattr(info.value, "add_note"):  # Python 3.11+
        assert any("nanhunt replay" in n for n in getattr(info.value, "__notes__", []))
