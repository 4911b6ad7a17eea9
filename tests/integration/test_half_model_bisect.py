"""A pure float16 model (``model.half()``, no autocast) bisected: a module in float32 holds its parameters in float32,
so its weight gradients and its update are float32 too, as ``module.float()`` makes them. And a ``scale-induced``
verdict answers ``origin_alone_fixes`` like every other.

The model: ``block.up`` multiplies by 1e3 and ``block.down`` by 1e-3, so the value between them (1e5) passes float16's
maximum (65504); ``down``'s weight gradient is that activation times the output's gradient (8e5), past it too.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from tests._support.bisection import verdict_of

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, D, bias=False)
        self.down = nn.Linear(D, D, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(torch.eye(D) * 1e3)
            self.down.weight.copy_(torch.eye(D) * 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), Block(), nn.Linear(D, D)).half()


def _batch(scale: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(4, D, dtype=torch.float16) * scale, torch.zeros(4, D, dtype=torch.float16)


def _finite_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> bool:
    """Ground truth by hand: one plain step (no autocast); loss, gradients and updated weights finite."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.step()
    return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(t).all()) for t in (*grads, *model.parameters()))


def test_half_model_whose_module_fixed_in_float32_is_precision() -> None:
    # GIVEN a float16 model with Adam whose state already exists (a finite first step on a small batch; an eps
    # float16 holds)
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-4, eps=1e-4)
    assert _finite_step(m, opt, *_batch(0.01))
    opt.zero_grad()
    # truth by hand: the step fails as it is, and is finite with `1` made float32 (module.float(), state cast)
    ref, ref_opt = copy.deepcopy((m, opt))
    assert not _finite_step(ref, ref_opt, *_batch())
    ref, ref_opt = copy.deepcopy((m, opt))
    ref[1].float()
    for p in ref[1].parameters():
        ref_opt.state[p] = {k: v.float() if v.is_floating_point() else v for k, v in ref_opt.state[p].items()}
    inner = ref[1].forward
    ref[1].forward = lambda t: inner(t.float()).half()  # type: ignore[method-assign]
    assert _finite_step(ref, ref_opt, *_batch())
    before = {n: p.clone() for n, p in m.named_parameters()}
    state = [(k, v.clone()) for st in opt.state.values() for k, v in st.items()]
    # WHEN its step (no autocast) is replayed and bisected
    rep = nanhunt.replay(m, _batch(), loss_fn=F.mse_loss, dtype=torch.float32, optimizer=opt, bisect=True)
    # THEN the up matmul is the origin, and the block, in float32, is the proven fix (up alone hands 1e5 back to
    # float16), measured: nothing left in its traced replay
    assert rep.first is not None and (rep.first.module, rep.first.op) == ("1.up", "aten::mm")
    v = verdict_of(rep)
    assert (v.kind, v.culprits, v.confirmed, v.origin_alone_fixes, v.remaining) == ("precision", ("1",), True,
                                                                                    False, ())
    assert v.fix is not None and "nanhunt.keep_fp32_permanently(model, ['1'])" in v.fix
    # AND the model and the optimizer are as they were: float16, same values, same state (moments in float16)
    assert all(p.dtype == torch.float16 and torch.equal(p, before[n]) for n, p in m.named_parameters())
    after = [(k, v) for st in opt.state.values() for k, v in st.items()]
    assert [k for k, _ in after] == [k for k, _ in state]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(after, state))
    assert {v.dtype for k, v in after if k == "exp_avg"} == {torch.float16}


def test_the_suggested_fix_as_written_makes_the_half_models_step_finite() -> None:
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-4, eps=1e-4)
    undo = nanhunt.keep_fp32_permanently(m, ["1"])  # before the optimizer's first step, as the fix says
    assert {p.dtype for p in m[1].parameters()} == {torch.float32}
    assert _finite_step(m, opt, *_batch())
    assert {p.grad.dtype for p in m[1].parameters() if p.grad is not None} == {torch.float32}
    assert m(_batch()[0]).dtype == torch.float16  # the modules after it get the model's dtype
    w = m[1].down.weight
    undo()
    # the undo puts back float16, holding the updated value, in the same Parameter the optimizer holds
    assert w.dtype == torch.float16 and w is m[1].down.weight and any(w is p for p in opt.param_groups[0]["params"])


def test_a_weight_tied_outside_the_float32_module_keeps_its_dtype() -> None:
    # GIVEN a float16 model whose first and last layers share a weight, `0` held in float32
    m = nn.Sequential(nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)).half()
    m[1].weight = m[0].weight
    own = m[0].weight.data_ptr()
    x = torch.randn(2, D).half()
    with nanhunt.keep_fp32(m, ["0"], params=True):
        # THEN the shared weight stays float16 (the last layer takes it in its dtype); `0` copies it at each call
        assert m[0].weight.dtype == torch.float16 and m[0].weight.data_ptr() == own
        out = m(x)
        out.float().sum().backward()
    assert out.dtype == torch.float16 and m[0].weight.grad is not None and m[0].weight.grad.dtype == torch.float16


def test_scale_induced_verdict_answers_origin_alone_fixes() -> None:
    # GIVEN a float16 loss (sum of the autocast output) whose gradient is the loss scale itself, 2**17 > 65504:
    # the origin is the scaled gradient's cast to float16, in no module (the loss's backward)
    def loss_fn(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return o.sum() * 1e-3

    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x, y = torch.ones(2, 8), torch.zeros(2, 8)
    rep = nanhunt.replay(m, (x, y), loss_fn=loss_fn, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**17),
                         bisect=True)
    assert rep.first is not None and (rep.first.phase.value, rep.first.module) == ("backward", None)
    v = verdict_of(rep)
    # THEN it is answered, measured: the loss in float32 takes the scale in float32 and hands its input a
    # gradient of 131, which float16 holds
    assert (v.kind, v.origin_alone_fixes) == ("scale-induced", True)
    # AND with a float16 gradient too large for float16 itself (mse's, 1.8e6), the loss in float32 does not fix it
    m2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        m2[1].weight.fill_(20.0)
    rep = nanhunt.replay(m2, (x * 10, y), loss_fn=F.mse_loss, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16),
                         bisect=True)
    v = verdict_of(rep)
    assert (v.kind, v.origin_alone_fixes) == ("scale-induced", False)


def test_scale_induced_verdict_of_a_model_returning_its_loss_measures_the_model() -> None:
    # GIVEN a model that returns its own float16 loss (no loss function): the scaled gradient's cast is in the
    # backward of the model's output
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).sum() * 1e-3

    rep = nanhunt.replay(WithLoss(), torch.ones(2, 8), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**17),
                         bisect=True)
    v = verdict_of(rep)
    # THEN the model in float32 is what is measured: its float32 loss takes the scale, and fc's gradient fits
    assert (v.kind, v.origin_alone_fixes) == ("scale-induced", True)
