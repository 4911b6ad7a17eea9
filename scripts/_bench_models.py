"""Deterministic benchmark workloads for scripts/bench.py, built from plain torch.

Each workload is a model, one fixed batch and a loss function; ``Workload.step()``
runs one training step exactly as a user's loop would: forward and loss under
``torch.autocast``, a ``GradScaler``-scaled backward, and ``zero_grad``. No
optimizer update: the weights stay the same from one repetition to the next, so
every variant of the benchmark times the very same numerical work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Workload", "GPT", "ConvNet", "make_gpt", "make_convnet", "make_chain", "WORKLOADS", "TrainStep",
           "make_blocks", "make_wide", "make_gpt2", "GPT2_SIZES", "OVERFLOW_GAIN"]


# --------------------------------------------------------------------------- GPT
class CausalSelfAttention(nn.Module):
    """Hand-written attention (no SDPA): the ops a NaN usually comes from are visible."""

    def __init__(self, d_model: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        att = att.masked_fill(self.mask[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 1024, d_model: int = 256, n_heads: int = 4, n_layers: int = 6, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, seq) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------- ConvNet
class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.short(x))


class ConvNet(nn.Module):
    """A small ResNet-like net for 64x64 RGB images: stem, 3 stages of 2 blocks, pool, head."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, 2 * width, 4 * width]
        layers: list[nn.Module] = []
        cin = width
        for i, c in enumerate(chans):
            layers.append(ResBlock(cin, c, 1 if i == 0 else 2))
            layers.append(ResBlock(c, c, 1))
            cin = c
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


# ---------------------------------------------------------------------- workload
@dataclass
class Workload:
    name: str
    desc: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.device_type = torch.device(self.device).type  # autocast and GradScaler take "cuda", not "cuda:0"
        self.scaler = torch.amp.GradScaler(self.device_type)

    def step(self) -> torch.Tensor:
        """One training step; returns the (detached) loss."""
        self.model.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = self.model(self.x)
            loss = self.loss_fn(out, self.y)
        self.scaler.scale(loss).backward()
        return loss.detach()


def _precision(dtype: torch.dtype) -> str:
    return "float32, no autocast" if dtype == torch.float32 else f"autocast {str(dtype)[6:]}"


def _gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_gpt(device: str = "cpu", dtype: torch.dtype = torch.bfloat16, *, batch: int = 8, seq: int = 128,
             vocab: int = 1024, d_model: int = 256, n_heads: int = 4, n_layers: int = 6) -> Workload:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = GPT(vocab, d_model, n_heads, n_layers, seq).to(device).train()
    x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    desc = f"GPT {n_layers}L d{d_model} {n_heads}h seq{seq} batch{batch} vocab{vocab}, {_precision(dtype)}"
    return Workload("gpt", desc, model, x, y, _gpt_loss, dtype, device)


def make_convnet(device: str = "cpu", dtype: torch.dtype = torch.bfloat16, *, batch: int = 16, width: int = 32) -> Workload:
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = ConvNet(width).to(device).train()
    x = torch.randn(batch, 3, 64, 64, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    desc = f"ResNet-like convnet w{width} 64x64 batch{batch}, {_precision(dtype)}"
    return Workload("convnet", desc, model, x, y, F.cross_entropy, dtype, device)


WORKLOADS: dict[str, Callable[..., Workload]] = {"gpt": make_gpt, "convnet": make_convnet}


# ---------------------------------------------------- replay/bisection fixture
class _Cell(nn.Module):
    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A culprit cell scales its input far beyond float16's range (65504) before
        # its matmul: under float16 autocast the product overflows to inf; with the
        # cell kept in float32 it stays finite, and the next LayerNorm brings it back.
        return torch.tanh(self.fc(x * self.gain))


class Chain(nn.Module):
    def __init__(self, n: int, culprit: int, d: int = 32) -> None:
        super().__init__()
        self.cells = nn.ModuleList(_Cell(d, 1e6 if i == culprit else 1.0) for i in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for cell, norm in zip(self.cells, self.norms):
            x = norm(cell(x))
        return x


def make_chain(n_modules: int, device: str = "cpu") -> Workload:
    """N cells, one culprit at about two thirds of the depth, float16 autocast (CPU supports it)."""
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(2)
    culprit = (2 * n_modules) // 3
    model = Chain(n_modules, culprit).to(device).train()
    x = torch.randn(4, 32, generator=g).to(device)
    y = torch.randn(4, 32, generator=g).to(device)
    w = Workload(f"chain{n_modules}", f"chain of {n_modules} cells, culprit cells.{culprit}", model, x, y,
                 F.mse_loss, torch.float16, device)
    w.culprit = f"cells.{culprit}"  # type: ignore[attr-defined]
    return w


# ------------------------------------------------------ replay at scale (issue 20)
class _ResBlock(nn.Module):
    """``norm(x + tanh(fc(x * gain)))``: a culprit block's gain pushes its matmul past the step's number format."""

    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.fc(x * self.gain)))


class Blocks(nn.Module):
    def __init__(self, n: int, culprit: int, gain: float, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_ResBlock(d, gain if i == culprit else 1.0) for i in range(n)))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


# float16 overflows past 65504, float32 past 3.4e38: the planted gain overflows the step's own format
# (under float32 the culprit's overflow is no precision problem: the float32 control fails too).
OVERFLOW_GAIN = {torch.float16: 1e6, torch.float32: 1e39}


