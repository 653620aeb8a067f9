"""A Lightning Trainer run recorded with one line: a small MLP on synthetic data.

The model is built from its hyper-parameters (saved with save_hyperparameters):
nothing is downloaded. The task: is the sum of the first four features larger than
the sum of the last four? Well under a second per epoch on a CPU.

    python examples/lightning_train.py --epochs 4 --lr 0.01
"""

from __future__ import annotations

import argparse
import logging

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retrolog.integrations.lightning import RetrologCallback

# Lightning's start-up notices (devices, tips) are not this example's output.
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--seed", type=int, default=0)
opts = parser.parse_args()


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 2)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def on_before_optimizer_step(self, optimizer):
        pass

    def on_train_epoch_end(self):
        pass

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return [optimizer], [scheduler]


pl.seed_everything(opts.seed, verbose=False)
train = DataLoader(synthetic(opts.samples, opts.seed), batch_size=opts.batch_size, shuffle=True)
val = DataLoader(synthetic(128, opts.seed + 1), batch_size=64)
trainer = pl.Trainer(
    max_epochs=opts.epochs,
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[RetrologCallback()],
)
trainer.fit(Classifier(opts.hidden, opts.lr), train, val)
