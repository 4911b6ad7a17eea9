"""torch's own layers: nn.MultiheadAttention and nn.TransformerEncoderLayer with key padding masks (intentional
-inf that must stay clean, a fully padded sample that must not), and nn.CTCLoss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanhunt import Phase

from . import builders as B
from .builders import where

pytestmark = pytest.mark.filterwarnings("ignore:.*(mask|nested).*:UserWarning")


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu")


def _mha(need_weights: bool) -> nn.Module:
    torch.manual_seed(0)
    return B.MHANet(need_weights).train()


def _causal() -> torch.Tensor:
    """Additive causal mask: -inf above the diagonal (every query keeps itself)."""
    return torch.triu(torch.full((8, 8), float("-inf")), 1)


# ---------------------------------------------------------------- nn.MultiheadAttention


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit-softmax", "sdpa"])
def test_mha_padding_and_causal_masks_are_clean(need_weights: bool) -> None:
    # GIVEN MHA with a -inf causal mask and a key padding mask that leaves every query a key
    ids, pad, y = B.seq_batch()
    m = _mha(need_weights)
    # WHEN a float16 step is traced THEN the intentional -inf are no origin
    t = B.traced(m, (ids, pad, _causal()), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    assert t.first is None
    assert t.origins == []
    # WHEN replayed THEN clean
    r = B.replayed(_mha(need_weights), (ids, pad, _causal()), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert (r.status, r.first) == ("clean", None)
    assert r.verdict is not None and r.verdict.kind == "clean"


def test_mha_fully_padded_sample_nan_is_born_in_its_softmax() -> None:
    # GIVEN sample 1 padded everywhere, need_weights=True (MHA's explicit softmax): that sample's rows are all -inf
    ids, pad, y = B.seq_batch()
    pad[1, :] = True
    # WHEN traced THEN softmax of an all -inf row: NaN, born in the attention module's softmax
    t = B.traced(_mha(True), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert where(t.first) == (Phase.FORWARD, "attn", "aten::_softmax", 0, "nan")
    assert t.first is not None and {"loss", "gradients"} <= set(t.first.reached or ())
    # WHEN replayed and bisected THEN a data problem, NaN in float32 too; attention in float32 alone fixes nothing
    r = B.replayed(_mha(True), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert where(r.first) == (Phase.FORWARD, "attn", "aten::_softmax", 0, "nan")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("not-precision", (), False)
    assert where(v.float32_first) == (Phase.FORWARD, "attn", "aten::_softmax", 0, "nan")


def test_mha_fully_padded_sample_through_sdpa_stays_finite_and_clean() -> None:
    # GIVEN the same fully padded sample but need_weights=False: scaled_dot_product_attention gives fully masked
    # rows zeros (its safe softmax), so nothing goes non-finite
    ids, pad, y = B.seq_batch()
    pad[1, :] = True
    m = _mha(False)
    # WHEN traced THEN the step is finite and nothing is named
    t = B.traced(m, (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    assert t.first is None
    r = B.replayed(_mha(False), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert (r.status, r.first) == ("clean", None)


# ---------------------------------------------------------------- nn.TransformerEncoderLayer

ENC_FF = "enc.linear2"


def _enc() -> nn.Module:
    torch.manual_seed(0)
    return B.EncNet().train()


def _enc_fault() -> nn.Module:
    m = _enc()
    B.scale_weight(m, ENC_FF, 1.2e5)
    return m


def _enc_inf_norm() -> nn.Module:
    m = _enc()
    with torch.no_grad():
        m.enc.norm1.weight[2] = float("inf")
    return m


def test_encoder_layer_with_padding_is_clean() -> None:
    # GIVEN a post-LN encoder layer and a key padding mask (sample 1: two padded keys)
    ids, pad, y = B.seq_batch()
    # WHEN traced and replayed THEN clean
    t = B.traced(_enc(), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert t.first is None and t.origins == []
    r = B.replayed(_enc(), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert (r.status, r.first) == ("clean", None)
    assert r.verdict is not None and r.verdict.kind == "clean"


def test_encoder_layer_feed_forward_overflow_trace_and_replay() -> None:
    # GIVEN the encoder layer's second feed-forward Linear overflowing float16 (norm2 after it: NaN), padding on
    ids, pad, y = B.seq_batch()
    B.assert_overflows_only_in_fp16(_enc_fault(), ENC_FF, (ids, pad))
    # WHEN traced THEN its addmm (3-d input with bias: flattened to addmm)
    t = B.traced(_enc_fault(), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert where(t.first) == (Phase.FORWARD, ENC_FF, "aten::addmm", 0, "inf")
    # WHEN replayed and bisected THEN that Linear alone in float32 is the fix
    r = B.replayed(_enc_fault(), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert where(r.first) == (Phase.FORWARD, ENC_FF, "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", (ENC_FF,), True)


def test_encoder_layer_inf_layernorm_weight_is_no_precision_problem() -> None:
    # GIVEN an Inf in norm1's weight
    ids, pad, y = B.seq_batch()
    # WHEN traced THEN phase weights, module enc.norm1, no op
    t = B.traced(_enc_inf_norm(), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert where(t.first) == (Phase.WEIGHTS, "enc.norm1", None, 0, "inf")
    # WHEN replayed THEN fails in float32 too; norm1 in float32 alone does not fix it
    r = B.replayed(_enc_inf_norm(), (ids, pad), y, loss_fn=F.cross_entropy, scaler=_scaler())
    assert where(r.first) == (Phase.WEIGHTS, "enc.norm1", None, 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("not-precision", (), False)


def test_encoder_layer_capture_replayed_by_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture of the feed-forward overflow (model class and F.cross_entropy named in the file)
    ids, pad, y = B.seq_batch()
    # WHEN `nanhunt replay checkpoint.pt batch.pt` runs with no other argument
    rc, r = B.cli_replay(tmp_path, monkeypatch, model=_enc_fault(), batch=((ids, pad), y),
                         loss_fn=F.cross_entropy, scaler=_scaler())
    # THEN the same answer as the API
    assert rc == 1
    assert where(r.first) == (Phase.FORWARD, ENC_FF, "aten::addmm", 0, "inf")
    assert r.verdict is not None
    assert (r.verdict.kind, r.verdict.culprits, r.verdict.origin_alone_fixes) == ("precision", (ENC_FF,), True)


# ---------------------------------------------------------------- nn.CTCLoss


def _ctc() -> nn.Module:
    torch.manual_seed(0)
    return B.CTCNet().train()


def _frames() -> torch.Tensor:
    return torch.randn(8, 2, 8, generator=B.gen())


def _labels() -> torch.Tensor:
    return torch.randint(1, 5, (2, 4), generator=B.gen(2))


def test_ctc_loss_valid_batch_is_clean() -> None:
    # GIVEN CTC on 8 frames with targets of length 4 and 3: every alignment exists
    targets = (_labels(), torch.tensor([8, 8]), torch.tensor([4, 3]))
    m = _ctc()
    # WHEN traced
    t = B.traced(m, _frames(), targets, loss_fn=B.ctc_loss, scaler=_scaler())
    # THEN the step is finite and nothing is named
    assert all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    assert t.first is None
    r = B.replayed(_ctc(), _frames(), targets, loss_fn=B.ctc_loss, scaler=_scaler())
    assert (r.status, r.first) == ("clean", None)
    assert r.verdict is not None and r.verdict.kind == "clean"


def test_ctc_loss_impossible_alignment_is_born_in_the_loss() -> None:
    # GIVEN sample 1 with 2 frames for 4 labels (no alignment: its negative log-likelihood is +inf;
    # zero_infinity=False, the default)
    targets = (_labels(), torch.tensor([8, 2]), torch.tensor([4, 4]))
    # WHEN traced THEN the CTC op outside the model, in phase loss, reaching the loss and the gradients
    t = B.traced(_ctc(), _frames(), targets, loss_fn=B.ctc_loss, scaler=_scaler())
    assert where(t.first) == (Phase.LOSS, None, "aten::_ctc_loss", 0, "inf")
    assert t.first is not None and {"loss", "gradients"} <= set(t.first.reached or ())
    # WHEN replayed THEN not a precision problem (infinite in float32 too); the loss in float32 alone fixes nothing
    r = B.replayed(_ctc(), _frames(), targets, loss_fn=B.ctc_loss, scaler=_scaler())
    assert where(r.first) == (Phase.LOSS, None, "aten::_ctc_loss", 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes) == ("not-precision", (), False)

