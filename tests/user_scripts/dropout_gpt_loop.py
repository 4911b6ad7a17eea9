"""A nanoGPT-style training loop with dropout, as people write them: a small GPT defined in the script, batches
cut at random offsets of a token stream (NumPy's global generator picks the offsets, torch's draws the dropout
masks), AdamW, one loss printed per step (``float.hex``: every bit) and the weights saved at the end
(``--out``). ``--lr 1e5`` makes the run blow up within a few steps. nanhunt never edits this file."""

import argparse
import math
import random

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--out", default="weights.pt")
args = parser.parse_args()

block_size, vocab_size, n_embd = 16, 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, 2, dropout=args.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(args.dropout))

    def forward(self, x):
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1))
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))


def get_batch(data, batch_size=4):
    ix = np.random.randint(0, len(data) - block_size - 1, size=batch_size)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


def main():
    torch.manual_seed(1337)
    np.random.seed(1337)
    random.seed(1337)
    data = np.random.randint(0, vocab_size, size=2000).astype(np.uint16)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step in range(args.steps):
        x, y = get_batch(data)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        print(f"step {step} loss {value.hex() if math.isfinite(value) else value}", flush=True)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
