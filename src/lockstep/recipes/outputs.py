"""What a ``lockstep train`` run leaves in ``--out``: ``config.json``, ``metrics.csv``, TensorBoard events.

Only rank 0 writes. A resumed run drops the ``metrics.csv`` rows after its checkpoint's epoch (that
epoch is trained again). A run stopped for preemption leaves ``preempted.json``; one that finishes removes it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lockstep.errors import ConfigError
from lockstep.loggers import CSVLogger, Logger, TensorBoardLogger

__all__ = [
    "RunLog",
    "read_preempted",
    "epochs_done",
    "newest_intact",
    "hold_out",
    "refuse_if_in_use",
    "tensorboard_logger",
    "CHECKPOINTS",
    "METRICS_FILE",
    "CONFIG_FILE",
    "PREEMPTED_FILE",
    "TENSORBOARD_DIR",
    "COLUMNS",
]

CHECKPOINTS = "checkpoints"
METRICS_FILE = "metrics.csv"
CONFIG_FILE = "config.json"
PREEMPTED_FILE = "preempted.json"
TENSORBOARD_DIR = "tensorboard"
COLUMNS = (
    "epoch",
    "step",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "test_count",
    "samples_per_s",
    "epoch_time_s",
    "lr",
    "resumed_at_batch",
)
"""``metrics.csv``'s columns; ``resumed_at_batch`` is the batch an epoch continued from after a resume
(its ``train_loss`` covers the batches from there on), 0 for a whole epoch."""
_SCALARS = COLUMNS[2:-1]  # the curves TensorBoard shows


def tensorboard_logger(directory: Path, say: Callable[[str], None] | None) -> TensorBoardLogger | None:
    """A TensorBoard logger for ``directory``, or ``None`` (saying so) when tensorboard is not installed."""
    try:
        return TensorBoardLogger(directory)
    except ConfigError as exc:  # optional for lockstep train: metrics.csv holds the same numbers
        if say is not None:
            say(f"lockstep train: no TensorBoard events: {exc}")
        return None


class RunLog:
    """Rank 0's record of a run; on other ranks (or without ``out``) every call does nothing."""

    def __init__(
        self, out: Path | None, is_main: bool, start_epoch: int, say: Callable[[str], None] | None = None
    ) -> None:
        self.out = out if is_main else None
        self._loggers: list[Logger] = []
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._csv = CSVLogger(self.out, METRICS_FILE, columns=COLUMNS, step_column="epoch")
        self._tb = tensorboard_logger(self.out / TENSORBOARD_DIR, say)
        self._loggers = [self._csv] + ([self._tb] if self._tb is not None else [])
        for logger in self._loggers:
            logger.resume_at(start_epoch + 1)  # epochs count from 1 in the files
        self._csv.log({}, start_epoch)  # opens the file now: the rows a resumed run trains again are gone
        if say is not None:
            say(
                f"lockstep train: writing {METRICS_FILE}, config.json, checkpoints"
                f"{' and TensorBoard events' if self._tb is not None else ''} to {self.out.resolve()}"
            )

    def write_config(self, config: dict[str, Any]) -> None:
        """Write ``config.json`` (the run's flags, resolved defaults and world)."""
        if self.out is not None:
            (self.out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def epoch(self, row: dict[str, Any]) -> None:
        """Append one epoch's row to ``metrics.csv`` and its scalars to TensorBoard."""
        if self.out is None:
            return
        epoch = int(row["epoch"])
        self._csv.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, epoch)
        if self._tb is not None:
            self._tb.log({k: row[k] for k in _SCALARS if isinstance(row.get(k), (int, float))}, epoch)
            self._tb.flush()

    def preempted(self, config: dict[str, Any], step: int, checkpoint: Path | None) -> None:
        """Leave ``preempted.json``: the run stopped for preemption and its command may be run again."""
        if self.out is not None:
            body = {"step": step, "checkpoint": None if checkpoint is None else str(checkpoint), "config": config}
            tmp = self.out / (PREEMPTED_FILE + ".tmp")
            tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
            tmp.replace(self.out / PREEMPTED_FILE)

    def finished(self) -> None:
        """The run trained every epoch: remove ``preempted.json`` if an earlier attempt left one."""
        if self.out is not None:
            (self.out / PREEMPTED_FILE).unlink(missing_ok=True)

    def close(self) -> None:
        """Close the loggers. Safe to call twice."""
        for logger in self._loggers:
            logger.close()


def read_preempted(out: Path) -> dict[str, Any] | None:
    """What ``preempted.json`` in ``out`` says, or ``None`` when the last run there was not preempted."""
    try:
        body = json.loads((out / PREEMPTED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def epochs_done(out: Path) -> int | None:
    """The epochs the newest checkpoint in ``out`` covers, when ``metrics.csv``'s last row was written
    at that checkpoint's step (its epoch's end); ``None`` when that cannot be told without loading it."""
    import csv

    from lockstep.checkpoint import CheckpointError, latest_checkpoint, read_manifest

    newest = latest_checkpoint(out / CHECKPOINTS)
    try:
        with (out / METRICS_FILE).open(newline="") as f:
            rows = list(csv.DictReader(f))
        step = read_manifest(newest).get("step") if newest is not None else None
        last = rows[-1] if rows else {}
        done = int(last["epoch"]) if step is not None and int(last.get("step", -1)) == step else None
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None
    return done


def newest_intact(out: Path) -> bool:
    """Whether every file of the newest checkpoint in ``out`` matches its manifest (size and hash).

    A finished run's newest checkpoint is checked before ``--resume`` says there is nothing to train:
    when it is corrupt, the workers resume from the one before and train its epoch again.
    """
    from lockstep.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint

    newest = latest_checkpoint(out / CHECKPOINTS)
    if newest is None:
        return False
    try:
        verify_checkpoint(newest)
    except CheckpointError as exc:
        print(f"lockstep train: warning: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def refuse_if_in_use(out: Path) -> None:
    """Refuse ``out`` while another ``lockstep train`` holds it (a look: nothing is taken).

    Raises:
        ConfigError: in use; the message names the holder's host and pid.
    """
    from lockstep.checkpoint.lock import holder

    who = holder(out)
    if who is not None:
        raise _in_use(out, who)


def hold_out(out: Path) -> Any:
    """Hold run folder ``out`` for this command until the returned lock's ``release`` (or the process ends).

    The launcher holds it for the whole job, restarts included; rank 0 also holds the checkpoint
    folder inside it (``lockstep.checkpoint.lock``), a lock of its own.

    Raises:
        ConfigError: another ``lockstep train`` holds it.
    """
    from lockstep.checkpoint.files import FolderInUseError
    from lockstep.checkpoint.lock import lock_folder
    from lockstep.comm.group import Comm
    from lockstep.env import World

    try:
        return lock_folder(out, Comm(World()))
    except FolderInUseError as exc:
        raise _in_use(out, exc.holder) from None


def _in_use(out: Path, who: str) -> ConfigError:
    return ConfigError(
        f"--out {out} is in use by another lockstep train ({who}): wait for it to end, or choose another --out"
    )
