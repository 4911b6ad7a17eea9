"""A Lightning script as people write them (``lightning``, or ``pytorch_lightning`` with ``--pytorch-lightning``):
a LightningModule with saved hyper-parameters, a DataLoader, a Trainer from the command line. The module is the
project's model (expnet.py, beside it) made a LightningModule: its ``forward`` applies ``exp`` to fc1's output;
batch ``--bad-step`` holds an input of 200, for which that exp overflows float32 (exp(88.7) is the largest finite
value), so the loss of that step is NaN. nanhunt never edits this file."""

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if "--pytorch-lightning" in sys.argv:  # the older package name, which projects still use
    import pytorch_lightning as L
else:
    import lightning as L

import expnet


class ExpNet(expnet.ExpNet, L.LightningModule):
    def __init__(self, hidden=8, lr=0.05):
        super().__init__(hidden)
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--bad-step", type=int, default=-1)
    parser.add_argument("--pytorch-lightning", action="store_true")
    a = parser.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(48, 4, generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    if a.bad_step >= 0:
        x[a.bad_step * 8] = 200.0
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer = L.Trainer(max_steps=a.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ExpNet(), loader)


if __name__ == "__main__":
    main()
