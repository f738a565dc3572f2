"""Per-rank step timings: where each optimizer step's time goes on this rank, measured always and cheaply.

Four phases per step, summed over its micro-batches: ``data`` (waiting for the session loader),
``compute`` (to the last parameter gradient), ``comm`` (from it to the end of backward: the
communication that did not overlap) and ``optimizer`` (``session.step``); see docs/observability.md.
On a GPU the last three are CUDA events read when a window closes, so no step pays a host sync.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.session.slow_rank import PHASES

__all__ = ["StepTimer", "TimingWindow", "ROW", "MIN_WINDOW_SECONDS", "MAX_WINDOW_STEPS", "peak_flops"]

ROW = PHASES + ("step", "samples_per_s", "host_mem_gb", "device_mem_gb", "mfu")
"""The values each rank shares per window: the phases' means (s/step; a mean, not a median: with loader
workers a rank's data waits come in bursts, long then none, and a median would miss them), wall time per step,
samples/s,
resident host memory, peak device memory and MFU (NaN where not known)."""

MIN_WINDOW_SECONDS = 0.5
"""A window holds at least this much of the steps' own work (the four phases; and ``every`` steps), so fast steps
pay one small collective per half second of training."""

MAX_WINDOW_STEPS = 1000
"""A window never lasts more steps than this."""

_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "V100": 125e12,
    "T4": 65e12,
}
"""Dense bf16/fp16 tensor-core peak per GPU model (vendor data sheets, SXM parts)."""


def peak_flops(device: torch.device) -> float | None:
    """The device's dense half-precision peak in FLOP/s, or ``None`` when unknown (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


@dataclass(frozen=True)
class TimingWindow:
    """The timings every rank shared at the end of one window.

    Attributes:
        step: the global step the window ended at.
        steps: optimizer steps in the window.
        table: ``table[rank]`` holds the :data:`ROW` values of that rank.
    """

    step: int
    steps: int
    table: list[list[float]]

    def of(self, rank: int) -> dict[str, float]:
        """Rank ``rank``'s values by name (:data:`ROW`)."""
        return dict(zip(ROW, self.table[rank]))

    def scalars(self, ranks: str = "main") -> dict[str, float]:
        """What a logger receives: ``timings/...`` values and the job's samples/s.

        Args:
            ranks: ``"main"`` (rank 0's values) or ``"all"`` (every rank's, under ``timings/rankN/``).
        """
        out: dict[str, float] = {
            "timings/job_samples_per_s": sum(row[ROW.index("samples_per_s")] for row in self.table)
        }
        chosen = range(len(self.table)) if ranks == "all" else [0]
        for rank in chosen:
            prefix = "timings/" if ranks != "all" else f"timings/rank{rank}/"
            for name, value in self.of(rank).items():
                if not math.isnan(value):
                    out[prefix + (name + "_s" if name in PHASES or name == "step" else name)] = value
        return out


