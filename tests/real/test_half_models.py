"""Pure half-precision models (``model.half()``, ``model.to(torch.bfloat16)``, no autocast) bisected: a float32 region
hands the rest of the model the dtype it had there, so a trial never feeds a float32 tensor to a half weight.

T5's encoder ends in a parameter-free dropout whose output the decoder's cross-attention ``k`` projection (half weights)
reads: the trial with the encoder's children in float32 used to crash on that float32 input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Phase

from . import builders as B
from .builders import where

T5_WO = "encoder.block.0.layer.1.DenseReluDense.wo"


@pytest.mark.slow
def test_half_t5_replay_bisects_to_the_encoder() -> None:
    pytest.importorskip("transformers")
    # GIVEN T5 made float16 with .half() whose encoder FFN wo overflows float16 (T5's own float16 clamp absorbs it)
    m = B.t5()
    B.scale_weight(m, T5_WO, 5e4)
    m.half()
    # WHEN its step (no autocast: the model is float16 itself) is replayed and bisected
    r = nanhunt.replay(m, (B.t5_batch(), None), dtype=torch.float32, bisect=True)
    # THEN the bisection finishes: the wo matmul is the origin; wo alone in float32 cannot fix it (its float32 output
    # is handed back as float16, which overflows again), the encoder as a whole can (its final norm brings the
    # value back in range before the cast), and the confirmation run is finite
    assert where(r.first) == (Phase.FORWARD, T5_WO, "aten::mm", 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes, v.confirmed) == ("precision", ("encoder",), False, True)
    assert all(p.dtype == torch.float16 for p in m.parameters())


class Encoder(nn.Module):
    """fc, a hand-written log(1 - sigmoid) (1 - p rounds to 0 in bfloat16 once p > 1 - 2**-9), then a parameter-free
    dropout, as T5's encoder ends."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.log(1 - torch.sigmoid(self.fc(x))))


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()
        self.k = nn.Linear(4, 4)  # reads the encoder's output, as T5's cross-attention k does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.k(self.encoder(x))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def test_bfloat16_model_replay_bisects_to_the_encoder() -> None:
    # GIVEN a model made bfloat16 with .to(torch.bfloat16) whose encoder's log(1 - sigmoid(8)) is log(0) in bfloat16
    m = EncDec()
    with torch.no_grad():
        m.encoder.fc.weight.zero_()
        m.encoder.fc.bias.fill_(8.0)
    ref = copy.deepcopy(m)
    m.to(torch.bfloat16)
    x, y = torch.ones(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.bfloat16)
    # truth: finite in float32
    assert bool(torch.isfinite(_mse(ref(x.float()), y.float())))
    # WHEN replayed and bisected
    r = nanhunt.replay(m, (x, y), loss_fn=_mse, dtype=torch.float32, bisect=True)
    # THEN the log in the encoder's own code is the origin, and the encoder (whose own code needs float32; its
    # children alone do not) is the proven fix
    assert where(r.first) == (Phase.FORWARD, "encoder", "aten::log", 0, "inf")
    v = r.verdict
    assert v is not None
    assert (v.kind, v.culprits, v.origin_alone_fixes, v.confirmed) == ("precision", ("encoder",), True, True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_float32_region_without_autocast_hands_back_the_models_dtype(dtype: torch.dtype) -> None:
    # GIVEN a half-precision model (no autocast) with its parameter-free dropout in float32
    m = EncDec().to(dtype)
    x = torch.randn(2, 4).to(dtype).requires_grad_()
    seen: list[torch.dtype] = []
    dropout = m.encoder.dropout.forward

    def spy(t: torch.Tensor) -> torch.Tensor:  # what the dropout's own forward is given
        seen.append(t.dtype)
        return dropout(t)

    m.encoder.dropout.forward = spy  # type: ignore[method-assign]
    with nanhunt.keep_fp32(m, ["encoder.dropout"]):
        out = m(x)
        out.float().sum().backward()
    # THEN the dropout ran on float32, and handed k (half weights) the model's dtype; the gradients reaching the
    # input and every parameter are in the model's dtype
    assert seen == [torch.float32]
    assert out.dtype == dtype
    assert x.grad is not None and x.grad.dtype == dtype
    assert all(p.grad is not None and p.grad.dtype == dtype for p in m.parameters())
