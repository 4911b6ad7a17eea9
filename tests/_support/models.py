"""Tiny fixture models with known, injected faults.

Every model here is deterministic: weights come from a fixed seed (``seeded``)
or are set explicitly, and each fault sits at a place the tests name exactly
(module qualified name, aten op, call index). Sizes are tiny so the whole
suite stays fast on two CPU cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanhunt import Occurrence


def where(occ: Occurrence | None) -> tuple[object, ...] | None:
    """What a finding says: (phase, module, op, call index, kind)."""
    return None if occ is None else (occ.phase, occ.module, occ.op, occ.call_index, occ.kind)


def seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


def batch(*shape: int, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# --------------------------------------------------------------------- clean


class MLP(nn.Module):
    """fc1 -> act -> fc2. Clean unless its weights or activation are tampered with."""

    def __init__(self, d_in: int = 4, d_hidden: int = 8, d_out: int = 3, act: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = act if act is not None else nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def clean_mlp(seed: int = 0) -> MLP:
    seeded(seed)
    return MLP()


# ------------------------------------------------------- float16 overflow


def fp16_overflow_mlp() -> MLP:
    """fc1 under float16 autocast overflows: 4 inputs of 100 times weights of 1000
    = 4e5 > 65504. Weights (1000) and inputs (100) are exactly representable in
    float16, so the casts stay finite and the matmul creates the Inf."""
    seeded(0)
    m = MLP(d_in=4, d_hidden=8, d_out=3)
    with torch.no_grad():
        m.fc1.weight.fill_(1000.0)
        m.fc1.bias.zero_()
    return m


# --------------------------------------------------------------- exp / act


class ExpActivation(nn.Module):
    """A custom activation: exp overflows float32 for inputs above ~88.7."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)  # FAULT: exp overflow


def exp_overflow_mlp() -> MLP:
    seeded(0)
    m = MLP(act=ExpActivation())
    with torch.no_grad():
        m.fc1.weight.fill_(50.0)  # fc1 output = 4 * 50 * x, x = 1 -> 200 -> exp(200) = inf
        m.fc1.bias.zero_()
    return m


# --------------------------------------------------------------- loss side


def log_zero_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss that takes log of a probability that is exactly 0."""
    p = torch.relu(out - 1e6)  # all zeros for small outputs
    return -torch.log(p).mean()  # FAULT: log(0) = -inf


# ----------------------------------------------------------- sqrt backward


class SqrtNorm(nn.Module):
    """sqrt of a sum of squares: finite forward at 0, Inf gradient at 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)  # FAULT: d sqrt(u)/du at u = 0 is Inf


class FcThenNorm(nn.Module):
    """``fc``, whose output column 0 is exactly 0, then ``norm``: sqrt(x*x)'s backward divides by zero there."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = SqrtNorm()
        with torch.no_grad():
            self.fc.weight[0].zero_()
            self.fc.bias[0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class FcHead(nn.Module):
    """``fc``, ReLU, ``head``: a model with two named layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))


class SqrtModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = SqrtNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def sqrt_model() -> SqrtModel:
    seeded(0)
    m = SqrtModel()
    with torch.no_grad():
        m.fc.weight[0].zero_()  # output unit 0 is exactly 0 for every sample
        m.fc.bias[0] = 0.0
    return m


# --------------------------------------------------------------- 0/0, inf-inf


class ZeroOverZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x - x  # exact zeros
        return d / d  # FAULT: 0/0


class InfMinusInf(nn.Module):
    """Builds +inf by masked_fill (no origin: the scalar is already inf), then subtracts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x > 0
        a = x.masked_fill(mask, math.inf)
        return a - a  # FAULT: inf - inf


class Wrap(nn.Module):
    """Linear then a faulty block: names the faulty block ``block``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.fc(x))


# --------------------------------------------------------------- attention


class Attention(nn.Module):
    """Hand-written single-head attention with an additive ``-inf`` mask."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.d = d

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # keep: (T, T) bool, True where query i may look at key j
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        scores = scores.masked_fill(~keep, float("-inf"))
        w = torch.softmax(scores, dim=-1)  # a row of only -inf becomes NaN
        return self.proj(w @ v)


class AttnModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = Attention(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, keep))


def attn_model() -> AttnModel:
    seeded(0)
    return AttnModel()


def causal_keep(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()


# ------------------------------------------------------ custom autograd


class BadGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies by sqrt(-1 - x^2): NaN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * torch.sqrt(-1.0 - x * x)  # FAULT: sqrt of a negative


class BadGradModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BadGrad.apply(x)


# ------------------------------------------------------------ called twice


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class TwiceModel(nn.Module):
    """``scale`` is called twice: 1e25 once is finite, twice overflows float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = Scale(1e25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).abs() + 1.0
        return self.scale(self.scale(h))


# --------------------------------------------------------------- in-place


class InplaceMulHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.abs().half() + 1.0
        h.mul_(1e5)  # FAULT: in place, float16 max is 65504
        return h.float()


class InplaceExp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.abs() + 100.0
        h.exp_()  # FAULT: in place exp overflow
        return h


