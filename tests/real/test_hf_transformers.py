"""transformers models (GPT-2 eager and sdpa, T5, Llama, BERT and ViT with activation checkpointing): a float16
overflow planted in one named layer, a non-finite weight or input, and finite steps that must stay clean.

Every fault's answer was worked out from the model's code: GPT-2's Conv1D is ``torch.addmm(bias, x, W)``; T5's and
Llama's MLP projections are bias-free ``nn.Linear`` on 3-d inputs (``matmul`` -> ``aten::mm``); BERT's is a Linear with
bias (``aten::addmm``). Each planted layer's weight and input fit float16 while its float32 output does not (checked as
the premise), its output feeds a LayerNorm / RMSNorm (inf -> NaN: the loss and the gradients), and the same layer in
float32 is finite and followed by a normalisation, so that layer alone is the minimal float32 fix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nanhunt import Phase

from . import builders as B
from .builders import where

pytest.importorskip("transformers")


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu")


def _grads_finite(m: nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)


# ---------------------------------------------------------------- GPT-2: float16 overflow in block 1's MLP projection

GPT2_C_PROJ = "transformer.h.1.mlp.c_proj"
GPT2_FACTORIES = {"eager": B.gpt2_eager, "sdpa": B.gpt2_sdpa}


def _gpt2_fault(attn: str) -> Any:
    m = GPT2_FACTORIES[attn]()
    assert m.config._attn_implementation == attn
    B.scale_weight(m, GPT2_C_PROJ, 5e4)
    return m


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_mlp_projection_overflow_is_traced_to_its_addmm(attn: str) -> None:
    # GIVEN a 2-block GPT-2 whose block-1 MLP projection's float16 addmm overflows (weights and inputs fit float16)
    m, batch = _gpt2_fault(attn), B.lm_batch()
    B.assert_overflows_only_in_fp16(m, GPT2_C_PROJ, batch)
    # WHEN one float16 autocast step (padding mask, labels, GradScaler) runs in the trace
    t = B.traced(m, batch, scaler=_scaler())
    # THEN the Inf is born in that Conv1D's addmm, and reaches the logits, the loss and the gradients
    assert where(t.first) == (Phase.FORWARD, GPT2_C_PROJ, "aten::addmm", 0, "inf")
    assert t.first is not None and t.first.reached == ("output", "loss", "gradients")


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_mlp_projection_overflow_replay_proves_that_layer(attn: str) -> None:
    # GIVEN the same model, an AdamW optimizer and a GradScaler
    m = _gpt2_fault(attn)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    # WHEN the step is replayed and bisected
    r = B.replayed(m, B.lm_batch(), scaler=_scaler(), optimizer=opt)
    # THEN the same origin; that layer alone in float32 makes the whole step (update included) finite
    assert r.status == "nonfinite"
    assert where(r.first) == (Phase.FORWARD, GPT2_C_PROJ, "aten::addmm", 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes, v.confirmed) == ("precision", (GPT2_C_PROJ,), True, True)


def test_gpt2_capture_replayed_by_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture of the faulty GPT-2 step (the model needs its config: the factory is confirmed with --model)
    m = _gpt2_fault("eager")
    factory = "tests.real.builders:gpt2_eager"
    # WHEN `nanhunt replay checkpoint.pt batch.pt --model ... --report report.json` runs
    rc, r = B.cli_replay(tmp_path, monkeypatch, model=m, batch=B.lm_batch(), scaler=_scaler(),
                         model_factory=factory, args=["--model", factory])
    # THEN exit 1, the same origin and verdict as the API
    assert rc == 1
    assert where(r.first) == (Phase.FORWARD, GPT2_C_PROJ, "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", (GPT2_C_PROJ,), True)


# ---------------------------------------------------------------- T5: harmless log(0) every step, FFN overflow leads

T5_WO = "encoder.block.0.layer.1.DenseReluDense.wo"
# _relative_position_bucket takes log(relative_position / max_exact): log(0) = -inf on the diagonal, cast to an index
T5_BUCKET_LOGS = [("encoder.block.0.layer.0.SelfAttention", "aten::log"),
                  ("decoder.block.0.layer.0.SelfAttention", "aten::log")]


def _t5_fault() -> nn.Module:
    m = B.t5()
    B.scale_weight(m, T5_WO, 5e4)
    return m


def test_t5_ffn_overflow_leads_not_the_relative_position_log() -> None:
    # GIVEN T5 whose encoder FFN output projection overflows float16 (its log(0) bucket runs before it, every step)
    m, batch = _t5_fault(), B.t5_batch()
    B.assert_overflows_only_in_fp16(m, T5_WO, batch)
    # WHEN a float16 step is traced
    t = B.traced(m, batch, scaler=_scaler())
    # THEN the wo matmul leads; the bucket's log is listed first, harmless and silent
    assert where(t.first) == (Phase.FORWARD, T5_WO, "aten::mm", 0, "inf")
    assert t.first is not None and {"loss", "gradients"} <= set(t.first.reached or ())
    log = t.origins[0]
    assert (log.module, log.op, log.kind, log.harmless, log.silent) == (*T5_BUCKET_LOGS[0], "inf", True, True)


def test_t5_ffn_overflow_replay_proves_that_layer() -> None:
    # GIVEN the same T5 WHEN replayed and bisected
    r = B.replayed(_t5_fault(), B.t5_batch(), scaler=_scaler())
    # THEN the FFN's wo, proven alone
    assert where(r.first) == (Phase.FORWARD, T5_WO, "aten::mm", 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("precision", (T5_WO,), True)


# ---------------------------------------------------------------- Llama: MLP overflow; an Inf RMSNorm weight

LLAMA_DOWN = "model.layers.0.mlp.down_proj"
LLAMA_NORM = "model.layers.0.input_layernorm"


def _llama_fault() -> nn.Module:
    m = B.llama()
    B.scale_weight(m, LLAMA_DOWN, 2.5e4)
    return m


def _llama_inf_norm() -> Any:
    m = B.llama()
    with torch.no_grad():
        m.model.layers[0].input_layernorm.weight[3] = float("inf")
    return m


def test_llama_down_proj_overflow_trace_and_replay() -> None:
    # GIVEN Llama whose MLP down_proj overflows float16 (RMSNorm after it: inf * rsqrt(inf) = NaN)
    m, batch = _llama_fault(), B.lm_batch()
    B.assert_overflows_only_in_fp16(m, LLAMA_DOWN, batch)
    # WHEN traced THEN the down_proj matmul
    t = B.traced(m, batch, scaler=_scaler())
    assert where(t.first) == (Phase.FORWARD, LLAMA_DOWN, "aten::mm", 0, "inf")
    # WHEN replayed and bisected (fresh model and scaler) THEN the same origin, proven alone
    r = B.replayed(_llama_fault(), batch, scaler=_scaler())
    assert where(r.first) == (Phase.FORWARD, LLAMA_DOWN, "aten::mm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", (LLAMA_DOWN,), True)


def test_llama_loss_the_model_computes_is_reached_without_a_scaler() -> None:
    # GIVEN the same Llama, its step without a GradScaler: the model computes its loss (.loss), so no op of the
    # step runs in phase loss but backward's gradient seed
    m, batch = _llama_fault(), B.lm_batch()
    # WHEN traced THEN the down_proj overflow reaches the logits, the model's loss and the gradients
    t = B.traced(m, batch)
    assert where(t.first) == (Phase.FORWARD, LLAMA_DOWN, "aten::mm", 0, "inf")
    assert t.first is not None and t.first.reached == ("output", "loss", "gradients")


def test_llama_inf_rmsnorm_weight_is_no_precision_problem() -> None:
    # GIVEN an Inf in the first RMSNorm's weight
    batch = B.lm_batch()
    # WHEN traced THEN the weight enters the step non-finite: phase weights, that RMSNorm, no op
    t = B.traced(_llama_inf_norm(), batch, scaler=_scaler())
    assert where(t.first) == (Phase.WEIGHTS, LLAMA_NORM, None, 0, "inf")
    # WHEN replayed and bisected THEN it fails in float32 too, where it starts the same way; float32 on that
    # RMSNorm alone does not fix it
    r = B.replayed(_llama_inf_norm(), batch, scaler=_scaler())
    assert where(r.first) == (Phase.WEIGHTS, LLAMA_NORM, None, 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("not-precision", (), False)
    assert where(v.float32_first) == (Phase.WEIGHTS, LLAMA_NORM, None, 0, "inf")


# ---------------------------------------------------------------- BERT with activation checkpointing

BERT_OUT = "bert.encoder.layer.1.output.dense"


def _bert_fault() -> Any:
    m = B.bert()
    B.scale_weight(m, BERT_OUT, 2.5e4)
    return m


@pytest.mark.slow
def test_bert_checkpointed_layer_overflow_trace_and_replay() -> None:
    # GIVEN checkpointed BERT whose layer-1 output dense overflows float16 (LayerNorm after it: NaN);
    # the checkpoint recomputes the layer's forward inside backward
    m, batch = _bert_fault(), B.bert_batch()
    assert m.bert.encoder.layer[1].gradient_checkpointing
    B.assert_overflows_only_in_fp16(m, BERT_OUT, batch)
    # WHEN traced THEN the first (forward) run of its addmm, not the recomputation
    t = B.traced(m, batch, scaler=_scaler())
    assert where(t.first) == (Phase.FORWARD, BERT_OUT, "aten::addmm", 0, "inf")
    # WHEN replayed and bisected THEN the same layer, proven alone
    r = B.replayed(_bert_fault(), batch, scaler=_scaler())
    assert where(r.first) == (Phase.FORWARD, BERT_OUT, "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", (BERT_OUT,), True)


# ---------------------------------------------------------------- ViT with activation checkpointing: a NaN pixel


def test_vit_nan_pixel_is_an_input_origin() -> None:
    # GIVEN a checkpointed ViT and one NaN pixel in image 1
    batch = B.vit_batch()
    batch["pixel_values"][1, 0, 2, 3] = float("nan")
    # WHEN traced THEN phase input, outside the model (None, not the root "")
    t = B.traced(B.vit(), batch, scaler=_scaler())
    assert where(t.first) == (Phase.INPUT, None, None, 0, "nan")
    # WHEN replayed and bisected THEN not a precision problem (float32 fails the same way); the origin is in no
    # module, so there is no "origin alone" to try
    r = B.replayed(B.vit(), batch, scaler=_scaler())
    assert where(r.first) == (Phase.INPUT, None, None, 0, "nan")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("not-precision", (), None)
    assert where(v.float32_first) == (Phase.INPUT, None, None, 0, "nan")


# ---------------------------------------------------------------- finite steps stay clean

CLEAN_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, torch.Tensor]]]] = {
    "gpt2-eager": (B.gpt2_eager, B.lm_batch),
    "gpt2-sdpa": (B.gpt2_sdpa, B.lm_batch),
    "t5": (B.t5, B.t5_batch),
    "llama": (B.llama, B.lm_batch),
    "bert-ckpt": (B.bert, B.bert_batch),
    "vit-ckpt": (B.vit, B.vit_batch),
}


@pytest.mark.parametrize("name", list(CLEAN_CASES))
def test_finite_hf_step_traces_no_culprit(name: str) -> None:
    # GIVEN a finite float16 step of a tiny HF model (padding masks where the model takes them)
    factory, batch = CLEAN_CASES[name]
    m = factory()
    # WHEN traced
    t = B.traced(m, batch(), scaler=_scaler())
    # THEN the step really was finite, and nothing is named; only harmless origins may be listed (T5's bucket log)
    assert _grads_finite(m)
    assert t.first is None
    assert all(o.harmless for o in t.origins)
    if name == "t5":
        assert [(o.module, o.op) for o in t.origins] == T5_BUCKET_LOGS


@pytest.mark.parametrize("name", list(CLEAN_CASES))
def test_finite_hf_step_replays_clean(name: str) -> None:
    # GIVEN the same finite step WHEN replayed with bisection
    factory, batch = CLEAN_CASES[name]
    r = B.replayed(factory(), batch(), scaler=_scaler())
    # THEN clean: no culprit, nothing to bisect
    assert (r.status, r.first) == ("clean", None)
    assert r.verdict is not None and r.verdict.kind == "clean"

