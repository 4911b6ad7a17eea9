"""Real-model shapes: containers as outputs, shared weights, checkpointing, eval,
optimizer and GradScaler steps inside the trace, transformers, torch.compile."""

from __future__ import annotations

import math
import warnings

import tests._support.models as M
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Phase, Role

# ---------------------------------------------------------------- outputs


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, M.Output):
        return out.logits
    if isinstance(out, dict):
        return out["logits"]
    assert isinstance(out, tuple)
    return out[1][0]


@pytest.mark.parametrize("cls", [M.DictOut, M.TupleOut, M.DataclassOut, M.HFStyle], ids=["dict", "tuple", "dataclass", "hf-style"])
@pytest.mark.parametrize("level", ["op", "module"])
def test_container_outputs(cls: type[M.DictOut], level: str) -> None:
    # GIVEN a model returning its exp-overflowing logits inside a container (with non-tensor members)
    m = M.big_body(cls())
    # WHEN one step runs
    with nanhunt.trace(m, level=level) as t:
        out = m(torch.ones(2, 4))
        _logits(out).sum().backward()
    # THEN the origin is the activation, and the tracer found the value in the model's output container
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.call_index, occ.kind) == (Phase.FORWARD, "act", 0, "inf")
    assert occ.op == ("aten::exp" if level == "op" else None)
    assert "output" in occ.reached


@pytest.mark.parametrize("cls", [M.DictOut, M.TupleOut, M.DataclassOut, M.HFStyle], ids=["dict", "tuple", "dataclass", "hf-style"])
def test_container_outputs_clean(cls: type[M.DictOut]) -> None:
    M.seeded(0)
    m = cls()
    with nanhunt.trace(m) as t:
        _logits(m(M.batch(2, 4))).sum().backward()
    assert t.first is None
    assert t.origins == []


# ---------------------------------------------------------------- shared weights


def test_shared_weight_nan_is_owned_by_first_module() -> None:
    # GIVEN dec.weight is enc.weight, holding a NaN
    M.seeded(0)
    m = M.Tied()
    with torch.no_grad():
        m.enc.weight[0, 0] = math.nan
    # WHEN a step runs
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
    # THEN phase weights, owner = the first name of the shared parameter (named_parameters order)
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.WEIGHTS, "enc", None, "nan")
    assert sum(1 for r in t.records if r.phase is Phase.WEIGHTS) == 1  # recorded once, not per user


def test_shared_weight_overflow_in_second_user() -> None:
    # GIVEN tied weights of 1e20: enc's output (4e20) is finite, dec's (1.6e41) is not
    M.seeded(0)
    m = M.Tied()
    with torch.no_grad():
        m.enc.weight.fill_(1e20)
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 4)).sum().backward()
    # THEN the Inf is born in dec's matmul (no bias: aten::mm)
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.call_index, occ.kind) == (Phase.FORWARD, "dec", "aten::mm", 0, "inf")


def test_shared_weight_clean_accumulates_grad() -> None:
    M.seeded(0)
    m = M.Tied()
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
    assert t.first is None
    assert m.enc.weight.grad is not None
    grads = [r for r in t.records if r.role is Role.GRAD]
    assert grads and all(r.module == "enc" for r in grads)


# ---------------------------------------------------------------- checkpoint


def test_checkpoint_forward_fault() -> None:
    # GIVEN the exp-overflow MLP run under torch.utils.checkpoint (non-reentrant)
    m = M.Blocks(M.exp_overflow_mlp(), 3)
    # WHEN forward and backward run (backward recomputes the block)
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 4)).sum().backward()
    # THEN the first origin is the forward exp, call 0 (the recompute is no new call)
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.call_index, occ.kind) == (Phase.FORWARD, "inner.act", "aten::exp", 0, "inf")
    assert all(o.call_index == 0 for o in t.origins)


def test_checkpoint_recomputed_ops_keep_their_module() -> None:
    m = M.Blocks(M.exp_overflow_mlp(), 3)
    with nanhunt.trace(m) as t:
        m(torch.ones(2, 4)).sum().backward()
    # THEN every exp origin (the forward one and its recomputation) belongs to inner.act
    exps = [o for o in t.origins if o.op == "aten::exp"]
    assert len(exps) >= 1
    assert all(o.module == "inner.act" for o in exps), [(o.phase.value, o.module) for o in exps]


