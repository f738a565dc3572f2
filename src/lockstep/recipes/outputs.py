"""What a ``lockstep train`` run leaves in ``--out``: ``config.json``, ``metrics.csv``, TensorBoard events.

Only rank 0 writes. ``metrics.csv`` has one row per finished epoch; a resumed run keeps the rows
of the epochs its checkpoint covers and drops any later ones (an epoch logged but not saved is
trained again, so it would otherwise appear twice). TensorBoard events are written when the
``tensorboard`` package is installed, and silently skipped when it is not. A run stopped for
preemption leaves ``preempted.json`` (its flags, the step and the checkpoint): the same command
run again (a scheduler's requeue) continues it without ``--resume``; a run that finishes removes it.

Example::

    log = RunLog(Path("runs/a"), is_main=True, start_epoch=0)
    log.write_config({"model": "convnet"})
    log.epoch({"epoch": 1, "test_accuracy": 0.97})
    log.close()
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "read_preempted", "METRICS_FILE", "CONFIG_FILE", "PREEMPTED_FILE", "COLUMNS"]

METRICS_FILE = "metrics.csv"
CONFIG_FILE = "config.json"
PREEMPTED_FILE = "preempted.json"
COLUMNS = ("epoch", "step", "train_loss", "test_loss", "test_accuracy", "test_count", "samples_per_s",
           "epoch_time_s", "lr")


class RunLog:
    """Rank 0's record of a run; on other ranks (or without ``out``) every call does nothing.

    Args:
        out: the ``--out`` folder, or ``None`` to write nothing.
        is_main: True on rank 0.
        start_epoch: first epoch this run trains (0-based); rows from it on are dropped.

    Example::

        log = RunLog(None, is_main=True, start_epoch=0)   # writes nothing
    """

    def __init__(self, out: Path | None, is_main: bool, start_epoch: int) -> None:
        self.out = out if is_main else None
        self._tb: Any = None
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._trim(start_epoch)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self._tb = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=start_epoch + 1)

    def _trim(self, start_epoch: int) -> None:
        """Keep the rows of epochs before ``start_epoch`` (1-based epoch column <= start_epoch)."""
        assert self.out is not None
        path = self.out / METRICS_FILE
        rows: list[dict[str, str]] = []
        if path.is_file():
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["epoch"]) <= start_epoch]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    def write_config(self, config: dict[str, Any]) -> None:
        """Write ``config.json`` (the run's flags, resolved defaults and world).

        Args:
            config: JSON-able values.

        Example::

            log.write_config({"model": "convnet", "world_size": 2})
        """
        if self.out is not None:
            (self.out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def epoch(self, row: dict[str, Any]) -> None:
        """Append one epoch's row to ``metrics.csv`` and its scalars to TensorBoard.

        Args:
            row: values for :data:`COLUMNS` (``epoch`` counts from 1).

        Example::

            log.epoch({"epoch": 1, "train_loss": 0.4, "test_accuracy": 0.97})
        """
        if self.out is None:
            return
        with open(self.out / METRICS_FILE, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow({k: row.get(k, "") for k in COLUMNS})
        if self._tb is not None:
            for key in COLUMNS[2:]:
                if isinstance(row.get(key), (int, float)):
                    self._tb.add_scalar(key, row[key], int(row["epoch"]))
            self._tb.flush()

    def preempted(self, config: dict[str, Any], step: int, checkpoint: Path | None) -> None:
        """Leave ``preempted.json``: the run stopped for preemption and its command may be run again.

        Args:
            config: the run's flags (:meth:`~lockstep.recipes.config.TrainConfig.to_dict`).
            step: the global step every rank stopped after.
            checkpoint: the checkpoint saved then.

        Example::

            log.preempted(config.to_dict(), 120, Path("runs/a/checkpoints/step-000120"))
        """
        if self.out is not None:
            body = {"step": step, "checkpoint": None if checkpoint is None else str(checkpoint), "config": config}
            tmp = self.out / (PREEMPTED_FILE + ".tmp")
            tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
            tmp.replace(self.out / PREEMPTED_FILE)

    def finished(self) -> None:
        """The run trained every epoch: remove ``preempted.json`` if an earlier attempt left one.

        Example::

            log.finished()
        """
        if self.out is not None:
            (self.out / PREEMPTED_FILE).unlink(missing_ok=True)

    def close(self) -> None:
        """Close the TensorBoard writer (the CSV file is closed after every row).

        Example::

            log.close()
        """
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_preempted(out: Path) -> dict[str, Any] | None:
    """What ``preempted.json`` in ``out`` says, or ``None`` when the last run there was not preempted.

    Args:
        out: the ``--out`` folder.

    Example::

        read_preempted(Path("runs/a"))    # {"step": 120, "checkpoint": "...", "config": {...}}
    """
    try:
        body = json.loads((out / PREEMPTED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None
