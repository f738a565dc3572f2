"""The seed tutorial's MNIST ConvNet program, written against ``lockstep.Session``.

It trains the tutorial's two-conv-layer ConvNet on scikit-learn's bundled handwritten digits
(1,797 8x8 images, upsampled to the tutorial's 28x28) and reports exact test accuracy over all
ranks. The same file runs unchanged in every way of starting it::

    python examples/mnist_convnet.py --epochs 3                       # one process
    lockstep run --nproc 2 examples/mnist_convnet.py --epochs 3       # 2 processes (DDP)
    torchrun --nproc_per_node 2 examples/mnist_convnet.py --epochs 3  # plain torchrun
    srun -N 2 --ntasks-per-node 4 python examples/mnist_convnet.py    # Slurm
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import lockstep


class ConvNet(nn.Module):
    """The seed tutorial's ConvNet (two conv + BatchNorm + ReLU + max-pool blocks, one linear)."""

    def __init__(self, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        side = image_size // 4
        self.fc = nn.Linear(side * side * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


def digits(size: int = 28) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """scikit-learn's digits as (train, test) tensors of shape (N, 1, size, size), fixed split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:297], order[297:]
    return (torch.utils.data.TensorDataset(x[train], y[train]), torch.utils.data.TensorDataset(x[test], y[test]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=50, help="per device")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--checkpoints", default=None, help="folder to save to and resume from")
    parser.add_argument("--order", default="lockstep", help="data order: lockstep, or torch (DistributedSampler's)")
    args = parser.parse_args()

    session = lockstep.Session(strategy=args.strategy, precision=args.precision, order=args.order)
    train_set, test_set = digits()
    model, optimizer = session.setup(ConvNet(), lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9))
    train = session.loader(train_set, batch_size=args.batch_size, shuffle=True)
    test = session.loader(test_set, batch_size=100, eval=True)
    criterion = nn.CrossEntropyLoss()
    state = lockstep.ResumeState()
    if args.checkpoints:
        state = session.load(args.checkpoints, model=model, optimizer=optimizer)
    start = time.perf_counter()
    for epoch in session.epochs(args.epochs, start=state.epoch):
        model.train()
        for images, labels in session.progress(train):
            loss = criterion(model(images), labels)
            session.backward(loss)
            session.step(optimizer)
        result = lockstep.metrics.evaluate(model, test, session)
        session.print(
            f"Epoch [{epoch + 1}/{args.epochs}] loss {result['loss']:.4f} "
            f"test accuracy {result['accuracy']:.4f} over {result['count']} samples"
        )
        if args.checkpoints:
            session.save(args.checkpoints, model=model, optimizer=optimizer, keep=2)
    session.print(f"Training complete in: {time.perf_counter() - start:.1f} s")
    session.close()


if __name__ == "__main__":
    main()