def test_checkpoint_backward_fault() -> None:
    # GIVEN sqrt(0) inside a checkpointed block
    m = M.Blocks(M.sqrt_model(), 4)
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
    # THEN the backward Inf belongs to the forward sqrt's module
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.call_index, occ.kind) == (Phase.BACKWARD, "inner.norm", "aten::div", 0, "inf")


def test_checkpoint_clean() -> None:
    M.seeded(0)
    m = M.Blocks(M.MLP(), 3)
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
    assert t.first is None
    assert all(p.grad is not None for p in m.parameters())


# ---------------------------------------------------------------- eval


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_eval_without_grad(ctx) -> None:  # type: ignore[no-untyped-def]
    # GIVEN the exp-overflow model in eval mode WHEN evaluated without autograd
    m = M.exp_overflow_mlp().eval()
    with nanhunt.trace(m) as t:
        with ctx():
            out = m(torch.ones(2, 4))
    assert not torch.isfinite(out).all()
    # THEN the forward exp is named and it reached the output; nothing backward exists
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.FORWARD, "act", "aten::exp", "inf")
    assert "output" in occ.reached
    assert not any(r.phase is Phase.BACKWARD for r in t.records)


def test_eval_clean_with_batchnorm() -> None:
    M.seeded(0)
    m = M.BNModel().eval()
    with nanhunt.trace(m) as t:
        with torch.no_grad():
            m(M.batch(3, 4))
    assert t.first is None


# ---------------------------------------------------------------- optimizer


def _adam_after_one_step(m: nn.Module, foreach: bool = False) -> torch.optim.Adam:
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, foreach=foreach)
    m(M.batch(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_nan_in_adam_state_is_phase_update(foreach: bool) -> None:
    # GIVEN an Adam state (exp_avg_sq of fc2.weight) holding a NaN
    m = M.clean_mlp()
    opt = _adam_after_one_step(m, foreach)
    opt.state[m.fc2.weight]["exp_avg_sq"][0, 0] = math.nan
    # WHEN forward, backward and optimizer.step run inside the trace
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
        opt.step()
    assert torch.isnan(m.fc2.weight).any()
    # THEN the NaN enters in the update phase, as optimizer state: no op, no module
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.UPDATE, None, None, "nan")
    assert occ.output.role is Role.STATE
    assert occ.output.shape == (3, 8)
    assert occ.reached == ("update",)


@pytest.mark.parametrize(("foreach", "op"), [(False, "aten::add_"), (True, "aten::_foreach_add_")], ids=["for-loop", "foreach"])
def test_huge_lr_overflows_params_in_update(foreach: bool, op: str) -> None:
    # GIVEN SGD with lr=1e38 and gradients of ~1e5: param - lr * grad overflows float32
    m = M.clean_mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e38, foreach=foreach)
    with nanhunt.trace(m) as t:
        (m(M.batch(2, 4)).sum() * 1e5).backward()
        opt.step()
    # THEN the Inf is born in the update's in-place add, outside any module
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.UPDATE, None, op, "inf")
    assert all(r.finite for r in occ.inputs)
    assert occ.source is not None and "test_trace_realmodels.py" in occ.source


def test_nan_lr_names_update_op() -> None:
    # GIVEN SGD with lr=nan: no op *creates* the NaN (the scalar already is one), yet params go NaN
    m = M.clean_mlp()
    opt = torch.optim.SGD(m.parameters(), lr=math.nan)
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
        opt.step()
    assert torch.isnan(m.fc1.weight).all()
    # THEN the first op that used the non-finite scalar is named, in the update phase
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.UPDATE, None, "aten::add_", "nan")
    assert occ.output.nonfinite_scalar == "nan"


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_clean_adam_step(foreach: bool) -> None:
    m = M.clean_mlp()
    opt = _adam_after_one_step(m, foreach)
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert t.first is None
    assert any(r.phase is Phase.UPDATE for r in t.records)


# ---------------------------------------------------------------- GradScaler


def _scaled_step(m: nn.Module, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> nanhunt.Trace:
    with nanhunt.trace(m) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(M.batch(2, 4))
        loss = out.float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return t


def test_grad_scaler_scale_induced_backward_overflow() -> None:
    # GIVEN fc2 weights of 1000 under float16 autocast and GradScaler("cpu") with scale 2**16:
    # the float16 gradient w.r.t. fc2's input (65536 / 6 * 1000 * 3) overflows, the loss is finite
    M.seeded(0)
    m = M.MLP()
    with torch.no_grad():
        m.fc2.weight.fill_(1000.0)
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    # WHEN the scaled step runs inside the trace
    t = _scaled_step(m, scaler, opt)
    # THEN the Inf is born in backward, in fc2's float16 grad-input matmul
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.call_index, occ.kind) == (Phase.BACKWARD, "fc2", "aten::mm", 0, "inf")
    assert occ.output.dtype == "float16"
    assert all(r.finite for r in occ.inputs)
    assert not any(o.phase in (Phase.FORWARD, Phase.LOSS) for o in t.origins)
    # ... and the scaler skipped the step and halved its scale
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_grad_scaler_clean() -> None:
    M.seeded(0)
    m = M.MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    t = _scaled_step(m, scaler, opt)
    assert t.first is None
    assert scaler.get_scale() == 2.0**16
    assert {Phase.BACKWARD, Phase.UPDATE} <= {r.phase for r in t.records}


