"""The phase of the origin: forward, loss, backward, update, across closures, micro-batches, GANs and EMA."""

from __future__ import annotations

import inspect
import math
from types import TracebackType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanhunt
from nanhunt import Phase

from tests._support.models import FcHead as MLP, where


pytestmark = pytest.mark.usefixtures("warm_tracer")


# ====================================================================== phases: update vs loss vs forward


def test_lbfgs_closure_loss_is_phase_loss() -> None:
    # GIVEN LBFGS, whose step() runs the closure (forward, loss, backward); the loss takes log of a
    # softmax probability that underflowed to exactly 0 (logits 1000, 0, -1000)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    with torch.no_grad():
        m[0].weight.zero_()
        m[0].bias.copy_(torch.tensor([1000.0, -1000.0, 0.0]))
    opt = torch.optim.LBFGS(m.parameters(), max_iter=1)
    x = torch.randn(2, 4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = -m(x).log()[:, 1].mean()  # NLL of class 1, whose probability is exp(-2000) == 0
        loss.backward()
        return loss

    with nanhunt.trace(m) as t:
        first_loss = opt.step(closure)
    assert math.isinf(float(first_loss.detach()))
    # THEN log(0) is born in the loss (as without the optimizer), not in the update
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


def test_clean_lbfgs_step_has_no_origin() -> None:
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.LBFGS(m.parameters(), max_iter=3)
    x, y = torch.randn(4, 4), torch.zeros(4, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        return loss

    with nanhunt.trace(m) as t:
        opt.step(closure)
    assert t.first is None


def _ema_setup() -> tuple[MLP, torch.optim.Optimizer, list[torch.Tensor]]:
    """The MLP with head.bias 2e5, its SGD, and a float16 EMA of its weights (zeros)."""
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.head.bias.fill_(2e5)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    return m, opt, [torch.zeros_like(p, dtype=torch.float16) for p in m.parameters()]


def test_ema_update_outside_optimizer_step_is_phase_update() -> None:
    # GIVEN an EMA copy of the weights kept in float16, updated after opt.step() with
    # `ema.mul_(d).add_(p, alpha=1 - d)` (no torch.no_grad: p is not detached); head.bias is 2e5
    m, opt, ema = _ema_setup()
    with nanhunt.trace(m) as t:
        m(torch.randn(2, 4)).mean().backward()
        opt.step()
        opt.zero_grad()
        for e, p in zip(ema, m.parameters()):
            e.mul_(0.5).add_(p, alpha=0.5)  # 0.5 * 2e5 = 1e5 > 65504: inf in float16
    assert torch.isinf(ema[-1]).all() and all(torch.isfinite(p).all() for p in m.parameters())
    # THEN the weight average is the update phase; no loss is computed there
    assert where(t.first) == (Phase.UPDATE, None, "aten::add_", 0, "inf")


def test_update_of_an_optimised_model_input_stays_phase_update() -> None:
    # GIVEN deep-image-prior style training: the optimizer updates the network *and* its input z
    # (OPT_OVER='net,input'); z's learning rate overflows its first update
    torch.manual_seed(0)
    m = MLP()
    z = (torch.rand(2, 4) * 0.1).requires_grad_()
    opt = torch.optim.SGD([{"params": m.parameters()}, {"params": [z], "lr": 1e38}], lr=1e-3, foreach=False)
    # by hand: z's gradient after step 1 is not tiny, so z - 1e38 * grad overflows; the net's update is finite
    zc = z.detach().clone().requires_grad_()
    m2 = MLP()
    m2.load_state_dict(m.state_dict())
    ((m2(zc) - 1.0).pow(2).mean() * 1e3).backward()
    assert torch.isinf(zc.detach() - 1e38 * zc.grad).any()
    assert all(torch.isfinite(p - 1e-3 * p.grad).all() for p in m2.parameters())
    with nanhunt.trace(m) as t:
        for _ in range(2):
            opt.zero_grad()
            loss = (m(z) - 1.0).pow(2).mean() * 1e3
            loss.backward()
            opt.step()
    # THEN the first non-finite value is SGD's param.add_(grad, alpha=-lr) on z in step 1: an update
    assert where(t.first) == (Phase.UPDATE, None, "aten::add_", 0, "inf")


def test_next_micro_batch_preprocessing_is_forward_after_a_logging_op() -> None:
    # GIVEN gradient accumulation with per-micro-batch standardisation (micro-batch 2 constant: 0/0) and
    # the common logging line `total = total + loss` (no .item(): an autograd node after backward)
    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as t:
        total: Any = 0.0
        for x in (torch.randn(2, 4), torch.zeros(2, 4)):
            x = (x - x.mean()) / x.std()
            loss = m(x).sum() / 2
            loss.backward()
            total = total + loss
    # THEN as without the logging line: glue before the model, forward, no module
    assert where(t.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")


@pytest.mark.parametrize("case", ["after-backward", "between-calls"])
def test_stop_at_first_names_the_same_phase_as_the_full_trace(case: str) -> None:
    # GIVEN the preprocessing of a second micro-batch that divides 0/0 (after a backward, or between two
    # model calls of one step) WHEN traced with stop_at_first=True (a debugger lands in the op)
    torch.manual_seed(0)
    m = MLP()
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True) as t:
        if case == "after-backward":
            m(torch.randn(2, 4)).sum().backward()
            loss = None
        else:
            loss = m(torch.randn(2, 4)).sum()
        x2 = torch.zeros(2, 4)
        x2 = (x2 - x2.mean()) / x2.std()
        out = m(x2).sum()
        (out if loss is None else loss + out).backward()
    # THEN the same answer as without stop_at_first (tests/integration/test_trace_phases.py): forward glue
    assert where(t.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")
    assert t.first is info.value.occurrence  # the stop's own answer, not the trace's at its end


def _glue_then_eval_call(m: nn.Module) -> None:
    m(torch.randn(2, 4)).sum().backward()
    x2 = torch.zeros(2, 4)
    x2 = (x2 - x2.mean()) / x2.std()
    with torch.no_grad():
        m(torch.randn(2, 4))  # an evaluation call that does not take x2
    m(x2).sum().backward()


def _glue_before_the_backward(m: nn.Module) -> None:
    loss = m(torch.randn(2, 4)).sum()
    x2 = torch.zeros(2, 4)
    x2 = (x2 - x2.mean()) / x2.std()  # the next micro-batch, prepared before this one's backward
    loss.backward()
    m(x2).sum().backward()


@pytest.mark.parametrize("step", [_glue_then_eval_call, _glue_before_the_backward], ids=["eval-call", "backward"])
def test_a_held_stop_waits_past_calls_and_backwards_that_do_not_take_its_value(step: Any) -> None:
    # GIVEN a 0/0 in the next micro-batch's preprocessing, then a no_grad evaluation call, or this micro-batch's
    # backward (which does not run through x2: it has no graph), before the call that takes it
    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as full:
        step(m)
    torch.manual_seed(0)
    m = MLP()
    # WHEN traced with stop_at_first
    with pytest.raises(nanhunt.NonFiniteError), nanhunt.trace(m, stop_at_first=True) as t:
        step(m)
    # THEN the call that takes x2 settles it: forward glue, as the full trace says
    assert where(t.first) == where(full.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")


def _line(marker: str, func: Any) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, text in enumerate(lines) if f"# {marker}" in text)


def _last_frame(tb: TracebackType | None) -> tuple[str, int]:
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno


def _hooked(m: nn.Module) -> int:
    return sum(len(mm._forward_hooks) + len(mm._forward_pre_hooks) for mm in m.modules())


def test_a_stop_held_for_its_phase_lands_on_the_next_model_call_with_the_ops_tensors() -> None:
    # GIVEN the 0/0 of the second micro-batch's standardisation, between two model calls
    torch.manual_seed(0)
    m = MLP()
    name = "test_a_stop_held_for_its_phase_lands_on_the_next_model_call_with_the_ops_tensors"
    nanhunt.last = None
    # WHEN traced with stop_at_first
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True):
        loss = m(torch.randn(2, 4)).sum()
        x2 = torch.zeros(2, 4)
        x2 = (x2 - x2.mean()) / x2.std()  # DIV
        loss = loss + m(x2).sum()  # CALL
    e = info.value
    here = globals()[name]
    div = f"{__file__}:{_line('DIV', here)} in {name}"
    call = f"{__file__}:{_line('CALL', here)} in {name}"
    # THEN it is raised when the next call shows the division was its preprocessing (forward glue), and the
    # post-mortem starts on that call's line, the user's, with the division's line and tensors in nanhunt.last
    assert _last_frame(info.tb) == (__file__, _line("CALL", here))
    assert nanhunt.last is e.stop and e.stop is not None
    assert (e.stop.source, e.stop.landing, e.op, e.record.phase) == (div, call, "aten::div", Phase.FORWARD)
    assert [t_.tolist() for t_ in e.inputs] == [[[0.0] * 4] * 2, 0.0]  # x2 - mean, std
    assert len(e.outputs) == 1 and e.outputs[0].isnan().sum().item() == 8
    assert e.occurrence.output.full is not None and e.occurrence.output.full.nan == 8  # measured in the op
    assert str(e) == (f"NaN born in phase forward, outside the model, op aten::div at {div}; post-mortem "
                      f"(python -m pdb, %debug) lands on {call}: `import nanhunt`, then "
                      "`p nanhunt.last.inputs[0].abs().max()`, `p nanhunt.last.output`, `p nanhunt.last.record`")
    assert _hooked(m) == 0 and _get_current_dispatch_mode() is None


def test_a_loss_stop_is_raised_when_its_backward_begins() -> None:
    # GIVEN log(0) in the loss, computed outside the model (the next model call could still have taken it)
    torch.manual_seed(0)
    m = MLP()
    name = "test_a_loss_stop_is_raised_when_its_backward_begins"
    # WHEN traced with stop_at_first
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True) as t:
        loss = -torch.log(m(torch.randn(2, 4)) * 0).mean()  # LOG
        loss.backward()  # BWD
    here = globals()[name]
    # THEN the backward settles it: loss, as the full trace says; raised before any gradient is made
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")
    assert _last_frame(info.tb) == (__file__, _line("BWD", here))
    e = info.value
    assert e.stop is not None and e.stop.source == f"{__file__}:{_line('LOG', here)} in {name}"
    assert [t_.tolist() for t_ in e.inputs] == [[[0.0], [0.0]]] and e.outputs[0].tolist() == [[-math.inf]] * 2
    assert all(p.grad is None for p in m.parameters())


def test_a_held_update_stop_is_raised_before_the_optimizer_step_writes_a_weight() -> None:
    # GIVEN finite gradients of 1e25 whose squared norm overflows float32 in clip_grad_norm_, then opt.step()
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    # WHEN traced with stop_at_first
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True) as t:
        (m(torch.ones(2, 4)) * 1e25).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        opt.step()  # STEP
    here = test_a_held_update_stop_is_raised_before_the_optimizer_step_writes_a_weight
    # THEN the step's pre-hook settles it (update, as the full trace says) and no weight has changed
    assert where(t.first) == (Phase.UPDATE, None, "aten::_foreach_norm", 0, "inf")
    assert _last_frame(info.tb) == (__file__, _line("STEP", here))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert _get_current_dispatch_mode() is None