@dataclass
class TrainStep:
    """A whole training step as a user's loop runs it: ``zero_grad``, forward and loss under autocast
    (``dtype``; float32: no autocast), GradScaler-scaled backward, ``scaler.step(optimizer)`` (AdamW) and
    ``scaler.update()``. ``batch`` is ``(x, y)`` with ``loss_fn`` or a dict of keyword arguments whose
    model output has ``.loss`` (transformers)."""

    name: str
    desc: str
    model: nn.Module
    batch: object
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    dtype: torch.dtype
    culprit: str
    device: str = "cpu"
    plant: Callable[[], None] | None = None  # puts the culprit in (after prime)

    def __post_init__(self) -> None:
        self.device_type = torch.device(self.device).type
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(self.device_type)

    def forward_loss(self) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            if isinstance(self.batch, dict):
                return self.model(**self.batch).loss  # type: ignore[no-any-return]
            assert self.loss_fn is not None
            x, y = self.batch  # type: ignore[misc]
            return self.loss_fn(self.model(x), y)

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def forward_backward(self) -> torch.Tensor:
        """The step without the update (the op-level cost figures: the same work every repetition)."""
        self.model.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        self.scaler.scale(loss).backward()
        return loss.detach()

    def prime(self) -> TrainStep:
        """Optimizer state as mid-training (steps until two updated, the GradScaler's scale settled), then
        the culprit planted and no ``.grad``: the replay snapshots and restores moments as large as the
        weights, and only the culprit makes the step non-finite."""
        updated = 0
        for _ in range(20):
            scale = self.scaler.get_scale()
            self.step()
            updated += self.scaler.get_scale() >= scale  # the scale shrinks when a step is skipped
            if updated == 2:
                break
        self.optimizer.zero_grad(set_to_none=True)
        if self.plant is not None:
            self.plant()
        return self


def make_blocks(n: int, device: str = "cpu", dtype: torch.dtype = torch.float16, d: int = 32, batch: int = 4) -> TrainStep:
    """N residual blocks, a culprit at two thirds of the depth whose gain overflows ``dtype``."""
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    culprit = (2 * n) // 3
    model = Blocks(n, culprit, 1.0, d).to(device).train()
    x = torch.randn(batch, d, generator=g).to(device)
    y = torch.randn(batch, d, generator=g).to(device)
    return TrainStep(f"blocks{n}", f"{n} residual blocks (Linear {d}x{d} + LayerNorm), batch {batch}, culprit "
                     f"blocks.{culprit} (gain {OVERFLOW_GAIN[dtype]:g})", model, (x, y), F.mse_loss, dtype,
                     f"blocks.{culprit}", device, _gain(model.blocks[culprit], OVERFLOW_GAIN[dtype]))


def _gain(block: nn.Module, gain: float) -> Callable[[], None]:
    def plant() -> None:
        block.gain = gain

    return plant


def make_wide(device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int = 8, d: int = 2048) -> TrainStep:
    """The parameter-heavy model of issue 20: ``layers`` x Linear(d, d), batch 4; weights and AdamW
    moments are most of the footprint, activations almost nothing."""
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(4)
    culprit = layers - 3
    model = Blocks(layers, culprit, 1.0, d).to(device).train()
    x = torch.randn(4, d, generator=g).to(device)
    y = torch.randn(4, d, generator=g).to(device)
    return TrainStep(f"wide{layers}x{d}", f"{layers} x Linear({d}, {d}) residual blocks, batch 4, culprit "
                     f"blocks.{culprit}", model, (x, y), F.mse_loss, dtype, f"blocks.{culprit}", device,
                     _gain(model.blocks[culprit], OVERFLOW_GAIN[dtype]))


GPT2_SIZES = {
    # name: (config, batch, seq)
    "tiny": (dict(vocab_size=1024, n_positions=64, n_embd=64, n_layer=2, n_head=2), 8, 64),
    "23M": (dict(vocab_size=8192, n_positions=128, n_embd=512, n_layer=6, n_head=8), 2, 64),
}


def make_gpt2(size: str = "tiny", device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
              culprit: bool = False) -> TrainStep:
    """transformers' GPT2LMHeadModel from a config built here (nothing downloaded), eager attention,
    dropout as configured by default. ``culprit``: block 1's MLP input projection scaled (1e6; float32:
    1e39) so that its matmul overflows ``dtype``."""
    from transformers import GPT2Config, GPT2LMHeadModel  # type: ignore[import-not-found]
    from transformers.utils import logging as hf_logging  # type: ignore[import-not-found]

    hf_logging.set_verbosity_error()
    cfg_kw, batch, seq = GPT2_SIZES[size]
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)
    cfg = GPT2Config(**cfg_kw, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).to(device).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    name = "transformer.h.1.mlp.c_fc"

    def plant() -> None:
        with torch.no_grad():
            w = model.get_submodule(name).weight
            # float32: 1e39 is past float32's range as a scalar itself; two steps keep the weights finite
            w.mul_(1e6) if dtype != torch.float32 else w.mul_(1e20).mul_(1e19)

    n = sum(p.numel() for p in model.parameters())
    desc = (f"transformers GPT-2 {size} ({n / 1e6:.2f} M params, {cfg.n_layer} layers, d{cfg.n_embd}), batch {batch}, "
            f"seq {seq}" + (f", culprit {name} weight scaled" if culprit else ""))
    return TrainStep(f"gpt2-{size}", desc, model, {"input_ids": ids, "labels": ids}, None, dtype, name, device,
                     plant if culprit else None)
