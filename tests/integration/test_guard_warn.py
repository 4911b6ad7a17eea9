"""nanhunt.Guard before the NaN: the headroom history warns, with a forecast, while the run can still be saved."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.capture.capture import load_step
from nanhunt.guard import _guard_flags, _headroom
from nanhunt.guard._headroom import AUTO_EVERY, AUTO_MAX, HISTORY, READ_STEPS, Headroom
from nanhunt.guard.guard import HeadroomWarning
from nanhunt.records import GuardEvent

from tests._support.guard import batch, guard_for, mlp_setup

ROOT = Path(__file__).resolve().parents[2]
GROWTH = 1.03  # fc1's weight grows 3% a step: its float16 output overflows at step 351 (seed 0)
FIRST_INF = 351


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # captures name fixtures.models:MLP


def _growing_run(guard: nanhunt.Guard, model: Any, opt: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, steps: int = 400) -> int | None:
    """An AMP loop whose fc1 weight the loop scales up a little each step (standing in for a learning rate set
    too high); the step of the first detection, or None."""
    for i in range(steps):
        x, y = batch(i % 16)
        with guard.step((x, y)):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.loss(F.mse_loss(model(x), y))
            assert scaler is not None
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            guard.check_grads(grad_norm=norm)
            scaler.step(opt)
            scaler.update()
        with torch.no_grad():
            model.fc1.weight.mul_(GROWTH)
        if any(e.kind != "warning" for e in guard.events):
            return i
    return None


def test_growing_module_warns_before_the_overflow_naming_it_with_a_forecast(tmp_path: Path) -> None:
    # GIVEN a float16 loop with a GradScaler whose fc1 output grows 3% a step (lr 0: only the loop changes it)
    model, opt, scaler = mlp_setup(lr=0.0)
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="dump", headroom_every=16)
    # WHEN it runs to the first non-finite value
    with pytest.warns(HeadroomWarning) as record:
        bad = _growing_run(guard, model, opt, scaler)
    assert bad == FIRST_INF and guard.events[-1].kind == "loss"
    # THEN the first module warning names fc1's output, well before the NaN, with the forecast within 5%
    outputs = [e for e in guard.events if e.kind == "warning" and e.condition == "output"]
    first = outputs[0]
    assert first.module == "fc1"
    assert first.step <= FIRST_INF - 100
    assert first.forecast_step is not None and abs(first.forecast_step - FIRST_INF) <= 0.05 * FIRST_INF
    assert first.limit == 65504.0 and first.measured is not None and first.measured < 65504.0
    assert re.fullmatch(r"fc1 output: max [\d.,]+ \(headroom [\d.,]+x to float16\), growing [\d.]+x per 100 "
                        r"steps: overflow expected near step \d+; usual fixes: a lower learning rate .*"
                        r"nanhunt\.keep_fp32\)", first.detail)
    # AND it went to the log once per module and condition, and to the event file
    texts = [str(w.message) for w in record if issubclass(w.category, HeadroomWarning)]
    assert texts.count(first.describe()) == 1
    assert len({(e.condition, e.module) for e in guard.events if e.kind == "warning"}) == len(texts)
    log = (tmp_path / "rollbacks.jsonl").read_text().splitlines()
    assert any(f'"module": "fc1"' in line and '"kind": "warning"' in line for line in log)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16-scaler", "bfloat16"])
def test_healthy_run_warns_zero_times(tmp_path: Path, dtype: torch.dtype) -> None:
    # GIVEN an ordinary AMP loop (float16 with a GradScaler, or bfloat16), sampled every 4 steps
    model, opt, scaler = mlp_setup(lr=1e-3, scaler=dtype == torch.float16)
    guard = guard_for(model, opt, scaler, tmp_path, headroom_every=4)
    # WHEN it trains for 300 steps
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeadroomWarning)
        for i in range(300):
            x, y = batch(i % 64)
            with guard.step((x, y)):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=dtype):
                    loss = guard.loss(F.mse_loss(model(x), y))
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                else:
                    loss.backward()
                guard.check_grads(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
    # THEN nothing was said, and the history was kept (the modules were watched)
    assert guard.events == []
    assert len(guard._watch.history[("output", guard._watch.names.index("fc1"))]) > 6


def test_unsampled_steps_add_no_host_read_and_no_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a count of every host read a tensor offers, paused while the loop's own code reads
    reads = {"n": 0, "on": 1}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            reads["n"] += reads["on"]
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # (as on a GPU, where each read waits for the device: on the CPU the Guard reads its scalars one by one)
    monkeypatch.setattr(_guard_flags, "free_read", lambda t: False)
    model, opt, scaler = mlp_setup()
    assert scaler is not None
    guard = guard_for(model, opt, scaler, tmp_path, headroom_every=16)
    per_step: list[int] = []
    hooked: list[bool] = []
    for i in range(READ_STEPS + 2):
        x, y = batch(i)
        reads["n"] = 0
        with guard.step((x, y)):
            opt.zero_grad()
            hooked.append(bool(model.fc1._forward_hooks))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.loss(F.mse_loss(model(x), y))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            reads["on"] = 0
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            reads["on"] = 1
            guard.check_grads(grad_norm=norm)
            reads["on"] = 0
            scaler.step(opt)  # GradScaler's own read
            scaler.update()
            reads["on"] = 1
        per_step.append(reads["n"])
    # THEN only the sampled steps (one in 16) hook the modules, and the hooks are gone after
    assert hooked == [i % 16 == 0 for i in range(len(hooked))]
    assert not model.fc1._forward_hooks
    # AND every step reads back once (check_grads' read, which now carries the loss and the norm), except the
    # step that fills the buffer (READ_STEPS / 16 samples): one read more, for the window
    full = READ_STEPS - 16
    assert per_step == [2 if i == full else 1 for i in range(len(per_step))]
    assert guard.events == []


class _Shared(nn.Module):
    """One Linear called twice, an in-place ReLU on its first output, and a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self.act(self.lin(x))
        b = self.lin(x * 3.0)
        return {"a": a, "b": b}


