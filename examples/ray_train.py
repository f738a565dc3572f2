"""Train with Ray Train's ``TorchTrainer`` and lockstep: Ray starts and places the workers and forms
their process group; lockstep runs the data-parallel loop and writes the checkpoints.

    pip install 'lockstep[ray]'
    python examples/ray_train.py                          # a local Ray cluster with 2 CPU workers
    python examples/ray_train.py --workers 4 --gpu        # one GPU per worker
    RAY_ADDRESS=auto python examples/ray_train.py         # the Ray cluster this machine belongs to

It fits twice, as a job that is stopped and started again would: first ``--first-epochs``
epochs, then a second ``TorchTrainer`` of the same run (same name and storage) trains up to
``--epochs``, resuming from the last checkpoint Ray keeps for the run (copied into an empty
worker folder). The last line says where the second fit resumed and where it ended.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

import lockstep


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: a lockstep session on Ray's process group, checkpoints reported to Ray.

    Args:
        config: ``epochs`` (train up to this epoch) and ``folder`` (the worker's checkpoint folder).

    Example::

        TorchTrainer(train_loop_per_worker, train_loop_config={"epochs": 2, "folder": "ckpt"}).fit()
    """
    from lockstep.integrations import ray as lockstep_ray

    session = lockstep_ray.ray_session(strategy="auto", seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    model, optimizer = session.setup(torch.nn.Linear(8, 1), lambda p: torch.optim.SGD(p, lr=0.05))
    train = session.loader(data, batch_size=32, shuffle=True)
    test = session.loader(data, batch_size=128, eval=True)
    state = lockstep_ray.resume(session, config["folder"], model=model, optimizer=optimizer)
    for epoch in session.epochs(config["epochs"], start=state.epoch):
        for inputs, targets in train:
            session.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            session.step(optimizer)
        result = lockstep.metrics.evaluate(model, test, session, loss_fn=torch.nn.functional.mse_loss)
        metrics = {
            "epoch": epoch,
            "step": session.global_step,
            "mse": result["loss"],
            "world_size": session.world_size,
            "resumed_step": state.step,
        }
        lockstep_ray.report(session, metrics, folder=config["folder"], model=model, optimizer=optimizer, keep=2)
    session.close()


def fit(args: argparse.Namespace, epochs: int, attempt: int) -> Any:
    """Run one ``TorchTrainer`` fit of the run up to ``epochs`` epochs; returns Ray's ``Result``.

    A fit of a run Ray has checkpoints for starts from its latest one (``ray.train.get_checkpoint``).

    Args:
        args: the command line (``workers``, ``gpu``, ``storage``).
        epochs: train up to this epoch.
        attempt: numbers the worker checkpoint folder, empty at each fit.

    Example::

        result = fit(args, epochs=2, attempt=1)
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"epochs": epochs, "folder": str(Path(args.storage) / f"worker-checkpoints-{attempt}")},
        torch_config=TorchConfig(backend="nccl" if args.gpu else "gloo", timeout_s=300),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(name="lockstep-ray-train", storage_path=args.storage),
    )
    return trainer.fit()


def main() -> None:
    """Start (or join) a Ray cluster, fit, fit again from the checkpoint, print the outcome."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default 2)")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--epochs", type=int, default=4, help="epochs in total (default 4)")
    parser.add_argument("--first-epochs", type=int, default=2, help="epochs of the first fit (default 2)")
    parser.add_argument("--storage", default=None, help="Ray's storage folder (default: a temporary one)")
    args = parser.parse_args()
    import ray

    args.storage = os.path.abspath(args.storage or tempfile.mkdtemp(prefix="lockstep-ray-"))
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # the cluster named there
    else:
        ray.init(num_cpus=max(2, args.workers), include_dashboard=False)  # a local cluster
    try:
        first = fit(args, args.first_epochs, attempt=1)
        print(
            f"ray_train: first fit ended at epoch {first.metrics['epoch']} step {first.metrics['step']}, "
            f"checkpoint {first.checkpoint.path}",
            flush=True,
        )
        second = fit(args, args.epochs, attempt=2)
        m = second.metrics
        print(
            f"ray_train: second fit resumed at step {m['resumed_step']} and ended at epoch {m['epoch']} "
            f"step {m['step']}, world size {m['world_size']}, mse {m['mse']:.6f}",
            flush=True,
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
