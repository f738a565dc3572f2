"""The session's loaders: batches on the device, each training loader's epoch and position, the progress bar."""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch

from lockstep.data.loader import StepBatches
from lockstep.data.seeding import SeededDataset
from lockstep.data.steps import StepSampler

__all__ = ["DeviceLoader", "TrainLoaders", "progress_bar"]


MAX_UNTRAINED = 1024
"""Batches a loader keeps as handed out and not trained; older ones count as trained (a loop that never steps)."""


class DeviceLoader:
    """Iterate a DataLoader, moving each batch to the device, and record what was handed out and what was trained.

    A training loader only loads: each batch handed out is recorded with the position before it and
    its plan (:attr:`untrained`) until the session's step says it was trained (:meth:`trained`).
    The position it reports (:meth:`trained_state`) is what was trained, so a loop that fetches its
    next batch before the step (``X, Y = next(it)`` after the forward) resumes with that batch; a
    new iterator starts at the first batch not trained.

    ``len()`` is the batches of a whole epoch on this rank and does not change while iterating;
    :attr:`remaining` counts those of the current epoch not handed out yet; ``share`` is this rank's
    samples in the batch last handed out.

    Args:
        loader: the DataLoader of :func:`lockstep.data.loader.make_loader`.
        device: where batches go (``non_blocking`` copies on CUDA).
        train: a training loader: its sampler position advances per batch.
        on_batch: told of each training batch's plan when it is the next to be backpropagated (the
            accumulation window): ``on_batch(index, left, window, weight)``, ``index`` counting the
            batches handed out and not trained before it.
        timer: times each wait for a training batch (:mod:`lockstep.session.timings`), or ``None``.
        tracker: the session's :class:`TrainLoaders`, told when a training pass starts, a training batch goes
            out or the loader runs out.

    A pass of the default order restarts from the sampler's position when that position is set from
    outside while it runs (:meth:`position_set`: under ``--nodes``, a change of members puts back the
    committed position and re-plans the shares between two steps).
    """

    def __init__(
        self,
        loader: torch.utils.data.DataLoader[Any],
        device: torch.device,
        train: bool,
        on_batch: Callable[..., None] | None = None,
        timer: Any = None,
        *,
        tracker: TrainLoaders | None = None,
    ) -> None:
        from lockstep.data.loader import move_to_device

        self.loader = loader
        self.device = device
        self.train = train
        self._move = move_to_device
        self._non_blocking = device.type == "cuda"
        self._on_batch = on_batch if train else None
        self.tracker = tracker if train else None
        self.timer = timer if train else None
        self.share = 0  # samples of this rank in the batch last handed out (0: a zero-weight stand-in)
        self._moves = 0  # the position set from outside: a running pass restarts there
        self._kept = False  # set from outside since the last pass began: the next pass starts there, even at the end
        # handed out, not trained yet, oldest first: (the sampler's position before it, its plan for on_batch)
        self.untrained: deque[tuple[int, tuple[Any, ...]]] = deque()

    @property
    def steps(self) -> StepSampler | None:
        """The sampler of the default order (one global cursor), or ``None`` for the torch order."""
        sampler = self.loader.sampler
        return sampler if isinstance(sampler, StepSampler) else None

    @property
    def sampler(self) -> Any:
        """The lockstep sampler behind the loader."""
        return self.loader.sampler

    @property
    def dataset(self) -> Any:
        """The dataset given (not the per-sample seeding wrapper)."""
        dataset = self.loader.dataset
        dataset = dataset.dataset if isinstance(dataset, StepBatches) else dataset
        return dataset.dataset if isinstance(dataset, SeededDataset) else dataset

    @property
    def collate_fn(self) -> Any:
        """The loader's collate function."""
        dataset = self.loader.dataset
        return dataset.collate if isinstance(dataset, StepBatches) else self.loader.collate_fn

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank (the largest micro-batch in the default order)."""
        steps = self.steps
        return steps.plan.micro if steps is not None else int(self.loader.batch_size or 1)

    @property
    def remaining(self) -> int:
        """Batches of the current epoch not handed out yet."""
        return len(self.loader)

    def __len__(self) -> int:
        if (steps := self.steps) is not None:
            return steps.micro_per_epoch
        samples = getattr(self.sampler, "num_samples", None)  # a whole epoch; len(sampler) counts the rest
        if samples is None or not self.loader.batch_size:
            return len(self.loader)
        size = self.loader.batch_size
        return int(samples // size if self.loader.drop_last else -(-samples // size))

    def __iter__(self) -> Iterator[Any]:
        if self.tracker is not None:
            self.tracker.pass_starting()  # the session's own business first (under --nodes: the join)
            self._start_pass()
        self._kept = False
        steps = self.steps
        batches = (
            self._iter_padded() if steps is None else self._iter_passes(steps) if self.train else self._pass(steps)
        )
        return batches if self.timer is None else self.timer.data(batches, self, _batch_len)

    def position_set(self) -> None:
        """The sampler's position was set from outside (a new epoch, a checkpoint, a change of members): nothing
        handed out is pending, and a pass that runs restarts there."""
        self.untrained.clear()
        self._moves += 1
        self._kept = True

    def trained(self, batches: int) -> None:
        """The session's step trained the oldest ``batches`` handed out (a step's micro-batches)."""
        untrained = self.untrained
        for _ in range(min(batches, len(untrained))):
            untrained.popleft()

    def trained_state(self) -> dict[str, Any]:
        """The sampler's position after the last batch trained: what a checkpoint saves."""
        state: dict[str, Any] = self.sampler.state_dict()
        if self.untrained:
            _set_seen(state, self.untrained[0][0])
        return state

    def planned(self, index: int) -> tuple[Any, ...] | None:
        """The plan of the ``index``-th batch handed out and not trained yet, or ``None``."""
        untrained = self.untrained
        return untrained[index][1] if index < len(untrained) else None

    def _start_pass(self) -> None:
        """A new iterator starts at the first batch not trained (as a DataLoader's starts its epoch again):
        ``len(next(iter(loader))[0])`` then ``for batch in loader`` loses no batch, nor does a loop that broke
        out after fetching a batch it did not train. A position set from outside at the epoch's end (a peer's,
        handed over after the epoch's last step) is kept: that pass has nothing left, as it has on the peer."""
        sampler = self.sampler
        if self.untrained:
            state = sampler.state_dict()
            _set_seen(state, self.untrained[0][0])
            self.untrained.clear()
            sampler.load_state_dict(state)
            return
        epoch = getattr(sampler, "epoch", None)
        steps = self.steps  # its own test: len() would build the rest of the epoch's micro-steps
        spent = steps.exhausted if steps is not None else self.remaining == 0
        if epoch is not None and spent and not self._kept:
            # the epoch ran out and no set_epoch came (the tutorial reads the batch size before it):
            # a DataLoader's new iterator goes over the same epoch again, and so does this one
            sampler.set_epoch(epoch)

    def _iter_passes(self, steps: StepSampler) -> Iterator[Any]:
        """Passes of one epoch: when the position is set from outside meanwhile, a new pass starts there (with
        the sampler's shares as they are now)."""
        epoch = steps.epoch
        while (yield from self._pass(steps)) and steps.epoch == epoch:
            pass

    def _pass(self, steps: StepSampler) -> Generator[Any, None, bool]:
        """The default order from the sampler's position; True when the position was set from outside meanwhile."""
        on_host, tracker, on_batch = self.device.type == "cpu", self.tracker, self._on_batch
        world, rank = steps.world_size, steps.rank
        upcoming = steps.upcoming()
        left = len(upcoming)
        train, seen = self.train, self._moves
        untrained = self.untrained
        for i, batch in enumerate(self.loader):
            if train:
                if self._moves != seen:
                    return True  # this batch was planned from the position before
                micro, share, samples, weight = upcoming.portion(i, world, rank)
                self.share = share
                plan = (left - i, micro.count, weight)
                self._hand_out(untrained, steps.cursor, plan, tracker, on_batch)
                steps.advance(samples)
            yield batch if on_host else self._move(batch, self.device, self._non_blocking)
        if self._moves != seen:
            return True
        if tracker is not None:
            tracker.ran_out()
        return False

    def _iter_padded(self) -> Iterator[Any]:
        """The torch order: every rank has the same batches (padded)."""
        move, device, nb = self._move, self.device, self._non_blocking
        on_host = device.type == "cpu"  # the loader's batches are already there
        advance = getattr(self.sampler, "advance", None) if self.train else None
        world = getattr(self.sampler, "world_size", 1)
        full = self.loader.batch_size  # every batch but an epoch's last has it on every rank
        tracker, on_batch = self.tracker, self._on_batch
        untrained = self.untrained
        for batch in self.loader:
            self.share = _batch_len(batch)
            if advance is not None:
                left = self.remaining  # this batch and those after it
                self._hand_out(untrained, self.sampler.seen, (left, None, None), tracker, on_batch)
                # the sampler clamps the position at the epoch's end, which is where a last, smaller batch takes it
                advance((full or self.share) * world)
            yield batch if on_host else move(batch, device, nb)
        if tracker is not None:
            tracker.ran_out()

    def _hand_out(
        self,
        untrained: deque[tuple[int, tuple[Any, ...]]],
        before: int,
        plan: tuple[Any, ...],
        tracker: TrainLoaders | None,
        on_batch: Callable[..., None] | None,
    ) -> None:
        """Record a training batch going out (its position before it and its plan), before its forward."""
        if len(untrained) >= MAX_UNTRAINED:
            untrained.popleft()
        untrained.append((before, plan))
        if tracker is not None:
            tracker.handed_out()
        if on_batch is not None:
            on_batch(len(untrained) - 1, *plan)