def test_a_stop_held_to_the_end_of_the_block_is_raised_at_its_exit() -> None:
    # GIVEN a float16 EMA of the weights that overflows after opt.step(), the last thing in the block
    m, opt, ema = _ema_setup()
    # WHEN traced with stop_at_first
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.trace(m, stop_at_first=True) as t:
        m(torch.randn(2, 4)).mean().backward()
        opt.step()
        for e_, p in zip(ema, m.parameters()):
            e_.mul_(0.5).add_(p, alpha=0.5)
    e = info.value
    # THEN the block's end settles it: update, the full trace's answer, which is there too
    assert where(t.first) == (Phase.UPDATE, None, "aten::add_", 0, "inf") and t.first is e.occurrence
    assert [where(o) for o in t.origins] == [(Phase.UPDATE, None, "aten::add_", 0, "inf")]
    # ... no user frame is below the exit: the message claims no landing; the op's tensors are in nanhunt.last
    assert e.stop is not None and e.stop.landing is None and "post-mortem" not in str(e)
    assert nanhunt.last is e.stop and e.outputs[0].dtype == torch.float16 and e.outputs[0].isinf().all().item()
    assert _hooked(m) == 0 and _get_current_dispatch_mode() is None


def test_stop_at_first_looks_on_when_its_held_origin_turns_out_a_mask() -> None:
    # GIVEN an additive -inf mask made before the trace and first read after a backward (stale state, until
    # the next model call takes the masked batch: a model input then, a mask and no origin); the masked
    # batch makes fc's addmm NaN (-inf times weights of both signs)
    mask = torch.full((2, 4), -math.inf)

    def step(m: nn.Module) -> None:
        m(torch.randn(2, 4)).sum().backward()
        m(torch.randn(2, 4) + mask).sum().backward()

    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as full:
        step(m)
    torch.manual_seed(0)
    m = MLP()
    # WHEN traced with stop_at_first
    with pytest.raises(nanhunt.NonFiniteError), nanhunt.trace(m, stop_at_first=True) as t:
        step(m)
    # THEN it stops where the full trace says the NaN was born, not at the mask
    assert where(t.first) == where(full.first) == (Phase.FORWARD, "fc", "aten::addmm", 1, "nan")


