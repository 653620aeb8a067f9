"""An MNIST-style CNN, shaped like the script everyone copies, recorded with retrolog.

argparse flags, ``train()`` and ``test()`` functions called from the epoch loop
in ``main()``, a data loader that shuffles, dropout, Adadelta with a StepLR
schedule. The data are synthetic 28x28 digits (each class a fixed stroke
pattern, shifted and noised per image), so it needs no download and an epoch
takes about half a second on a CPU.

    python examples/mnist_cnn.py --lr 1.0 --epochs 4 --seed 1
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(n, generator):
    """``n`` 28x28 images: each class a fixed random stroke pattern, shifted and noised."""
    patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.8
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = patterns[labels].float()
    shifts = torch.randint(-2, 3, (n, 2), generator=generator)
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            chosen = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            images[chosen] = torch.roll(images[chosen], shifts=(dy, dx), dims=(2, 3))
    images += 0.3 * torch.randn(images.shape, generator=generator)
    return (images - 0.2) / 0.45, labels


def train(args, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(rl.loop("step", train_loader)):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        rl.log("loss", loss.item())
        if batch_idx % args.log_interval == 0:
            print(f"Train epoch {epoch} [{batch_idx * len(data)}] loss {loss.item():.6f}")


def test(model, test_loader):
    model.eval()
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    n = len(test_loader.dataset)
    print(f"Test: average loss {test_loss / n:.4f}, accuracy {correct}/{n}")
    return test_loss / n, correct / n


def main():
    parser = argparse.ArgumentParser(description="MNIST-style CNN on synthetic digits")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch size")
    parser.add_argument("--test-batch-size", type=int, default=256, help="test batch size")
    parser.add_argument("--epochs", type=int, default=4, help="number of epochs")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma")
    parser.add_argument("--seed", type=int, default=1, help="random seed")
    parser.add_argument("--train-size", type=int, default=1024, help="training images")
    parser.add_argument("--log-interval", type=int, default=8, help="batches between prints")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    data = torch.Generator().manual_seed(1000 + args.seed)
    train_x, train_y = synthetic_digits(args.train_size, data)
    test_x, test_y = synthetic_digits(512, data)
    train_loader = DataLoader(
        TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True
    )
    test_loader = DataLoader(TensorDataset(test_x, test_y), batch_size=args.test_batch_size)

    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    with rl.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler):
        for epoch in rl.loop("epoch", range(1, args.epochs + 1)):
            train(args, model, train_loader, optimizer, epoch)
            test_loss, accuracy = test(model, test_loader)
            rl.log("test_loss", test_loss)
            rl.log("accuracy", accuracy)
            scheduler.step()


if __name__ == "__main__":
    main()
