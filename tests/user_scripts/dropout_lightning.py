"""A Lightning script as people write them: ``seed_everything(seed)``, a LightningModule with dropout, a dataset
whose ``__getitem__`` adds noise from NumPy's global generator and flips a sample at Python's ``random``'s whim,
a shuffled DataLoader, a Trainer from the command line. It prints each step's loss (``float.hex``: every bit, or
``nan``) and saves the module's weights at the end (``--weights``). ``--lr 1e5`` makes the run blow up within a
few steps. nanhunt never edits this file."""

import argparse
import math
import random
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

if "--pytorch-lightning" in sys.argv:  # the older package name, which projects still use
    import pytorch_lightning as L
else:
    import lightning as L


class Noisy(Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + torch.from_numpy(np.random.normal(0.0, 0.1, 8).astype(np.float32))
        if random.random() < 0.5:
            x = x.flip(0)
        return x, self.y[i]


class Classifier(L.LightningModule):
    def __init__(self, hidden=32, dropout=0.3, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 3))
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weights", default="weights.pt")
    parser.add_argument("--pytorch-lightning", action="store_true")
    a = parser.parse_args()
    L.seed_everything(a.seed, verbose=False)
    model = Classifier(lr=a.lr)
    loader = DataLoader(Noisy(), batch_size=8, shuffle=True)
    trainer = L.Trainer(max_steps=a.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model, loader)
    finally:
        for step, loss in enumerate(model.losses):
            print(f"step {step} loss {loss.hex() if math.isfinite(loss) else loss}", flush=True)
    torch.save(model.state_dict(), a.weights)


if __name__ == "__main__":
    main()