def test_the_blocks_own_error_wins_over_a_held_stop() -> None:
    # GIVEN a 0/0 between two model calls, then an error of the user's before the next call
    torch.manual_seed(0)
    m = MLP()
    nanhunt.last = None
    # WHEN traced with stop_at_first
    with pytest.raises(ValueError, match="user"), nanhunt.trace(m, stop_at_first=True) as t:
        m(torch.randn(2, 4)).sum()
        x2 = torch.zeros(2, 4)
        x2 = (x2 - x2.mean()) / x2.std()
        raise ValueError("user")
    # THEN the user's error propagates, the held stop is dropped, and t.first is the full trace's (no call followed)
    assert where(t.first) == (Phase.LOSS, None, "aten::div", 0, "nan")
    assert nanhunt.last is None


class _D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _saturated_gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), _D()
    with torch.no_grad():
        d.fc.weight.fill_(-1e3)  # D(real) = -4000: sigmoid underflows to exactly 0
        d.fc.bias.zero_()
    return g, d


def _d_step(g: nn.Module, d: nn.Module) -> None:
    fake = g(torch.randn(2, 4))
    loss_real = -torch.log(torch.sigmoid(d(torch.ones(2, 4)))).mean()  # log(0) = -inf
    loss_fake = F.softplus(d(fake.detach())).mean()  # D called again before the loss is summed
    (loss_real + loss_fake).backward()


