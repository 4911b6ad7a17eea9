"""Tiny models, batches and the step helpers of tests/real.

Every model is built from code with seeded random weights (nothing downloaded). The classes and the
zero-argument factories live here, at module level, so a capture can name them for ``nanhunt replay``
(``tests.real.builders:NormMLP``; the HF factories are functions, confirmed with ``--model``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt.cli import main
from nanhunt.records import Occurrence, Report

ROOT = Path(__file__).resolve().parents[2]
F16_MAX = 65504.0


# ---------------------------------------------------------------- what a finding says


def where(occ: Occurrence | None) -> tuple[object, ...] | None:
    """(phase, module, op, call index, kind) of a finding."""
    return None if occ is None else (occ.phase, occ.module, occ.op, occ.call_index, occ.kind)


# ---------------------------------------------------------------- the step, as users write it


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def amp_step(model: nn.Module, inputs: Any, targets: Any = None, *, loss_fn: Callable[..., Any] | None = None,
             scaler: torch.amp.GradScaler | None = None, optimizer: torch.optim.Optimizer | None = None,
             dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Forward and loss under CPU autocast (none for ``dtype=torch.float32``), (scaled) backward, and the update
    when there is an optimizer."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = call(model, inputs)
        loss = loss_fn(out, targets) if loss_fn is not None else out.loss
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if optimizer is not None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return loss


def traced(model: nn.Module, inputs: Any, targets: Any = None, **kw: Any) -> nanhunt.Trace:
    with nanhunt.trace(model) as t:
        amp_step(model, inputs, targets, **kw)
    return t


def replayed(model: nn.Module, inputs: Any, targets: Any = None, *, loss_fn: Callable[..., Any] | None = None,
             scaler: torch.amp.GradScaler | None = None, optimizer: torch.optim.Optimizer | None = None,
             dtype: torch.dtype = torch.float16) -> Report:
    return nanhunt.replay(model, (inputs, targets), loss_fn=loss_fn, dtype=dtype, scaler=scaler,
                          optimizer=optimizer, bisect=True)


def fp32_io(model: nn.Module, name: str, inputs: Any) -> tuple[float, float, float]:
    """Largest |x| of module ``name``'s weight, and of its first call's input and output, in a float32
    forward: the premise of a float16 overflow planted there."""
    mod = dict(model.named_modules())[name]
    seen: dict[str, float] = {}

    def hook(_m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen.setdefault("in", float(args[0].detach().abs().max()))
        seen.setdefault("out", float(out.detach().abs().max()))

    h = mod.register_forward_hook(hook)
    try:
        with torch.no_grad():
            call(model, inputs)
    finally:
        h.remove()
    return float(mod.weight.detach().abs().max()), seen["in"], seen["out"]


def assert_overflows_only_in_fp16(model: nn.Module, name: str, inputs: Any) -> None:
    """The planted fault is what the test says: weight and input fit float16, the float32 output does not."""
    w, x, y = fp32_io(model, name, inputs)
    assert w < F16_MAX and x < F16_MAX, (w, x)
    assert y > 1.2 * F16_MAX, y


def scale_weight(model: nn.Module, name: str, factor: float) -> None:
    with torch.no_grad():
        dict(model.named_modules())[name].weight.mul_(factor)


def cli_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, model: nn.Module, batch: Any,
               loss_fn: Any = None, optimizer: torch.optim.Optimizer | None = None,
               scaler: torch.amp.GradScaler | None = None, model_factory: str | None = None,
               dtype: torch.dtype = torch.float16, args: Sequence[str] = ()) -> tuple[int, Report]:
    """save_capture, then ``nanhunt replay checkpoint.pt batch.pt --report report.json`` in this process, run
    from an unrelated directory with the repository on PYTHONPATH (as a user with the project installed)."""
    ck, bt, out = tmp_path / "checkpoint.pt", tmp_path / "batch.pt", tmp_path / "report.json"
    nanhunt.save_capture(ck, bt, model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer, scaler=scaler,
                         model_factory=model_factory, dtype=dtype)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    rc = main(["replay", str(ck), str(bt), "--report", str(out), *args])
    return rc, Report.from_json(out.read_text())


# ---------------------------------------------------------------- plain torch models


class NormMLP(nn.Module):
    """fc1 -> ReLU -> fc2 -> LayerNorm -> head: the norm after fc2 keeps a float32 fc2's huge output (and its
    gradients) in range, as a transformer's pre-LN residual does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc2(self.act(self.fc1(x)))))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MHANet(nn.Module):
    """Embedding -> nn.MultiheadAttention (key padding mask, optional additive mask) -> head."""

    def __init__(self, need_weights: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)
        self.need_weights = need_weights

    def forward(self, ids: torch.Tensor, key_padding_mask: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)
        y, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                         need_weights=self.need_weights)
        return self.head(y).flatten(0, 1)


class EncNet(nn.Module):
    """Embedding -> nn.TransformerEncoderLayer (src_key_padding_mask) -> head; logits flattened for cross_entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=pad)).flatten(0, 1)


class CTCNet(nn.Module):
    """Frames (T, B, 8) -> log-probabilities over 5 classes (0 is the blank), as nn.CTCLoss takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x))).log_softmax(-1)


_CTC = nn.CTCLoss()


def ctc_loss(log_probs: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """nn.CTCLoss() on (labels, input_lengths, target_lengths)."""
    labels, input_lengths, target_lengths = targets
    return _CTC(log_probs, labels, input_lengths, target_lengths)


def gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seq_batch(vocab: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (2, 8), key padding mask (sample 1: last two positions padded), flattened targets."""
    g = gen()
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    y = torch.randint(0, classes, (2, 8), generator=g).flatten()
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 6:] = True
    return ids, pad, y


# ---------------------------------------------------------------- transformers (tiny configs, from code)


def lm_batch(vocab: int = 64) -> dict[str, torch.Tensor]:
    """input_ids (2, 8), attention_mask with sample 1's last two tokens padded, labels -100 on the padding."""
    ids = torch.randint(1, vocab, (2, 8), generator=gen())
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _gpt2(attn: str) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation=attn)
    return GPT2LMHeadModel(cfg).train()


def gpt2_eager() -> Any:
    return _gpt2("eager")


def gpt2_sdpa() -> Any:
    return _gpt2("sdpa")


def t5() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg).train()


def t5_batch() -> dict[str, torch.Tensor]:
    g = gen()
    ids = torch.randint(2, 32, (2, 8), generator=g)
    labels = torch.randint(2, 32, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train()


def bert() -> Any:
    """BertForSequenceClassification, sdpa attention, activation checkpointing on."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     num_labels=3, initializer_range=0.2, attn_implementation="sdpa")
    m = BertForSequenceClassification(cfg)
    m.gradient_checkpointing_enable()
    return m.train()


def bert_batch() -> dict[str, torch.Tensor]:
    b = lm_batch()
    return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "labels": torch.tensor([0, 2])}


def vit() -> Any:
    """ViTForImageClassification on 8x8 images, eager attention, activation checkpointing on."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager")
    m = ViTForImageClassification(cfg)
    m.gradient_checkpointing_enable()
    return m.train()


def vit_batch() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=gen()), "labels": torch.tensor([1, 2])}

