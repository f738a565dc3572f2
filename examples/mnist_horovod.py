"""The seed tutorial's MNIST ConvNet program in Horovod's own API, as the tutorial writes it.

``hvd.init()``, one device per local rank, a ``DistributedSampler`` over ``hvd.size()`` ranks,
``hvd.DistributedOptimizer`` and rank 0's weights broadcast with ``hvd.broadcast_parameters``.
Same model, data (scikit-learn's digits, upsampled to 28x28), seed and hyper-parameters as
``examples/mnist_convnet.py``, which does the same through ``lockstep.Session``. Build Horovod
with ``make horovod``, then::

    horovodrun -np 2 --gloo python examples/mnist_horovod.py --epochs 3
    python examples/mnist_horovod.py --epochs 3          # one process

Test accuracy is exact: each rank scores every ``size``-th test sample (no padding) and the
sums are all-reduced.
"""

from __future__ import annotations

import argparse
import time

import horovod.torch as hvd
import torch
from torch import nn

from mnist_convnet import ConvNet, digits


def evaluate(model: nn.Module, test_set: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float, int]:
    """Mean loss, accuracy and sample count over the whole test set, each rank scoring its share.

    Args:
        model: the model to score.
        test_set: the test set (every sample is scored exactly once over all ranks).
        device: where the model is.

    Example::

        loss, accuracy, count = evaluate(model, test_set, torch.device("cpu"))
    """
    share = torch.utils.data.Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    loader = torch.utils.data.DataLoader(share, batch_size=100)
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    model.eval()
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            outputs = model(images)
            totals[0] += nn.functional.cross_entropy(outputs, labels, reduction="sum").item()
            totals[1] += (outputs.argmax(1) == labels).sum().item()
            totals[2] += len(labels)
    model.train()
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval")
    return float(totals[0] / totals[2]), float(totals[1] / totals[2]), int(totals[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=50, help="per device")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    train_set, test_set = digits()
    model = ConvNet().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0
    )
    train_loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=0,
        pin_memory=device.type == "cuda",
        sampler=train_sampler,
    )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        test_loss, accuracy, count = evaluate(model, test_set, device)
        if hvd.rank() == 0:
            print(
                f"Epoch [{epoch + 1}/{args.epochs}] loss {test_loss:.4f} test accuracy {accuracy:.4f} "
                f"over {count} samples",
                flush=True,
            )
    if hvd.rank() == 0:
        print(f"Training complete in: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