# ---------------------------------------------------------------- attention / transformers


def test_multihead_attention_fully_masked_row() -> None:
    # GIVEN nn.MultiheadAttention (need_weights=True: explicit softmax) and a mask row with no key
    M.seeded(0)
    m = M.MHAModel(need_weights=True)
    keep = M.causal_keep(4)
    keep[2] = False
    with nanhunt.trace(m) as t:
        m(M.batch(2, 4, 8), keep).sum().backward()
    # THEN the NaN is born in the attention module's softmax
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.FORWARD, "attn", "aten::_softmax", "nan")


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_causal_mask_clean(need_weights: bool) -> None:
    M.seeded(0)
    m = M.MHAModel(need_weights=need_weights)
    with nanhunt.trace(m) as t:
        out = m(M.batch(2, 4, 8), M.causal_keep(4))
        out.sum().backward()
    assert torch.isfinite(out).all()
    assert t.first is None


def test_tiny_transformer_clean() -> None:
    # GIVEN a 2-layer causal TransformerEncoder LM WHEN a training step runs THEN no false alarm
    M.seeded(0)
    m = M.TinyLM()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with nanhunt.trace(m) as t:
        F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    assert t.first is None
    assert t.origins == []


def test_tiny_transformer_with_padding_mask_clean() -> None:
    # GIVEN the LM with a key padding mask that leaves every query at least one key
    M.seeded(0)
    m = M.TinyLM()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 4] = True
    with nanhunt.trace(m) as t:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own deprecation note about mixed mask types
            logits = m(ids, pad)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert torch.isfinite(logits).all()
    # THEN no false alarm
    assert t.first is None, t.first.describe() if t.first else ""


# ---------------------------------------------------------------- odd tensors, compile


def test_integer_and_empty_tensors() -> None:
    # GIVEN integer indices, an empty float tensor and integer/empty outputs WHEN traced THEN no crash, no alarm
    M.seeded(0)
    m = M.Mixed()
    with nanhunt.trace(m) as t:
        y, i2, e3, e0 = m(M.batch(3, 4), torch.tensor([0, 2]), torch.zeros(0, 4))
        y.sum().backward()
    assert t.first is None
    assert all(r.dtype.startswith(("float", "bfloat")) for r in t.records)
    assert any(r.shape == (0, 4) for r in t.records)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_compile_traces_eager_original() -> None:
    import torch._dynamo.config as dynamo_config

    disabled_before = dynamo_config.disable
    m = M.exp_overflow_mlp()
    cm = torch.compile(m)
    # WHEN the compiled wrapper is traced THEN a warning says the eager original is traced ...
    with pytest.warns(UserWarning, match="compile"):
        with nanhunt.trace(cm) as t:
            cm(torch.ones(2, 4)).sum().backward()
    # ... its modules are named as in the original, and dynamo is as it was
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op) == (Phase.FORWARD, "act", "aten::exp")
    assert t.compiled
    assert dynamo_config.disable == disabled_before


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_function_inside_the_block_runs_eagerly_and_is_traced() -> None:
    import torch._dynamo.config as dynamo_config

    # GIVEN a compiled function (not a model) called inside the traced block
    @torch.compile(backend="eager")
    def blow_up(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x * 100)

    M.seeded(0)
    m = nn.Linear(4, 4)
    disabled_before = dynamo_config.disable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dynamo tracing into the tracer's hooks would warn
        with nanhunt.trace(m) as t:
            blow_up(m(M.batch(2, 4, scale=2.0))).sum().backward()
    # THEN its exp is the origin, seen op by op, and dynamo is as it was
    occ = t.first
    assert occ is not None
    assert (occ.phase, occ.module, occ.op, occ.kind) == (Phase.LOSS, None, "aten::exp", "inf")
    assert dynamo_config.disable == disabled_before
