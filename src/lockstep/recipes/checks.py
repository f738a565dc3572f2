"""The checks of a ``lockstep train`` run outside its flags: ``--out`` is writable and no other live
job's, and the data opens and suits the run. They run in the launching process, before any worker.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sized
from pathlib import Path
from typing import Any, cast

from lockstep.errors import ConfigError
from lockstep.recipes.config import CHECKPOINTS, TrainConfig, is_url

__all__ = ["check_out", "check_data"]


def check_out(config: TrainConfig) -> Any | None:
    """Check that ``--out`` can be written (a probe file) and, on node 0, hold it for this command.

    Node 0's launcher takes ``--out`` first, then looks whether a live job that is not a
    ``lockstep train`` (a Session loop, say) holds its checkpoints. Of two commands started together,
    one takes ``--out`` and the other is told so; their looks at the checkpoints cannot meet.

    Args:
        config: the run's configuration.

    Returns:
        The held ``--out`` lock (release it when the job ends), or ``None`` where this command holds
        nothing: an object-store ``--out``, no ``--out``, or a node other than 0.

    Raises:
        ConfigError: ``--resume`` on a folder with no run, a folder that cannot be written, or one in use.
    """
    from lockstep.recipes.outputs import hold_out

    if config.out is None:
        return None
    if is_url(config.out):
        if config.node_rank == 0:
            _try_lock(f"{config.out}/{CHECKPOINTS}", config.out)
        return None
    out = Path(config.out)
    if config.resume and not _holds_a_run(out):
        raise ConfigError(
            f"--resume: {out} holds no run (no checkpoints, no config.json); check the folder's name, "
            "or drop --resume to start a new run there"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".lockstep-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"--out {out}: cannot write there ({exc.strerror or exc}); choose a writable folder"
        ) from None
    if config.node_rank != 0:
        return None  # the folder is node 0's to hold; on a shared file system the other nodes'
        # launchers would find node 0's hold and refuse their own job
    held = hold_out(out)  # another lockstep train's launcher holds it: named by its --out
    try:
        _try_lock(out / CHECKPOINTS, out)
    except BaseException:
        held.release()
        raise
    return held


def _holds_a_run(out: Path) -> bool:
    """``out`` has a run's checkpoints or its ``config.json`` (a run stopped before its first checkpoint)."""
    from lockstep.recipes.outputs import CONFIG_FILE

    ckpts = out / CHECKPOINTS
    return (out / CONFIG_FILE).is_file() or (ckpts.is_dir() and any(ckpts.iterdir()))


def _try_lock(checkpoints: str | Path, out: str | Path) -> None:
    """Take and release the checkpoints' lock: refused at once when a live job holds them."""
    from lockstep.checkpoint import CheckpointError, lock_folder
    from lockstep.comm.group import Comm
    from lockstep.env import World

    try:
        lock_folder(checkpoints, Comm(World())).release()
    except CheckpointError as exc:
        raise ConfigError(f"--out {out}: {exc}") from None


def check_data(config: TrainConfig, world_size: int) -> Any:
    """Open the data (checking folders and images) and check the batch against each process's share.

    Args:
        config: the run's configuration.
        world_size: processes in the job.

    Returns:
        The :class:`~lockstep.zoo.datasets.ImageData`.

    Raises:
        ConfigError: unreadable data, or a per-device batch larger than a process's share.
    """
    from lockstep.zoo.datasets import native_channels, open_data, parse_data
    from lockstep.zoo.models import input_channels

    spec = parse_data(config.data)
    channels = input_channels(config.model, native_channels(spec))
    data = open_data(spec, config.input_size, channels, val_fraction=config.val_fraction)
    size = len(cast(Sized, data.train))
    shard = size // world_size
    if config.batch_size > shard:
        raise ConfigError(
            f"--batch-size {config.batch_size} (per device) is larger than each process's share of the "
            f"training set ({size} samples / {world_size} processes = {shard}); "
            f"use --batch-size {max(shard, 1)} or less, or fewer processes"
        )
    return data