class StepTimer:
    """Measure this rank's phases per optimizer step and close a window every so often.

    The session calls :meth:`data` (through its loaders), :meth:`after_backward`, :meth:`before_step`
    and :meth:`after_step`; :meth:`watch` hooks the parameters to see the last gradient. Every rank
    closes its windows at the same step: the next window's length comes from the shared table.

    Args:
        device: the rank's device (CUDA: device events, read lazily).
        every: the fewest steps in a window (0 turns timings off).
        exchange: shares this rank's row and returns every rank's (one collective).
        on_window: told each closed window.
    """

    def __init__(
        self,
        device: torch.device,
        every: int,
        exchange: Callable[[list[float]], list[list[float]]],
        on_window: Callable[[TimingWindow], None],
    ) -> None:
        self.device, self.every = device, every
        self.enabled = every > 0
        self._exchange, self._on_window = exchange, on_window
        self._cuda = device.type == "cuda"
        self._clock = time.perf_counter
        self._due = every
        self._hooks: list[Any] = []
        self._peak = peak_flops(device)
        self._flops: Any = None  # the FLOP counter, open during the one micro-step it measures
        self._flops_per_sample: float | None = None
        self._reset_window()
        self._start: Any = None  # where the current micro-step's compute began
        self._grad: Any = None  # the last gradient of this backward (a time or an event)
        self._grad_last, self._grad_target = -1, -1
        self.step = 0  # steps timed so far (the session's global step counts only those taken)

    def _reset_window(self) -> None:
        """A new window: no steps yet, its clock started now."""
        self._rows: list[Any] = []  # a GPU's steps: (data seconds, their phases' events), read at the window's end
        self._steps = 0  # steps in the window
        self._data, self._samples, self._window_samples = 0.0, 0, 0
        self._acc = [0.0, 0.0, 0.0, 0.0]  # the host clock's phases, summed over the window's steps
        self._pending: list[tuple[int, Any, Any]] = []
        self._opt_began: Any = None
        self._window_began = self._clock()

    def _mark(self) -> Any:
        """Now: the host clock, or an event recorded on the current CUDA stream."""
        if not self._cuda:
            return self._clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _span(self, phase: int, began: Any, ended: Any) -> None:
        """Keep a phase's two CUDA events, read when the window closes (the host clock's spans are added at once)."""
        self._pending.append((phase, began, ended))

    # -- the model's gradients --------------------------------------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """Hook ``model``'s trainable parameters: the last gradient ends ``compute`` (one hook kept after backward)."""
        if not self.enabled:
            return
        for param in (p for p in model.parameters() if p.requires_grad):
            try:  # a hook's index is its place in _hooks (several models: one list)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_hook(len(self._hooks))))
            except (RuntimeError, AttributeError):  # parameters that take no hooks: comm is then in compute
                self.unwatch()
                return

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """One parameter's hook: records when its gradient is ready."""

        mark = self._mark if self._cuda else self._clock

        def hook(_: torch.Tensor) -> None:
            self._grad_last = index
            self._grad = mark()

        return hook

    def _keep_last_hook(self) -> None:
        """After the first backward: drop every hook but the last gradient's."""
        if len(self._hooks) > 1 and 0 <= self._grad_target < len(self._hooks):
            for index, handle in enumerate(self._hooks):
                if index != self._grad_target:
                    handle.remove()
            self._hooks = [self._hooks[self._grad_target]]

    def unwatch(self) -> None:
        """Remove the parameter hooks (the session's close)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- the step's phases --------------------------------------------------------------------------------------
    def data(self, batches: Iterator[Any], source: Any, size: Callable[[Any], int]) -> Iterator[Any]:
        """Yield ``batches``, timing each wait (``data``) and counting ``source.share`` samples."""
        clock = self._clock
        while True:
            began = clock()
            try:
                batch = next(batches)
            except StopIteration:
                return
            now = clock()
            self._data += now - began
            self._samples += source.share
            self._start = self._mark() if self._cuda else now
            if self._peak is not None and self._flops_per_sample is None and self._flops is None and self.step > 0:
                self._count_flops(size(batch))
            yield batch

    def after_backward(self) -> None:
        """Backward returned: close the micro-step's ``compute`` and ``comm``."""
        start, grad = self._start, self._grad
        if not self._cuda:  # the host clock: add the spans at once (this runs at every backward)
            end = self._clock()
            if start is not None:
                acc = self._acc
                if grad is not None:
                    acc[1] += grad - start
                    acc[2] += end - grad
                else:
                    acc[1] += end - start
        else:
            end = self._mark()
            if start is not None:
                if grad is not None:
                    self._span(1, start, grad)
                    self._span(2, grad, end)
                else:
                    self._span(1, start, end)
        self._grad, self._start = None, end
        if self._grad_target < 0:
            self._grad_target = self._grad_last
            self._keep_last_hook()
        if self._flops is not None:
            self._close_flops()

    def before_step(self) -> None:
        """``session.step`` begins: the ``optimizer`` phase starts."""
        self._opt_began = self._mark() if self._cuda else self._clock()

    def after_step(self) -> None:
        """``session.step`` ends: the step is recorded; at a window's end the ranks share their rows."""
        if self._flops is not None:  # backward never came: count nothing rather than the whole run
            counter, self._flops = self._flops, None
            counter.__exit__(None, None, None)
        began = self._opt_began
        if self._cuda:
            end = self._mark()
            if began is not None:
                self._span(3, began, end)
            self._rows.append((self._data, self._pending))
            self._pending = []
        else:
            end = self._clock()
            acc = self._acc
            acc[0] += self._data
            if began is not None:
                acc[3] += end - began
        self._start, self._opt_began = end, None
        self._window_samples += self._samples
        self._data, self._samples = 0.0, 0
        self.step += 1
        self._steps += 1
        if self._steps >= self._due:
            self._close_window()

    # -- windows ----------------------------------------------------------------------------------------------------
    def _close_window(self) -> None:
        """Share this rank's means, pick the next window's length from everyone's step time, report."""
        steps = self._steps
        seconds = max(self._clock() - self._window_began, 1e-9)
        row = [total / steps for total in self._phase_sums()]
        per_s = self._window_samples / seconds
        mfu = per_s * self._flops_per_sample / self._peak if self._flops_per_sample and self._peak else math.nan
        row += [seconds / steps, per_s, _host_memory_gb(), self._device_memory_gb(), mfu]
        table = self._exchange(row)
        # sized on the steps' own work, not the wall clock: time spent between steps (evaluation, another loop)
        # must not shrink the windows. The same table on every rank: the same decision.
        busiest = max(sum(r[: len(PHASES)]) for r in table)
        self._due = int(min(MAX_WINDOW_STEPS, max(self.every, math.ceil(MIN_WINDOW_SECONDS / max(busiest, 1e-9)))))
        self._on_window(TimingWindow(step=self.step, steps=steps, table=table))
        self._reset_window()

    def _phase_sums(self) -> list[float]:
        """The four phases in seconds, summed over the window's steps (on a GPU its events are read now: one sync)."""
        if not self._cuda:
            return self._acc
        if self._rows and self._rows[-1][1]:
            self._rows[-1][1][-1][2].synchronize()
        sums = [0.0, 0.0, 0.0, 0.0]
        for data, spans in self._rows:
            sums[0] += data
            for phase, began, ended in spans:
                sums[phase] += began.elapsed_time(ended) / 1e3
        return sums

    def _device_memory_gb(self) -> float:
        """Peak device memory since the last window (NaN on CPU)."""
        if not self._cuda:
            return math.nan
        peak = torch.cuda.max_memory_allocated(self.device) / 1e9
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    # -- MFU ---------------------------------------------------------------------------------------------------------
    def _count_flops(self, samples: int) -> None:
        """Count one micro-step's FLOPs (forward and backward) with torch's counter, once per run."""
        from torch.utils.flop_counter import FlopCounterMode

        self._flops = FlopCounterMode(display=False)
        self._flops.__enter__()
        self._flops_samples = max(samples, 1)

    def _close_flops(self) -> None:
        """Leave the FLOP counter; its total per sample gives the MFU of every later window."""
        counter, self._flops = self._flops, None
        counter.__exit__(None, None, None)
        self._flops_per_sample = counter.get_total_flops() / self._flops_samples


def _host_memory_gb() -> float:
    """This process's resident memory (Linux ``/proc``; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
