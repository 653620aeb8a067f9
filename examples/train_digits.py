"""A small, real PyTorch training script recorded with retrolog.

An MLP with dropout learns scikit-learn's 8x8 digits (shipped with
scikit-learn, no download), with shuffled mini-batches augmented on the fly
(a random one-pixel shift and noise per batch, drawn from torch's generator)
and a step LR schedule. An epoch takes a fraction of a second on a CPU.

    python examples/train_digits.py --kwargs lr=0.05 epochs=6 --seed 1
"""

import argparse
import random

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--seed", type=int, default=0, help="seed for torch, numpy and random")
cli = parser.parse_args()  # the script's own flags still work beside --kwargs

lr = rl.arg("lr", 0.05)
epochs = rl.arg("epochs", 6)
batch_size = rl.arg("batch_size", 32)
hidden = rl.arg("hidden", 256)

torch.manual_seed(cli.seed)
np.random.seed(cli.seed)
random.seed(cli.seed)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target, dtype=torch.long)
order = torch.randperm(len(x))
train_idx, test_idx = order[:1400], order[1400:]
# An epoch sees each training image 16 times, each time shifted and noised differently.
train_x, train_y = x[train_idx].repeat(16, 1), y[train_idx].repeat(16)
train = DataLoader(TensorDataset(train_x, train_y), batch_size=batch_size, shuffle=True)

net = nn.Sequential(
    nn.Linear(64, hidden),
    nn.ReLU(),
    nn.Dropout(0.2),
    nn.Linear(hidden, hidden),
    nn.ReLU(),
    nn.Linear(hidden, 10),
)
optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
loss_fn = nn.CrossEntropyLoss()


def augment(batch: torch.Tensor) -> torch.Tensor:
    """Shift the 8x8 images by up to a pixel and add a little noise."""
    images = batch.view(-1, 8, 8)
    dy, dx = torch.randint(-1, 2, (2,)).tolist()
    images = torch.roll(images, shifts=(dy, dx), dims=(1, 2))
    return (images + 0.05 * torch.randn_like(images)).view(-1, 64)


def accuracy(inputs: torch.Tensor, labels: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        correct = (net(inputs).argmax(dim=1) == labels).float().mean().item()
    net.train()
    return correct


with rl.checkpointing(model=net, optimizer=optimizer):
    for epoch in rl.loop("epoch", range(epochs)):
        for xb, yb in rl.loop("step", train):
            optimizer.zero_grad()
            loss = loss_fn(net(augment(xb)), yb)
            loss.backward()
            optimizer.step()
            rl.log("loss", loss.item())
        scheduler.step()
        rl.log("acc", accuracy(x[test_idx], y[test_idx]))

rl.log("test_acc", accuracy(x[test_idx], y[test_idx]))