def test_gan_discriminator_loss_before_its_second_call_is_loss_in_a_container() -> None:
    # GIVEN a GAN traced through a container of G and D (the root is never called); the D loss on
    # the real batch is computed, then D is called on the fakes (pix2pix's backward_D order)
    g, d = _saturated_gan()
    gan = nn.ModuleDict({"G": g, "D": d})
    with nanhunt.trace(gan) as t:
        _d_step(g, d)
    # THEN log(sigmoid(-4000)) = log(0) is born in the loss, as when D itself is traced (test below)
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


def test_gan_discriminator_loss_before_its_second_call_is_loss_with_d_as_root() -> None:
    g, d = _saturated_gan()
    with nanhunt.trace(d) as t:
        _d_step(g, d)
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


def test_clip_grad_norm_after_a_no_grad_eval_forward_is_update() -> None:
    # GIVEN finite gradients of 1e25 (squared norm overflows float32) and a no_grad evaluation forward
    # (logging) between backward and the clip/step
    m = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanhunt.trace(m) as t:
        (m(torch.ones(1, 2)) * 1e25).sum().backward()
        with torch.no_grad():
            m(torch.ones(1, 2))
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        opt.step()
    assert math.isinf(total)
    occ = t.first
    assert occ is not None
    # THEN as without the evaluation forward (tests/integration/test_trace_phases.py): the clip is the update phase
    assert (occ.phase, occ.module, occ.call_index, occ.kind) == (Phase.UPDATE, None, 0, "inf")
    assert occ.op == "aten::_foreach_norm"  # foreach=True: the fused norm, whatever the default