def test_module_called_twice_dict_output_and_inplace_ops_keep_the_max_over_calls() -> None:
    # GIVEN a model with a module called twice, an in-place op on its output and a dict output, every step sampled
    torch.manual_seed(0)
    model = _Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = Headroom(model, opt, every=1, horizon=1000, device_type="cpu")
    lin, root = watch.names.index("lin"), watch.names.index("(model)")
    x = torch.randn(2, 4)
    expected_lin = expected_root = 0.0
    for step in range(watch.rows):
        watch.begin(step)
        out = model(x)
        # the reference: the same forward by hand
        with torch.no_grad():
            first, second = model.lin(x), model.lin(x * 3.0)
            expected_lin = max(first.abs().max().item(), second.abs().max().item())
            expected_root = max(first.relu().abs().max().item(), second.abs().max().item())
        (out["a"].sum() + out["b"].sum()).backward()
        found = watch.end(step, None)
    # THEN the window's read holds the max over both calls, over every tensor of the dict, and the gradients
    assert found == []
    assert 2.0 ** watch.history[("output", lin)][-1][1] == pytest.approx(expected_lin, rel=1e-6)
    assert 2.0 ** watch.history[("output", root)][-1][1] == pytest.approx(expected_root, rel=1e-6)
    assert 2.0 ** watch.history[("output gradient", root)][-1][1] == 1.0  # d(sum)/d(out) is 1
    assert len(watch.history[("output", lin)]) == HISTORY  # the last samples kept
    assert not model.lin._forward_hooks


@pytest.mark.parametrize(("sampled_cost", "stride"), [(1.25, 25), (1.1, 16), (9.0, 800)],
                         ids=["a-quarter-more", "cheap", "costly"])
