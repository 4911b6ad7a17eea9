"""A GPT training script in the configurator style: module-level defaults, overridden by `--key=value`
arguments through `exec(open('configurator.py').read())`, run from the project folder. The data is a seeded
random token stream; batches are cut at random offsets; one loss per line (float.hex: every bit)."""

import math
import os

import torch

from model import GPT, GPTConfig

# defaults, overridden from the command line or a config file
max_iters = 8
batch_size = 4
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.1
bias = True
learning_rate = 1e-3
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
seed = 1337
out_dir = "out"
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
exec(open("configurator.py").read())
config = {k: globals()[k] for k in config_keys}

torch.manual_seed(seed)
data = torch.randint(0, 96, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=96, dropout=dropout)
model = GPT(GPTConfig(**model_args))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(beta1, beta2),
                              weight_decay=weight_decay)

X, Y = get_batch()
for it in range(max_iters):
    logits, loss = model(X, Y)
    X, Y = get_batch()  # the next batch, fetched while the GPU would be busy
    loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {it} loss {loss.item().hex()}")

os.makedirs(out_dir, exist_ok=True)
torch.save({"model": model.state_dict(), "model_args": model_args, "config": config},
           os.path.join(out_dir, "ckpt.pt"))