def test_optimizer_step_inside_a_module_forward_is_update() -> None:
    # GIVEN a TENT-style wrapper whose forward adapts the model: forward, loss, backward, opt.step()
    class Tent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = MLP()
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e38, foreach=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.model(x)
            (out.sum() * 1e5).backward()
            self.opt.step()
            self.opt.zero_grad()
            return out

    torch.manual_seed(0)
    tm = Tent()
    with nanhunt.trace(tm) as t:
        out = tm(torch.ones(2, 4))
    assert torch.isfinite(out).all() and not torch.isfinite(tm.model.fc.weight).all()
    occ = t.first
    assert occ is not None
    # THEN SGD's param.add_(grad, alpha=-1e38) overflows inside optimizer.step(): phase update
    assert (occ.phase, occ.op, occ.call_index, occ.kind) == (Phase.UPDATE, "aten::add_", 0, "inf")


@pytest.mark.parametrize("kw", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_foreach_and_fused_optimizer_overflow_is_update(kw: dict[str, bool]) -> None:
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e38, **kw)
    with nanhunt.trace(m) as t:
        (m(torch.ones(2, 4)).sum() * 1e5).backward()
        opt.step()
    assert not torch.isfinite(m.head.weight).all()
    op = "aten::_foreach_add_" if "foreach" in kw else "aten::_fused_sgd_"
    assert where(t.first) == (Phase.UPDATE, None, op, 0, "inf")


@pytest.mark.parametrize("level", ["op", "module"])
def test_clean_amp_loop_with_scaler_clip_scheduler_ema_and_eval_has_no_origin(level: str) -> None:
    # GIVEN two full AMP steps: scale, backward, unscale_, clip, scaler.step/update, scheduler, a no_grad
    # EMA, a no_grad evaluation forward, zero_grad
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    scaler = torch.amp.GradScaler("cpu")
    ema = [p.detach().clone() for p in m.parameters()]
    with nanhunt.trace(m, level=level) as t:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(torch.randn(4, 4)).float(), torch.zeros(4, 1))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                for e, p in zip(ema, m.parameters()):
                    e.mul_(0.99).add_(p, alpha=0.01)
                m(torch.randn(4, 4))
            m.zero_grad()
    assert t.first is None and t.origins == []


def test_scaled_fp16_backward_overflow_is_backward_and_the_skipped_step_adds_nothing() -> None:
    # GIVEN a loss scale of 2**60: the float32 gradient of `out.float()` cast back to float16 overflows
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    before = [p.detach().clone() for p in m.parameters()]
    with nanhunt.trace(m) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(torch.randn(4, 4))
        scaler.scale(out.float().pow(2).mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # the scaler skipped the step
    # THEN the backward of the loss's float() cast (float32 -> float16) is where Inf is born
    assert where(t.first) == (Phase.BACKWARD, None, "aten::_to_copy", 0, "inf")
    assert all(o.phase is Phase.BACKWARD for o in t.origins)


def test_second_micro_batch_fp16_overflow_names_call_1() -> None:
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc.weight.fill_(1e4)
        m.fc.bias.zero_()
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with nanhunt.trace(m) as t:
        for x in (torch.full((2, 4), 0.1), torch.full((2, 4), 3.0)):  # fc: 4 * 1e4 * 3 = 1.2e5 > 65504
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().mean() / 2
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert where(t.first) == (Phase.FORWARD, "fc", "aten::addmm", 1, "inf")


# ---------------------------------------------------------------- phase after a backward


def test_second_loss_after_a_first_backward_is_phase_loss() -> None:
    # GIVEN a multi-task step with one backward per loss; the second loss takes log(0)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    with nanhunt.trace(m) as t:
        p = m(torch.randn(2, 4))
        p.pow(2).mean().backward(retain_graph=True)
        loss2 = -torch.log(p * torch.tensor([1.0, 0.0, 1.0])).sum()
        loss2.backward()
    assert math.isinf(loss2.item())
    # THEN no optimizer ran: the -inf of log(0) is born in the loss
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


def test_preprocessing_of_second_micro_batch_is_phase_forward() -> None:
    # GIVEN gradient accumulation with per-micro-batch standardisation; micro-batch 2 is constant: 0/0
    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as t:
        for x in (torch.randn(2, 4), torch.zeros(2, 4)):
            x = (x - x.mean()) / x.std()
            (m(x).sum() / 2).backward()
    # THEN it is glue before the model (as for the first micro-batch): forward, no module
    assert where(t.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")


def test_optimizer_step_fused_into_backward_is_phase_update() -> None:
    torch.manual_seed(0)
    m = MLP()
    opts = {p: torch.optim.SGD([p], lr=1e38, foreach=False) for p in m.parameters()}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in m.parameters()]
    try:
        with nanhunt.trace(m) as t:
            (m(torch.ones(2, 4)).sum() * 1e5).backward()
    finally:
        for h in handles:
            h.remove()
    assert not torch.isfinite(m.head.weight).all()
    occ = t.first
    # THEN SGD's `param.add_(grad, alpha=-lr)` overflows: an update (first param updated: head's)
    assert occ is not None
    assert (occ.phase, occ.op, occ.call_index, occ.kind) == (Phase.UPDATE, "aten::add_", 0, "inf")
    assert occ.module in (None, "head")


def test_trace_of_the_optimizer_step_alone_is_phase_update() -> None:
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e38, foreach=False)
    (m(torch.ones(2, 4)).sum() * 1e5).backward()
    with nanhunt.trace(m) as t:
        opt.step()
    assert not torch.isfinite(m.head.weight).all()
    assert where(t.first) == (Phase.UPDATE, None, "aten::add_", 0, "inf")