def test_auto_stride_spreads_the_sampled_steps_extra_time_to_one_percent(
        monkeypatch: pytest.MonkeyPatch, sampled_cost: float, stride: int) -> None:
    # GIVEN headroom_every="auto" and a clock on which an unsampled step takes 1 s and a sampled one sampled_cost
    now = [0.0]
    monkeypatch.setattr(_headroom, "_clock", lambda: now[0])
    model = nn.Linear(2, 2)
    watch = Headroom(model, torch.optim.SGD(model.parameters(), lr=0.0), every="auto", horizon=1000,
                     device_type="cpu")
    sampled = []
    for step in range(200):
        watch.begin(step)
        hooked = bool(model._forward_hooks)
        model(torch.ones(1, 2)).sum().backward()
        now[0] += sampled_cost if hooked else 1.0
        watch.end(step, None)
        sampled += [step] if hooked else []
    # THEN it starts one in AUTO_EVERY; from the second sample on (the first that follows unsampled steps) the
    # stride spreads the extra time to 1% of a step: (cost - 1) / 0.01 steps, kept within AUTO_EVERY..AUTO_MAX
    want = min(AUTO_MAX, max(AUTO_EVERY, stride))
    assert sampled[:3] == [0, AUTO_EVERY, 2 * AUTO_EVERY]
    assert sampled[3:] == list(range(2 * AUTO_EVERY + want, 200, want))
    assert watch.every == want


