"""What a session tells about its own steps: each window's timings, the slow rank, the loggers.

:class:`TimingReport` shares each window's timings, asks the
:class:`~lockstep.session.slow_rank.SlowRankDetector` for a slow rank and logs;
:class:`Observing` is the part of ``Session`` users meet (``log``, ``timings``, ``slow_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lockstep.comm.group import Comm
from lockstep.env import Settings
from lockstep.loggers import LoggerSet
from lockstep.session.config import ResolvedConfig
from lockstep.session.loaders import progress_bar
from lockstep.session.position import Position
from lockstep.session.slow_rank import PHASES, SlowRank, SlowRankDetector
from lockstep.session.timings import StepTimer, TimingWindow

__all__ = ["TimingReport", "Observing"]


class TimingReport:
    """The session's timings: measured by a :class:`StepTimer`, shared, judged, printed and logged.

    Args:
        comm: the job's collectives (the window's all-reduce; the peers' host names).
        device: this rank's device.
        config: the session's options (``loggers``, ``log_timings``, ``timings_every``).
        say: prints a line once, on rank 0 (``Session.print``).
        step: the session's global step, the x-axis of what is logged.
    """

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        config: ResolvedConfig,
        say: Callable[[str], None],
        step: Callable[[], int],
    ) -> None:
        self.comm, self.say, self._step = comm, say, step
        self.loggers = LoggerSet(config.loggers, active=comm.is_main, say=say)
        self.log_timings = config.log_timings
        self._device = device if comm.backend == "nccl" else torch.device("cpu")
        hosts = {int(p.get("rank", i)): str(p.get("host", "?")) for i, p in enumerate(comm.peers)}
        self.detector = SlowRankDetector([hosts.get(r, "?") for r in range(comm.world_size)])
        self.timer = (
            StepTimer(device, config.timings_every, self._exchange, self._on_window)
            if config.timings_every > 0
            else None
        )
        self.latest: TimingWindow | None = None
        self.slow: list[SlowRank] = []

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` at ``step`` (the global step when ``None``) on the ranks that write."""
        self.loggers.log(metrics, self._step() if step is None else step)

    def _exchange(self, row: list[float]) -> list[list[float]]:
        """Every rank's row: one all-reduce of a world x row table, each rank filling its own line."""
        if self.comm.world_size == 1:
            return [row]
        table = torch.zeros(self.comm.world_size, len(row), dtype=torch.float64, device=self._device)
        table[self.comm.rank] = torch.tensor(row, dtype=torch.float64)
        return self.comm.all_reduce(table).tolist()

    def _on_window(self, window: TimingWindow) -> None:
        """Judge the window (the same verdict on every rank), print a new verdict and log."""
        self.latest = window
        step = self._step()
        verdict = self.detector.update([row[: len(PHASES)] for row in window.table], step)
        if verdict is not None:
            self.slow.append(verdict)
            self.say(verdict.message())
            self.log(
                {
                    "slow_rank/rank": verdict.rank,
                    f"slow_rank/{verdict.phase}_s": verdict.seconds,
                    "slow_rank/others_s": verdict.others,
                    "slow_rank/waited_s": verdict.waited,
                },
                step,
            )
        if self.log_timings != "off":
            self.log(window.scalars(self.log_timings), step)

    def close(self) -> None:
        """Remove the hooks and close the loggers."""
        if self.timer is not None:
            self.timer.unwatch()
        self.loggers.close()


class Observing(Position):
    """The session's logging, timings, :meth:`print` and :meth:`progress` (``Session`` inherits them)."""

    _report: TimingReport
    _settings: Settings
    device: torch.device

    def _observe(self, config: ResolvedConfig) -> StepTimer | None:
        """Build the session's timing report; return the timer the training step calls."""
        self._report = TimingReport(self.comm, self.device, config, say=self.print, step=lambda: self.state.global_step)
        return self._report.timer

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Write ``metrics`` to the session's loggers; every rank may call it, rank 0 writes.

        Values that are not numbers are left out; a one-element tensor is read with ``.item()``.

        Args:
            metrics: names and numbers, e.g. ``{"loss": 0.31, "lr": 0.1}``.
            step: the x-axis value; the session's :attr:`global_step` when ``None``.
        """
        self._report.log(metrics, step)

    @property
    def timings(self) -> TimingWindow | None:
        """The last timing window every rank shared (``None`` before the first one, or with timings off)."""
        return self._report.latest

    @property
    def slow_ranks(self) -> list[SlowRank]:
        """Every slow rank named so far (the same list on every rank)."""
        return list(self._report.slow)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (flushed unless ``flush=False``)."""
        if self.is_main:
            print(*args, **{"flush": True, **kwargs})

    def progress(self, iterable: Iterable[Any], **kwargs: Any) -> Iterable[Any]:
        """Wrap ``iterable`` in a tqdm bar on rank 0 (other ranks iterate silently).

        Args:
            iterable: what the loop goes over (a training loader's bar starts at the batches already done).
            **kwargs: passed to tqdm (``desc`` defaults to the epoch).
        """
        kwargs.setdefault("desc", f"epoch {self.epoch}")
        return progress_bar(iterable, self.is_main, terminal=self._settings.terminal, **kwargs)