def test_preprocessing_between_two_calls_without_backward_is_forward_glue() -> None:
    # GIVEN two model calls in one step, the second micro-batch standardised between them: 0/0
    torch.manual_seed(0)
    m = MLP()
    with nanhunt.trace(m) as t:
        loss = m(torch.randn(2, 4)).sum()
        x2 = torch.zeros(2, 4)
        x2 = (x2 - x2.mean()) / x2.std()
        loss = loss + m(x2).sum()
        loss.backward()
    # THEN the NaN is born in glue that feeds the second call: forward, no module (not the first call's loss)
    assert where(t.first) == (Phase.FORWARD, None, "aten::div", 0, "nan")


# ---------------------------------------------------------------- phases around autograd.grad


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_loss_after_gradient_penalty_is_phase_loss() -> None:
    # GIVEN a WGAN-GP style step: autograd.grad(create_graph=True) in the training loop, then the loss
    torch.manual_seed(0)
    d = Critic()
    x = torch.randn(3, 4, requires_grad=True)
    with nanhunt.trace(d) as t:
        out = d(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        gp = ((g**2).sum(1) - 1).pow(2).mean()
        loss = gp + torch.log(out.mean() * 0)  # log(0): the loss makes -inf
        loss.backward()
    # THEN the log runs in the loss, outside the model
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


# ---------------------------------------------------------------- loss computed between two model calls


def test_loss_between_two_calls_of_the_model_is_phase_loss() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))

    def nll(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -torch.log(p * y).sum()  # log(0) where y == 0

    with nanhunt.trace(m) as t:
        loss = nll(m(torch.randn(1, 4)), torch.tensor([[1.0, 0.0, 0.0]])) + nll(m(torch.randn(1, 4)), torch.ones(1, 3))
        loss.backward()
    assert where(t.first) == (Phase.LOSS, None, "aten::log", 0, "inf")


def test_gradient_accumulation_fault_in_second_micro_batch() -> None:
    class E(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).exp()

    torch.manual_seed(0)
    m = E()
    with torch.no_grad():
        m.fc.weight.copy_(torch.eye(4))
        m.fc.bias.zero_()
    with nanhunt.trace(m) as t:
        for x in (torch.ones(2, 4), torch.full((2, 4), 100.0)):
            (m(x).sum() / 2).backward()
    assert where(t.first) == (Phase.FORWARD, "", "aten::exp", 1, "inf")


def test_grad_scaler_unscale_and_clip_first_is_the_scaled_backward() -> None:
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.fc(x))

    torch.manual_seed(0)
    m = Big()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    before = [p.detach().clone() for p in m.parameters()]
    with nanhunt.trace(m) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(torch.randn(8, 4) * 100)
        loss = out.float().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # step skipped
    occ = t.first
    assert occ is not None and occ.phase is Phase.BACKWARD and occ.kind == "inf"
    assert all(o.phase is not Phase.UPDATE for o in t.origins[:1])