class Holder(nn.Module):
    """Holds the model it is given, as DDP holds it in ``module``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_a_model_compiled_out_of_sight_gets_no_headroom_hooks(tmp_path: Path) -> None:
    # GIVEN a Guard on a wrapper holding a compiled model (as DDP's module holds it), and a Guard on the plain
    # model that is told afterwards it is compiled (a Trainer's torch_compile)
    model, opt, scaler = mlp_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanhunt.GuardWarning)  # Holder takes a module: its replay needs --model
        held = nanhunt.Guard(Holder(torch.compile(model, backend="aot_eager")), opt, scaler, dump_dir=tmp_path,
                             loss_fn=F.mse_loss)
    told = guard_for(model, opt, scaler, tmp_path)
    assert told._watch.every == AUTO_EVERY
    told._compiled_as({"backend": "aot_eager", "mode": None, "options": {}, "dynamic": None})
    # THEN neither samples any step, and the second records the backend for its captures
    for guard in (held, told):
        assert guard._watch.every is None and not any(guard._watch.sampled(i) for i in range(64))
    assert told._capture.compiled == {"backend": "aot_eager", "mode": None, "options": {}, "dynamic": None}


def test_weights_near_the_float16_limit_warn_at_the_window_read() -> None:
    # GIVEN a float16 weight of 8,000 (8.2x from float16's 65504)
    model = nn.Linear(2, 2).half()
    with torch.no_grad():
        model.weight.fill_(0.0)
        model.weight[0, 0] = 8000.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = Headroom(model, opt, every=1, horizon=1000, device_type="cpu")
    found = []
    for step in range(watch.rows):
        watch.begin(step)
        model(torch.zeros(1, 2, dtype=torch.float16)).float().sum().backward()
        found += watch.end(step, None)
    # THEN one warning, at the window's read, naming the weight and the usual fix
    assert [(f.condition, f.module) for f in found] == [("weights", "weight")]
    assert found[0].detail == ("weight: max |x| 8,000 (headroom 8.19x to float16); usual fixes: weight decay or a "
                               "lower learning rate; keep the parameters and the optimizer state in float32 "
                               "(autocast for the forward only)")


def test_states_of_mixed_dtypes_are_read_together_and_a_replaced_weight_keeps_its_name() -> None:
    # GIVEN float32 and float16 layers interleaved, Adam's moments, and the float16 weight near its limit replaced
    # (a new Parameter, as sharding or to_empty make) after the history began
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).half(), nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    watch = Headroom(model, opt, every=1, horizon=1000, device_type="cpu")
    big = torch.zeros(2, 2, dtype=torch.float16)
    big[1, 0] = 9000.0
    model[1].weight = nn.Parameter(big)
    opt.param_groups[0]["params"][2] = model[1].weight
    found = []
    for step in range(watch.rows):
        watch.begin(step)
        opt.zero_grad()
        x = model[0](torch.ones(1, 2))
        model[2](model[1](x.half()).float()).sum().backward()
        opt.step()
        found += watch.end(step, None)
    # THEN exactly that weight is warned, by its name, with its value: the float16 group's maxima were not
    # mixed up with the float32 ones read beside them
    assert [(f.condition, f.module, f.value) for f in found] == [("weights", "1.weight", 9000.0)]


def test_a_bfloat16_output_is_judged_where_its_square_overflows() -> None:
    # GIVEN a bfloat16 output growing 5% a step from 2e15: far from bfloat16's 3.4e38, near 1.84e19, where its
    # square (a norm's variance, GELU's x ** 3 and its backward's 3 x ** 2) overflows bfloat16 and float32
    model = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(2e15)
    watch = Headroom(model, torch.optim.SGD(model.parameters(), lr=0.0), every=1, horizon=1000, device_type="cpu")
    found = []
    for step in range(watch.rows):
        watch.begin(step)
        model(torch.ones(1, 1, dtype=torch.bfloat16)).float().sum().backward()
        found += watch.end(step, None)
        with torch.no_grad():
            model.weight.mul_(1.05)
    # THEN its output is warned, against that square root, and says so
    [f] = [f for f in found if f.condition == "output"]
    root = math.sqrt(torch.finfo(torch.bfloat16).max)
    assert f.module == "(model)" and f.limit == root
    assert "x to 1.84e+19, where its square overflows bfloat16), growing" in f.detail
    assert f.detail.endswith("a norm on the growing activation; float32 has the same range, so keeping the module "
                             "in it does not help")
    assert f.forecast_step is not None and 150 < f.forecast_step < 250


def test_scale_falling_steadily_and_loss_spikes_warn_once() -> None:
    watch = Headroom(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), every=None,
                     horizon=1000, device_type="cpu")
    found = []
    # GIVEN a scale that finds its level in 8 consecutive backoffs, holds until step 400 but for two lone
    # backoffs and a growth, then halves every 20 steps; a loss near 1 with one spike at 450
    for i in range(600):
        scale = 2.0 ** (24 - min(i, 8) - (i >= 250) - (i >= 300) + (i >= 350)) / 2 ** max(0, (i - 400) // 20)
        loss = 30.0 if i == 450 else 1.0 + 0.01 * math.sin(i)
        found += watch.observe(i, loss=loss, grad_norm=1.0, scale=scale)
    # THEN the spike is warned at its step, the fall once it reaches 16x within 200 steps; each once
    assert [(f.condition, f.value) for f in found] == [("loss", 30.0), ("scale", 2048.0)]
    assert found[0].detail.startswith("loss spike: 30 against a median of 1 over the last 100 steps (robust z-score ")
    assert found[1].detail.startswith("GradScaler's scale fell 16x in the last 200 steps (32,768 -> 2,048), "
                                      "backing off 4 times more than it grew, each after steps that did not ")


def test_on_warn_capture_writes_the_warned_step_and_leaves_max_captures_to_the_failure(tmp_path: Path) -> None:
    model, opt, scaler = mlp_setup(lr=0.0)
    guard = guard_for(model, opt, scaler, tmp_path, on_fail="dump", on_warn="capture", headroom_every=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadroomWarning)
        bad = _growing_run(guard, model, opt, scaler)
    warned = [e for e in guard.events if e.kind == "warning"]
    # THEN the first warning holds a capture of its own (finite) step, before its update
    first = warned[0]
    assert first.checkpoint == str(tmp_path / f"step{first.step:06d}-checkpoint.pt")
    assert first.captured_step == first.step and first.pre_update
    assert all(e.checkpoint is None for e in warned[1:])
    step = load_step(first.checkpoint, first.batch)
    assert torch.equal(step.inputs, batch(first.step % 16)[0])
    # AND the overflow that followed still has its capture (max_captures=1), each counted as what it is
    assert bad == FIRST_INF and guard.events[-1].checkpoint is not None
    assert (guard.captures, guard.warning_captures) == (1, 1)


def test_on_warn_stop_raises_at_the_first_warning(tmp_path: Path) -> None:
    model, opt, scaler = mlp_setup(lr=0.0)
    guard = guard_for(model, opt, scaler, tmp_path, on_warn="stop", headroom_every=8)
    with pytest.raises(nanhunt.GuardError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadroomWarning)
        _growing_run(guard, model, opt, scaler)
    event = info.value.event
    assert event.kind == "warning" and event.step < FIRST_INF
    assert str(info.value).startswith(f"nanhunt.Guard: warning at step {event.step}: ")


def test_warning_event_round_trips_and_options_are_checked(tmp_path: Path) -> None:
    event = GuardEvent(step=120, kind="warning", detail="fc1 output: max 82.7", condition="output", module="fc1",
                       measured=82.7, limit=65504.0, forecast_step=344)
    assert GuardEvent.from_dict(event.to_dict()) == event
    assert event.describe() == "nanhunt.Guard: warning at step 120: fc1 output: max 82.7"
    model, opt, scaler = mlp_setup()
    with pytest.raises(ValueError, match="on_warn must be 'log', 'capture' or 'stop', not 'loud'"):
        guard_for(model, opt, scaler, tmp_path, on_warn="loud")
    with pytest.raises(ValueError, match="headroom_every must be 'auto', an int >= 1 or None, not 0"):
        guard_for(model, opt, scaler, tmp_path, headroom_every=0)


def test_callbacks_take_the_warning_options(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("lightning.pytorch")
    from nanhunt.integrations.lightning import NanhuntCallback as LightningCallback
    from nanhunt.integrations.transformers import NanhuntCallback as TrainerCallback

    options = {"on_warn": "capture", "headroom_every": 4, "warn_horizon": 500}
    for make in (TrainerCallback, LightningCallback):
        assert make(dump_dir=tmp_path, **options).guard_options == options


@pytest.mark.parametrize("scale", [None, 1.0], ids=["no-scaler", "gradscaler"])
def test_growing_gradients_are_warned_only_without_a_gradscaler(scale: float | None) -> None:
    # GIVEN a float16 layer whose output gradient grows 5% a step, every step sampled
    model = nn.Linear(2, 2).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = Headroom(model, opt, every=1, horizon=1000, device_type="cpu")
    found = []
    for step in range(watch.rows):
        watch.begin(step)
        out = model(torch.ones(1, 2, dtype=torch.float16))
        out.backward(torch.full_like(out, 100.0 * 1.05 ** step))
        found += watch.end(step, scale)
    # THEN without a GradScaler the gradient's trend is warned; with one (the scale keeps it in range) it is not
    grads = [f for f in found if f.condition == "output gradient"]
    if scale is None:
        assert [f.module for f in grads] == ["(model)"]
        assert grads[0].detail.startswith("(model) output gradient: max 2,160 (headroom 30.3x to float16), growing "
                                          "132x per 100 steps: overflow expected near step 132; usual fixes: ")
    else:
        assert grads == []


def test_the_reports_name_a_square_root_limit_as_the_warning_does() -> None:
    from nanhunt.report._common import limit_name

    root = math.sqrt(torch.finfo(torch.bfloat16).max)
    assert limit_name(65504.0) == "float16"
    assert limit_name(root) == "1.84e+19, where its square overflows bfloat16"
