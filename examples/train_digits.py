"""A small, real PyTorch training script recorded with retrolog.

An MLP with dropout learns scikit-learn's 8x8 digits (shipped with
scikit-learn, no download), with shuffled mini-batches and a step LR schedule.

    python examples/train_digits.py --kwargs lr=0.05 epochs=5
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
epochs = rl.arg("epochs", 5)
batch_size = rl.arg("batch_size", 64)
hidden = rl.arg("hidden", 64)

torch.manual_seed(cli.seed)
np.random.seed(cli.seed)
random.seed(cli.seed)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target, dtype=torch.long)
order = torch.randperm(len(x))
train_idx, test_idx = order[:1400], order[1400:]
train = DataLoader(TensorDataset(x[train_idx], y[train_idx]), batch_size=batch_size, shuffle=True)

net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 10))
optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
loss_fn = nn.CrossEntropyLoss()


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
            loss = loss_fn(net(xb), yb)
            loss.backward()
            optimizer.step()
            rl.log("loss", loss.item())
        scheduler.step()
        rl.log("acc", accuracy(x[test_idx], y[test_idx]))

rl.log("test_acc", accuracy(x[test_idx], y[test_idx]))
