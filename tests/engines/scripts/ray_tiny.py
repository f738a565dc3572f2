"""tiny_train.py's job on Ray Train's ``TorchTrainer`` (2 CPU workers of a local Ray cluster), so
that its final weights can be compared with the one-host run's bit for bit::

    python tests/engines/scripts/ray_tiny.py --storage /tmp/ray-tiny -- --epochs 6 --result c.json

Each worker runs ``tiny_train.train`` in a session that adopts the process group Ray formed
(``lockstep.integrations.ray.ray_session``); the flags after ``--`` are tiny_train.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent)


def loop(config: dict[str, Any]) -> None:
    """One Ray worker: tiny_train's job in a session over Ray's group."""
    sys.path.insert(0, config["scripts"])
    import tiny_train

    from lockstep.integrations import ray as lockstep_ray

    tiny_train.train(lockstep_ray.ray_session(strategy="auto", seed=0), tiny_train.parse(config["argv"]))


def main() -> None:
    """Start a local Ray cluster, fit once, shut it down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", required=True, help="Ray Train's storage folder")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then tiny_train.py's flags")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=max(2, args.workers), include_dashboard=False)
    try:
        TorchTrainer(
            loop,
            train_loop_config={"scripts": HERE, "argv": argv},
            torch_config=TorchConfig(backend="gloo", timeout_s=300),
            scaling_config=ScalingConfig(num_workers=args.workers),
            run_config=RunConfig(name="lockstep-tiny", storage_path=os.path.abspath(args.storage)),
        ).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