def _set_seen(state: dict[str, Any], seen: int) -> None:
    """Set a sampler state's position (``seen``, and ``cursor`` in the default order) to ``seen``."""
    state["seen"] = seen
    if "cursor" in state:
        state["cursor"] = seen


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 1


class TrainLoaders:
    """The session's training loaders, held weakly in creation order: each one's epoch is set, saved and restored.

    A state loaded before its loader exists waits here and is applied when the loader is made. An
    epoch is finished once a loader ran out and the batches handed out are trained (:attr:`finished`).
    """

    def __init__(self, on_add: Callable[[], None] | None = None, on_pass: Callable[[], None] | None = None) -> None:
        self._refs: list[weakref.ref[DeviceLoader]] = []
        self._pending: list[dict[str, Any]] = []
        self._epoch = 0
        self.epoch_done = False  # written by the loaders: True once one ran out after the last batch
        self.handed = 0  # training batches handed out so far, by every loader (the loop's iterations show in it)
        self.on_add = on_add
        self.on_pass = on_pass

    @property
    def live(self) -> list[DeviceLoader]:
        """The loaders still in use, oldest first."""
        loaders = [loader for ref in self._refs if (loader := ref()) is not None]
        if len(loaders) < len(self._refs):
            self._refs = [weakref.ref(loader) for loader in loaders]
        return loaders

    @property
    def first(self) -> DeviceLoader | None:
        """The first training loader (the one the summary describes)."""
        live = self.live
        return live[0] if live else None

    def describe(self, world_size: int, accumulate: int, max_steps: int | None = None) -> list[str]:
        """What the session's summary says about the first loader's batches (nothing without one)."""
        first = self.first
        if first is None:
            return []
        if (planned := first.steps) is not None:  # the plan's own figures, uneven shares said
            plan = planned.plan
            up_to = "" if plan.even else "up to "
            b, g = plan.micro, plan.global_batch
            shape = f"{up_to}{plan.micro} x {plan.world_size} x {plan.accumulate}"
            steps = planned.steps_per_epoch
            if g > planned.dataset_len:  # one process, a batch larger than its data: one smaller batch per epoch
                n = planned.dataset_len
                return [
                    f"batch {n} per device (the whole training set; {b} asked)",
                    f"global batch {n}",
                    f"{steps} step per epoch",
                ]
        else:
            b, g = first.batch_size, first.batch_size * world_size * accumulate
            shape = f"{b} x {world_size} x {accumulate}"
            steps = -(-len(first) // accumulate)  # an epoch ends with a step
        taken = f"{max_steps} of {steps}" if max_steps is not None and max_steps < steps else f"{steps}"
        return [f"batch {b} per device", f"global batch {g} ({shape})", f"{taken} steps per epoch"]

    @staticmethod
    def options(options: dict[str, Any], config: Any, per_step: int, eval: bool) -> dict[str, Any]:
        """``make_loader``'s options for a session loader: the session's order and global batch (the script's win)."""
        if eval:
            return options
        out = {"order": config.order, **options}
        if out["order"] == "lockstep" and "global_batch" not in out:
            if config.global_batch is not None:
                out["global_batch"] = config.global_batch
            elif config.accumulate > 1:
                out["global_batch"] = per_step * config.accumulate
        return out

    def wrap(
        self,
        loader: torch.utils.data.DataLoader[Any],
        device: torch.device,
        *,
        train: bool,
        on_batch: Callable[..., None] | None = None,
        accum: Any = None,
        timer: Any = None,
    ) -> DeviceLoader:
        """Return ``loader`` as a :class:`DeviceLoader` on ``device``; a training one is tracked (:meth:`add`)."""
        on_batch = accum.on_batch if accum is not None else on_batch
        wrapped = DeviceLoader(loader, device, train, on_batch, timer, tracker=self)  # an evaluation one keeps none
        if not train:
            return wrapped
        self.add(wrapped)
        if accum is not None and wrapped.steps is not None and wrapped is self.first:
            accum.resize(wrapped.steps.plan.accumulate)
        if self.on_add is not None:
            self.on_add()
        return wrapped

    def add(self, loader: DeviceLoader) -> None:
        """Track ``loader``; a sampler state waiting for it is applied now, else it starts the current epoch."""
        if self._pending and int(self._pending[0].get("epoch", -1)) == self._epoch:
            loader.sampler.load_state_dict(self._pending.pop(0))
        else:
            self._pending = []
            loader.sampler.set_epoch(self._epoch)
        loader.position_set()
        self._refs.append(weakref.ref(loader))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` on every loader (one restored to this epoch keeps its position)."""
        self._epoch = epoch
        self.epoch_done = False
        for loader in self.live:
            loader.sampler.set_epoch(epoch)
            loader.position_set()

    def pass_starting(self) -> None:
        """A training loader's iterator is made: the session's own business at a pass's start (``on_pass``)."""
        if self.on_pass is not None:
            self.on_pass()

    def handed_out(self) -> None:
        """A loader handed a training batch out: the epoch goes on."""
        self.handed += 1
        self.epoch_done = False

    def ran_out(self) -> None:
        """A loader ran out of the epoch's batches."""
        self.epoch_done = True

    def load_positions(self, states: list[dict[str, Any]], epoch_done: bool) -> None:
        """Go back to (or take a peer's) positions, paired with the loaders in creation order."""
        for loader, state in zip(self.live, states):
            loader.sampler.load_state_dict(state)
            loader.position_set()
        self.epoch_done = epoch_done

    @property
    def finished(self) -> bool:
        """True once a loader ran out and a loader has every batch it handed out trained.

        A loop that fetched the next batch before the step has the epoch's last batch untrained after its
        loader ran out; a zip of two loaders stops with one batch of the longer one handed out for nothing.
        """
        live = self.live
        return self.epoch_done and (not live or any(not loader.untrained for loader in live))

    def trained(self, batches: int) -> tuple[Any, ...] | None:
        """A step trained ``batches`` micro-batches of every loader (the oldest handed out); returns the plan of
        the next batch out already (fetched ahead of the step), as :meth:`planned` does, or ``None``."""
        ahead = None
        for ref in self._refs:  # at every step: no list is built
            loader = ref()
            if loader is not None and loader.untrained:
                loader.trained(batches)
                if ahead is None:
                    ahead = loader.planned(0)
        return ahead

    def planned(self, index: int) -> tuple[Any, ...] | None:
        """The plan of the ``index``-th batch handed out and not trained, of the first loader with one, or ``None``."""
        for ref in self._refs:  # at every backward: no list is built
            loader = ref()
            if loader is not None and loader.untrained:
                return loader.planned(index)
        return None

    def state_dicts(self) -> list[dict[str, Any]]:
        """Every loader's position after what was trained, in creation order."""
        return [loader.trained_state() for loader in self.live]

    def restore(self, states: list[dict[str, Any]], epoch: int, epoch_done: bool) -> bool:
        """Load saved sampler ``states``, paired with the loaders in creation order; True when taken mid-``epoch``."""
        if not states:
            self._pending = []
            return False
        at_end = all(int(s.get("seen", 0)) >= int(s.get("dataset_len", 0)) for s in states)
        mid = not (epoch_done or at_end)  # a save right after the last batch: every loader at its end
        self._epoch, self.epoch_done = (epoch, False) if mid else (epoch + 1, False)
        live = self.live
        for loader, state in zip(live, states):
            loader.sampler.load_state_dict(state)
            if not mid:
                loader.sampler.set_epoch(epoch + 1)
            loader.position_set()
        self._pending = list(states[len(live) :]) if mid else []
        return mid


def progress_bar(
    iterable: Iterable[Any], show: bool, *, force: bool = False, terminal: str = "", **kwargs: Any
) -> Iterable[Any]:
    """Wrap ``iterable`` in a tqdm bar where ``show`` is True and stderr is a terminal (or ``force``).

    Under ``lockstep run`` stdout and stderr are log files the launcher relays line by line (a
    ``\\r`` ends a line too); the bar draws on stdout, in order with the loop's prints, when the
    launcher's own stderr is a terminal (``terminal``, its ``COLUMNSxLINES`` as ``Settings.terminal``
    reads it), at its width.
    """
    if not show:
        return iterable
    if not (force or sys.stderr.isatty()):
        columns = terminal.partition("x")[0]
        if not columns.isdigit():
            return iterable
        kwargs.setdefault("ncols", max(20, int(columns) - len("[rank0]: ")))  # the relay prefixes each line
        # one stream with the loop's prints (session.print): the launcher relays stdout and stderr apart,
        # so a bar on stderr could be drawn after a line printed once it was gone
        kwargs.setdefault("file", sys.stdout)
    from tqdm.auto import tqdm

    kwargs.setdefault("leave", False)
    if isinstance(iterable, DeviceLoader) and iterable.train:
        kwargs.setdefault("initial", len(iterable) - iterable.remaining)
    bar: Iterable[Any] = tqdm(iterable, **kwargs)
    return bar
