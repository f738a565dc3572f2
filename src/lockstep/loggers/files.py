"""Loggers that write files in a folder: CSV (the standard library) and TensorBoard event files."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lockstep.loggers.base import Logger, require

__all__ = ["CSVLogger", "TensorBoardLogger"]


class CSVLogger(Logger):
    """One CSV file, a row per :meth:`log` call, a column per name (the step's column first).

    Without ``columns`` a new name widens the header (rewriting the file); a resumed run keeps the rows before its step.

    Args:
        directory: the folder (made when the first row is written).
        filename: the file's name in it.
        columns: a fixed header (the step's column included; other names are left out), or ``None``.
        step_column: the column that holds ``step``.
    """

    def __init__(
        self,
        directory: str | Path,
        filename: str = "metrics.csv",
        columns: Sequence[str] | None = None,
        step_column: str = "step",
    ) -> None:
        super().__init__(directory)
        self.path = Path(directory) / filename
        self.step_column = step_column
        self.fixed = columns is not None
        self.columns = list(columns) if columns is not None else [step_column]
        if step_column not in self.columns:
            self.columns.insert(0, step_column)

    @property
    def location(self) -> str:
        return str(self.path)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[dict[str, str]] = []
        if self._resume_at is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                if not self.fixed:
                    self.columns = list(dict.fromkeys([*self.columns, *(reader.fieldnames or [])]))
                rows = [r for r in reader if _number(r.get(self.step_column)) < self._resume_at]
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Write the header and ``rows`` anew (a fresh file, a trimmed one, or a wider header)."""
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    def _write(self, metrics: Mapping[str, float], step: int) -> None:
        row: dict[str, Any] = {k: v for k, v in metrics.items() if k != self.step_column}
        if self.fixed and not any(k in self.columns for k in row):
            return
        new = [k for k in row if k not in self.columns]
        if new and not self.fixed:
            with open(self.path, newline="") as f:
                old = list(csv.DictReader(f))
            self.columns += new
            self._rewrite(old)
        row[self.step_column] = step
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore").writerow(
                {k: _cell(row.get(k, "")) for k in self.columns}
            )


def _number(text: str | None) -> float:
    """A CSV cell as a number (an empty or odd one sorts first)."""
    try:
        return float(text or "nan") if text else float("-inf")
    except ValueError:
        return float("-inf")


def _cell(value: Any) -> Any:
    """Integers stay integers in the file (``3``, not ``3.0``)."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


class TensorBoardLogger(Logger):
    """TensorBoard event files, written by torch's ``SummaryWriter`` (the ``tensorboard`` package).

    Args:
        directory: the event files' folder (``tensorboard --logdir`` it).
        flush_secs: how often pending events reach the file (and at close).
    """

    extra = "tensorboard"

    def __init__(self, directory: str | Path, flush_secs: int = 10) -> None:
        super().__init__(directory)
        require("tensorboard", self.extra, type(self).__name__)
        self.flush_secs = flush_secs
        self._writer: Any = None

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=self.directory, purge_step=self._resume_at, flush_secs=self.flush_secs)

    def _write(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        """Write pending events to the file now."""
        if self._writer is not None:
            self._writer.flush()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