class InplaceViewWrite(nn.Module):
    """Writes through a view: only column 0 overflows, via ``select`` + ``mul_``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.abs() + 1.0
        col = h[:, 0]
        col.mul_(1e30).mul_(1e30)  # FAULT: the second mul_ overflows, through a view
        return h


class InplaceViewExp(nn.Module):
    """exp_ on a narrow() view of a fresh tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.abs() + 100.0
        h.narrow(1, 1, 2).exp_()  # FAULT: exp_ through a view
        return h * 1.0


# ------------------------------------------------------------ real-model shapes


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.act = ExpActivation()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"logits": self.act(h), "hidden": h, "count": torch.tensor(3)}


class TupleOut(DictOut):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        h = self.body(x)
        return (h, (self.act(h), torch.tensor(1)))


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    extra: int = 0


class DataclassOut(DictOut):
    def forward(self, x: torch.Tensor) -> Output:  # type: ignore[override]
        h = self.body(x)
        return Output(logits=self.act(h), hidden=h)


def big_body(m: DictOut) -> DictOut:
    seeded(0)
    with torch.no_grad():
        m.body.weight.fill_(50.0)
        m.body.bias.zero_()
    return m


class Tied(nn.Module):
    """``dec`` shares its weight with ``enc`` (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4, bias=False)
        self.dec = nn.Linear(4, 4, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


# ------------------------------------------------------------- more shapes


class RootFunctional(nn.Module):
    """A functional op run by the root module's own forward (no submodule)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(x) * 1000.0)  # FAULT: functional exp in the root


class TwiceSqrt(nn.Module):
    """``norm`` is called twice; only its second call sees exact zeros, so only the
    backward of that call divides by zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = SqrtNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a = self.norm(h.abs() + 1.0)  # call 0: no zeros
        b = self.norm(h)  # call 1: column 0 is exactly zero
        return a + b


def twice_sqrt() -> TwiceSqrt:
    seeded(0)
    m = TwiceSqrt()
    with torch.no_grad():
        m.fc.weight[0].zero_()
        m.fc.bias[0] = 0.0
    return m


class BNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.fc(x)))


class SilentOverflow(nn.Module):
    """exp overflows, then clamp hides it: a silent finding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.exp(x + 200.0), max=1.0)  # FAULT: exp overflow, absorbed


class MaskedSoftmax(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores + mask, dim=-1)


class InplaceMaskAttention(nn.Module):
    """Builds an additive -inf mask *in place* (as ``F._canonical_mask`` does for
    ``nn.MultiheadAttention``) and hands it to a child module. No row is fully masked."""

    def __init__(self, d: int = 8, mask_view: bool = False) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.softmax = MaskedSoftmax()
        self.mask_view = mask_view

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        mask = torch.zeros(keep.shape, dtype=x.dtype)
        mask.masked_fill_(~keep, float("-inf"))
        if self.mask_view:
            mask = mask.unsqueeze(0)  # a view of the in-place-written mask
        w = self.softmax(q @ k.transpose(-2, -1), mask)
        return w @ x


class EmptyThenFill(nn.Module):
    """Allocates with ``torch.empty`` and fills it before any read: nothing non-finite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(x.shape)
        buf.copy_(x)
        return buf * 2.0


class SliceAssign(nn.Module):
    """Writes one column from another: its backward allocates with new_empty_strided."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.clone()
        h[:, 0] = h[:, 1] * 2.0
        return h


class PiecewiseFill(nn.Module):
    """Fills ``torch.empty`` through two slices; every element is written before it is read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], 2 * x.shape[1])
        out[:, : x.shape[1]] = x
        out[:, x.shape[1] :] = x * 2.0
        return out


class MHAModel(nn.Module):
    """nn.MultiheadAttention with an additive float -inf mask built inside the model."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))
        h = self.attn(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]
        return self.head(h)


class TinyLM(nn.Module):
    """Embedding -> 2 causal TransformerEncoder layers -> head."""

    def __init__(self, vocab: int = 11, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.enc(self.emb(ids), mask=causal, src_key_padding_mask=pad)
        return self.head(h)


class Mixed(nn.Module):
    """Integer and empty tensors in and out, next to floating ones."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.emb = nn.Embedding(5, 4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, empty: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.fc(x)[idx] + self.emb(idx) + empty.sum()
        return y, idx * 2, empty * 3.0, torch.empty(0, 4)


class Blocks(nn.Module):
    """``inner`` run through torch.utils.checkpoint (non-reentrant unless asked), then a head."""

    def __init__(self, inner: nn.Module, d_out: int, *, reentrant: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(d_out, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.inner, x, use_reentrant=self.reentrant))


@dataclass
class HFStyleOutput(dict):  # type: ignore[type-arg]
    """Like transformers' ModelOutput: a dataclass that is also a mapping of its non-None fields."""

    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("logits", "hidden_states"):
            value = getattr(self, name)
            if value is not None:
                self[name] = value


class HFStyle(DictOut):
    def forward(self, x: torch.Tensor) -> HFStyleOutput:  # type: ignore[override]
        h = self.body(x)
        return HFStyleOutput(logits=self.act(h), hidden_states=(h,))


class DictModel(nn.Module):
    """HF style: keyword inputs, labels inside the batch, returns {"logits", "loss"}; dropout."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Linear(d, 16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, n)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.drop(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out
