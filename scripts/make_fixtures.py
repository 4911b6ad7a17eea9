"""Write the bundled capture pairs into fixtures/. Deterministic: re-run to regenerate.

    ./.venv/bin/python scripts/make_fixtures.py

overflow/   TinyTransformer whose blocks.1.ff.wo overflows float16 (not bfloat16), Adam + GradScaler
nan_weight/ MLP with a NaN in fc2.weight
nan_batch/  MLP, finite weights, a NaN in the batch
clean/      MLP, everything finite
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import nanhunt  # noqa: E402
from fixtures.models import LMLoss, MLP, TinyTransformer  # noqa: E402


def _write(name: str, **kw: object) -> None:
    d = os.path.join(ROOT, "fixtures", name)
    os.makedirs(d, exist_ok=True)
    nanhunt.save_capture(os.path.join(d, "checkpoint.pt"), os.path.join(d, "batch.pt"), **kw)  # type: ignore[arg-type]
    sizes = [os.path.getsize(os.path.join(d, f)) for f in ("checkpoint.pt", "batch.pt")]
    print(f"fixtures/{name}: checkpoint {sizes[0]} B, batch {sizes[1]} B")


def overflow() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    with torch.no_grad():
        # T5's wo reached 66246 > 65504 in float16 (transformers issue 5651): same here.
        model.blocks[1].ff.wo.weight.mul_(2e5)
    tokens = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _write("overflow", model=model, batch=(tokens, targets), loss_fn=LMLoss(), optimizer=opt, scaler=scaler,
           model_factory="fixtures.models:TinyTransformer", device_type="cpu", dtype=torch.float16)


def mlp(name: str, *, nan_weight: bool = False, nan_batch: bool = False) -> None:
    torch.manual_seed(1)
    model = MLP()
    x = torch.randn(8, 16)
    y = torch.randn(8, 4)
    if nan_weight:
        with torch.no_grad():
            model.fc2.weight[1, 3] = float("nan")
    if nan_batch:
        x[2, 5] = float("nan")
    _write(name, model=model, batch=(x, y), loss_fn=F.mse_loss, model_factory="fixtures.models:MLP",
           device_type="cpu", dtype=torch.bfloat16)


def main() -> None:
    overflow()
    mlp("nan_weight", nan_weight=True)
    mlp("nan_batch", nan_batch=True)
    mlp("clean")


if __name__ == "__main__":
    main()
