"""The Guard's captures: accumulation, scale and buffers at step start, half models, and replaying them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.capture.capture import load_step
from nanhunt.cli import main as cli_main

from tests._support.guard import BIG_INPUT, D_IN, batch, guard_for, mlp_setup, train_step
from tests._support.models import DictModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# ------------------------------------------------------------------ models (importable by name for captures)


class DropMLP(nn.Module):
    def __init__(self, d_in: int = D_IN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.drop(self.fc1(x))))


class BNNet(nn.Module):
    def __init__(self, d_in: int = D_IN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _key(o: Any) -> tuple[Any, ...]:
    return (o.phase.value, o.module, o.op, o.kind)


def _replay(ev: nanhunt.GuardEvent) -> Any:
    s = load_step(str(ev.checkpoint), str(ev.batch))
    return nanhunt.replay(s.model, (s.inputs, s.targets), loss_fn=s.loss_fn, dtype=s.dtype, device_type=s.device_type,
                          scaler=s.scaler, optimizer=s.optimizer, rng=s.rng)


def _accumulating_step(guard: nanhunt.Guard, model: nn.Module, opt: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler, b: tuple[torch.Tensor, torch.Tensor], *, update: bool,
                       acc: int) -> None:
    """One micro-batch of a gradient-accumulation loop: check and update only every ``acc`` micro-batches."""
    x, y = b
    with guard.step(b):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = guard.loss(F.mse_loss(model(x), y) / acc)
        scaler.scale(loss).backward()
        if update:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            guard.check_grads()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


# ================================================================== Guard: what a capture holds


def test_gradient_accumulation_micro_batches_are_not_skips(tmp_path: Path) -> None:
    # GIVEN a clean AMP loop with gradient accumulation over 2 micro-batches, one guard.step per micro-batch
    # (the batch the capture would replay), check_grads before each real update, default skip policy
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path)
    b = batch(0)
    # WHEN it runs 55 updates (110 micro-batches); the scale never changes: GradScaler never skipped
    for i in range(110):
        _accumulating_step(guard, model, opt, scaler, b, update=i % 2 == 1, acc=2)
    # THEN nothing trips and nothing counts as skipped
    assert scaler.get_scale() == 1024.0
    assert guard.events == []
    assert (guard.iterations, guard.updates, guard.skipped) == (110, 55, 0)


def test_micro_batch_capture_holds_the_scale_in_use(tmp_path: Path) -> None:
    # GIVEN gradient accumulation with a GradScaler whose scale grows at every update (growth_interval=1)
    model, opt, _ = mlp_setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    guard = guard_for(model, opt, scaler, tmp_path)
    in_use = None
    # WHEN micro-batch 6 (no update of its own) overflows fc1 in float16
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(10):
            in_use = scaler.state_dict()
            _accumulating_step(guard, model, opt, scaler, batch(i, big_input=i == 6), update=i % 2 == 1, acc=2)
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (6, "loss", True)
    assert in_use is not None and in_use["scale"] == 8192.0  # 1024 doubled by the updates of steps 1, 3, 5
    # THEN the capture holds the GradScaler state the failing step ran with
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert ck["scaler"]["scale"] == in_use["scale"]
    assert ck["scaler"]["_growth_tracker"] == in_use["_growth_tracker"]


def test_snapshot_capture_holds_the_scale_its_step_began_with(tmp_path: Path) -> None:
    # GIVEN snapshot_every=1, check_grads every step, a sporadic skip at step 1 (scale 1024 -> 512), and weights
    # that step 3's update makes NaN (by hand, as a broken optimizer would)
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, snapshot_every=1, max_consecutive_skips=2)
    began: dict[int, dict[str, Any]] = {}
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(8):
            began[i] = scaler.state_dict()
            x, y = batch(i, big_target=i == 1)
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
    ev = info.value.event
    assert (ev.kind, ev.captured_step, ev.pre_update) == ("params", 3, True)
    assert began[3]["scale"] == 512.0
    # THEN the capture of the step-3 snapshot holds the GradScaler state step 3 began with
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert ck["scaler"]["scale"] == began[3]["scale"]
    assert ck["scaler"]["_growth_tracker"] == began[3]["_growth_tracker"]


def test_capture_holds_the_buffers_the_step_began_with(tmp_path: Path) -> None:
    # GIVEN an AMP loop over a model with BatchNorm whose step 3 overflows fc1 in float16
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path, loss_fn=F.mse_loss)
    began: dict[str, torch.Tensor] = {}
    live_first = None
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(5):
            x, y = batch(i, big_input=i == 3)
            began = _state(model)
            if i == 3:
                with nanhunt.trace(model) as t:  # what the live step finds (replay restores the model after)
                    with torch.autocast("cpu", dtype=torch.float16):
                        F.mse_loss(model(x), y)
                live_first = t.first
                model.load_state_dict(began)
            with guard.step((x, y)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss(F.mse_loss(model(x), y))
                scaler.scale(loss).backward()
                guard.check_grads()
                scaler.step(opt)
                scaler.update()
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (3, "loss", True)
    assert live_first is not None and _key(live_first) == ("forward", "fc1", "aten::addmm", "inf")
    # THEN the "pre-update capture" holds the state the step began with, buffers included
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    for k, v in began.items():
        assert torch.equal(ck["model"][k], v), k
    # AND replaying it finds the origin the live step had
    rep = _replay(ev)
    assert rep.first is not None and _key(rep.first) == _key(live_first)


def test_buffers_no_step_changes_are_not_copied_at_every_entry(tmp_path: Path) -> None:
    # GIVEN a model with BatchNorm and a large persistent mask buffer that no step changes
    torch.manual_seed(0)
    model = BNNet()
    model.register_buffer("mask", torch.ones(256, 256).triu(1))  # persistent: in the capture
    model.register_buffer("ema", torch.zeros(4))  # a statistic a hook keeps with in-place ops

    def keep_ema(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        with torch.no_grad():
            m.ema.mul_(0.9).add_(out.mean(0), alpha=0.1)

    model.register_forward_hook(keep_ema)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nanhunt.Guard(model, opt, dump_dir=tmp_path, loss_fn=F.mse_loss)
    for i in range(3):
        x, y = batch(i)
        with guard.step((x, y)):
            opt.zero_grad()
            loss = guard.loss(F.mse_loss(model(x), y))
            loss.backward()
            guard.check_grads()
            opt.step()
    # THEN after the first step only the buffers a step changes are copied at entry: BatchNorm's (its
    # kernel bumps no version counter) and the one the hook writes
    buffers = guard._capture.buffers
    names = {buffers.named[k][0] for k in buffers.copies}
    assert names == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "ema"}


def test_capture_of_a_half_model_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN pure float16 training (model.half(), no autocast, no scaler) whose step 2 overflows fc1
    model, _, _ = mlp_setup(scaler=False)
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = guard_for(model, opt, None, tmp_path)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(4):
            x, y = batch(i, big_input=i == 2)
            x, y = x.half(), y.half()
            if i == 2:
                with nanhunt.trace(model) as t:
                    F.mse_loss(model(x), y)
                assert t.first is not None and _key(t.first) == ("forward", "fc1", "aten::addmm", "inf")
            with guard.step((x, y)):
                opt.zero_grad()
                loss = guard.loss(F.mse_loss(model(x), y))
                loss.backward()
                guard.check_grads()
                opt.step()
    ev = info.value.event
    assert (ev.step, ev.kind) == (2, "loss")
    # WHEN `nanhunt replay` is run on what the guard wrote THEN it names the same op
    first = _replayed_first_line(ev, capsys)
    assert "fc1" in first and "aten::addmm" in first


def test_nonfinite_loss_then_an_exception_in_the_step_is_still_captured(tmp_path: Path) -> None:
    # GIVEN a loop that clips with error_if_nonfinite=True, on_fail="dump", and step 2 overflowing fc1
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="dump")
    with pytest.raises(RuntimeError, match="non-finite"):
        for i in range(4):
            x, y = batch(i, big_input=i == 2)
            with guard.step((x, y)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss(F.mse_loss(model(x), y))
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
                guard.check_grads()
                scaler.step(opt)
                scaler.update()
    # THEN the user's exception propagates, and the non-finite loss it had been handed is an event with a capture
    assert [(e.step, e.kind) for e in guard.events] == [(2, "loss")]
    assert guard.events[0].checkpoint is not None and Path(guard.events[0].checkpoint).exists()


def test_weights_poisoned_by_a_second_optimizer_are_reported_as_params(tmp_path: Path) -> None:
    # GIVEN bfloat16 training with two optimizers (fc1 and fc2 apart), the guard given the model and the first,
    # and step 3's update of the second writing Inf into fc2 (a broken schedule: lr 1e36)
    model, _, _ = mlp_setup(scaler=False)
    opt1 = torch.optim.SGD(model.fc1.parameters(), lr=1e-2)
    opt2 = torch.optim.SGD(model.fc2.parameters(), lr=1e-2)
    guard = guard_for(model, opt1, None, tmp_path)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(6):
            for g in opt2.param_groups:
                g["lr"] = 1e36 if i == 3 else 1e-2
            x, y = batch(i, big_target=i == 3)
            with guard.step((x, y)):
                opt1.zero_grad()
                opt2.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = guard.loss(F.mse_loss(model(x), y))
                loss.backward()
                guard.check_grads()
                opt1.step()
                opt2.step()
    # THEN step 4's non-finite loss is traced back to weights already non-finite when it began
    ev = info.value.event
    assert not torch.isfinite(model.fc2.weight).all()
    assert ev.step == 4
    assert ev.kind == "params" and "already non-finite" in ev.detail


# ================================================================== Guard: captures replayed from the CLI, dropout


def test_dict_model_with_scheduler_capture_replays_from_cli(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an HF-style model (keyword batch, labels inside, returns {"logits", "loss"}), AdamW + OneCycleLR
    # stepped only when the update really happened, float16 autocast and a GradScaler
    torch.manual_seed(0)
    model = DictModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = nanhunt.Guard(model, opt, scaler, dump_dir=tmp_path)  # loss_fn=None: the model returns its loss
    gen = torch.Generator().manual_seed(0)
    lrs: list[float] = []
    live = None
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(6):
            b = {"input_ids": torch.randn(4, 8, generator=gen), "labels": torch.randint(0, 3, (4,), generator=gen)}
            if i == 3:
                b["input_ids"] = torch.full((4, 8), BIG_INPUT)  # finite in float16; emb's sums are not
                rng = torch.get_rng_state()  # the guarded step below draws the same dropout mask
                with nanhunt.trace(model) as t:
                    with torch.autocast("cpu", dtype=torch.float16):
                        model(**b)
                live = t.first
                torch.set_rng_state(rng)
            with guard.step(b):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = guard.loss(model(**b)["loss"])
                scaler.scale(loss).backward()
                guard.check_grads()
                scaler.step(opt)
                scaler.update()
            if guard.stepped:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (3, "loss", True)
    assert len(set(lrs)) == 3  # the schedule moved at each of the three updates
    assert live is not None and live.phase.value == "forward" and live.op is not None
    ck = torch.load(str(ev.checkpoint), weights_only=True)
    assert ck["optimizer"]["param_groups"][0]["lr"] == lrs[-1]  # the rate the failing step would have used
    # WHEN `nanhunt replay` is run on the capture alone THEN it names the live origin
    capsys.readouterr()
    assert cli_main(["replay", str(ev.checkpoint), str(ev.batch), "--no-bisect"]) == 1
    first_line = capsys.readouterr().out.splitlines()[0]
    assert f"in {live.module} (" in first_line and f"at {live.op}" in first_line


def _dropout_loop(dump_dir: Path | None, steps: int, *, max_skips: int = 10,
                  losses: list[float] | None = None) -> tuple[Any, ...]:
    """An AMP loop over a model with dropout; guarded when ``dump_dir`` is given."""
    torch.manual_seed(0)
    model = DropMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = None
    if dump_dir is not None:
        guard = nanhunt.Guard(model, opt, scaler, dump_dir=dump_dir, loss_fn=F.mse_loss,
                              max_consecutive_skips=max_skips)
    torch.manual_seed(1)
    for i in range(steps):
        x, y = batch(i, big_target=i == 2)  # step 2: finite loss, float16 gradients overflow: GradScaler skips
        ctx = guard.step((x, y)) if guard is not None else _Null()
        with ctx:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            if losses is not None:
                losses.append(float(loss.detach()))
            if guard is not None:
                guard.loss(loss)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            if guard is not None:
                guard.check_grads()
            scaler.step(opt)
            scaler.update()
    return model, opt, scaler, guard


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_guard_leaves_training_bit_identical_and_capture_replays_the_dropout_step(tmp_path: Path) -> None:
    # GIVEN the same AMP loop (dropout, clipping, a GradScaler skip at step 2) with and without the guard
    plain_model, plain_opt, plain_scaler, _ = _dropout_loop(None, 6)
    plain_rng = torch.get_rng_state()
    model, opt, scaler, guard = _dropout_loop(tmp_path / "a", 6)
    # THEN weights, optimizer state, GradScaler state and the RNG are exactly those of the unguarded loop
    assert torch.equal(torch.get_rng_state(), plain_rng)
    for k, v in plain_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    a, b = plain_opt.state_dict(), opt.state_dict()
    for idx, st in a["state"].items():
        for name, v in st.items():
            assert torch.equal(b["state"][idx][name], v), (idx, name)
    assert scaler.state_dict() == plain_scaler.state_dict()
    assert (guard.iterations, guard.updates, guard.skipped) == (6, 5, 1) and guard.events == []
    # AND a guard told to stop at the first skip captures step 2 with the RNG of its dropout mask: the replay's
    # loss is the live loss, bit for bit
    losses: list[float] = []
    with pytest.raises(nanhunt.GuardError) as info:
        _dropout_loop(tmp_path / "b", 6, max_skips=1, losses=losses)
    ev = info.value.event
    assert (ev.step, ev.kind, ev.pre_update) == (2, "skips", True)
    torch.manual_seed(123)  # the replay must not depend on the RNG now
    rep = _replay(ev)
    assert rep.first is not None and rep.first.phase.value == "backward"
    assert rep.loss == losses[2]


# ================================================================== Guard: a model of torch.nn's own classes


def test_guard_on_a_sequential_captures_its_layers_and_the_replay_names_the_op(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN nn.Sequential of torch.nn layers (no factory, no model_kwargs: its class alone rebuilds an empty one)
    # whose step 2 takes inputs of 3e38, which the first Linear's sums (positive weights) overflow in float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.abs_()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nanhunt.Guard(model, opt, None, dump_dir=tmp_path, loss_fn=F.mse_loss)
    with pytest.raises(nanhunt.GuardError) as info:
        for i in range(4):
            x, y = batch(i)
            if i == 2:
                x = torch.full_like(x, 3e38)
            train_step(guard, model, opt, None, (x, y), dtype=torch.float32)
    ev = info.value.event
    assert (ev.step, ev.kind) == (2, "loss")
    # WHEN `nanhunt replay` is run on the capture alone, with no --model THEN it rebuilds the layers and names
    # the first Linear's addmm
    first = _replayed_first_line(ev, capsys)
    assert "in 0 (Linear" in first and "at aten::addmm" in first, first


def _replayed_first_line(ev: Any, capsys: pytest.CaptureFixture[str]) -> str:
    """The headline of ``nanhunt replay`` (no bisection) on the Guard event's capture, which must find a NaN/Inf."""
    capsys.readouterr()
    code = cli_main(["replay", str(ev.checkpoint), str(ev.batch), "--no-bisect"])
    out = capsys.readouterr()
    assert code == 1, out.err
    return out.out.splitlines()[0]
