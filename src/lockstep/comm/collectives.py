"""The job's collectives: :class:`Comm` (one process: a null object) and :class:`GroupComm` (a process group)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lockstep.comm.record import CollectiveRecord
from lockstep.comm.store import CLOSED_KEY, Peer, describe_self
from lockstep.comm.watchdog import NullWatchdog
from lockstep.env import World, WorldView

__all__ = ["Comm", "GroupComm", "Reduction"]

T = TypeVar("T")
_OPS = {"sum", "mean", "max", "min"}


class Reduction:
    """An all-reduce started by :meth:`Comm.all_reduce_async`: :meth:`wait` returns the reduced tensor.

    Args:
        tensor: the tensor being reduced in place.
        finish: waits for the reduction and completes it (``None``: already complete).
    """

    def __init__(self, tensor: torch.Tensor, finish: Callable[[], None] | None = None) -> None:
        self.tensor = tensor
        self._finish = finish

    def wait(self) -> torch.Tensor:
        """Wait until every rank's part is in and return the reduced tensor (again at once on later calls)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return self.tensor


class Comm(WorldView):
    """Collectives for a job of one process: each call returns its input unchanged.

    Subclasses implement the same calls across a process group, so code written against
    :class:`Comm` needs no ``if distributed:`` branches.

    Args:
        world: where this process is (see :func:`lockstep.env.detect_world`).

    Example::

        >>> import torch
        >>> from lockstep.env import World
        >>> Comm(World()).all_reduce(torch.ones(2))
        tensor([1., 1.])
    """

    backend = "none"
    watchdog: NullWatchdog = NullWatchdog()
    membership = "fixed"
    """``"fixed"``, or ``"elastic"`` where the group is rebuilt between steps as nodes leave and join."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.peers: list[Peer] = [describe_self(world)]

    def barrier(self) -> None:
        """Wait until every rank reaches this call."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place and return it.

        Args:
            tensor: the local value; on return it holds the reduced value on every rank.
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        _check_op(op)
        return self._all_reduce(tensor, op)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Reduction:
        """Start reducing ``tensor`` over all ranks in place; the result is read from the returned :class:`Reduction`.

        Every rank must start it at the same point of its sequence of collectives, as any collective;
        what runs between the start and :meth:`Reduction.wait` overlaps the exchange.

        Args:
            tensor: the local value; after :meth:`Reduction.wait` it holds the reduced value on every rank.
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        return Reduction(self.all_reduce(tensor, op))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` and return it.

        Args:
            tensor: the value on ``src``; on return it holds that value on every rank.
            src: the rank that sends.
        """
        self._check_src(src)
        return self._broadcast(tensor, src)

    def all_gather_object(self, obj: T) -> list[T]:
        """Return the list of every rank's ``obj``, by rank.

        Args:
            obj: a small, picklable value.
        """
        return [obj]

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank.

        Args:
            obj: a small, picklable value (read on ``src`` only).
            src: the rank that sends.
        """
        self._check_src(src)
        return obj

    def shutdown(self) -> None:
        """End the job's communication (barrier, then destroy the process group)."""

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src rank {src} is out of range for world_size {self.world_size}")


class GroupComm(Comm):
    """Collectives over a ``torch.distributed`` process group, as :func:`~lockstep.comm.init_comm` forms it.

    Each collective is a sync point of the :attr:`watchdog`: a timeout raises
    :class:`~lockstep.comm.CollectiveTimeoutError` naming the ranks that never came.

    Args:
        world: where this process is.
        backend: the group's backend (``"nccl"``, ``"gloo"``).
        peers: every rank's handshake post (:func:`~lockstep.comm.store.describe_self`), by rank.
        watchdog: the hang watchdog; none when omitted.
        owned: :meth:`shutdown` destroys the group (False: a group adopted from whoever formed it).
        record: this rank's collective record, closed at :meth:`shutdown`.
    """

    def __init__(
        self,
        world: World,
        backend: str,
        peers: list[Peer],
        watchdog: NullWatchdog | None = None,
        owned: bool = True,
        record: CollectiveRecord | None = None,
        closing: Any = None,
    ) -> None:
        super().__init__(world)
        self.backend, self.owned = backend, owned
        self._closing = closing  # the group's store (signed): marked closed at shutdown
        self.peers = peers
        self.watchdog = watchdog or NullWatchdog()
        self.record = record
        self._calls = 0
        self._alive = True

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one collective as a numbered sync point; explain a timeout."""
        self._calls += 1
        watch = self.watchdog
        watch.enter(name + " #{}", self._calls, record=False)  # the torch.distributed call records it
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            explained = watch.explain(exc)
            if explained is None:
                raise
            raise explained from exc
        finally:
            watch.leave()

    def barrier(self) -> None:
        self._call("barrier", torch.distributed.barrier)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self._call("all_reduce", torch.distributed.all_reduce, tensor, op=_reduce_op(op))
        return self._finish_reduce(tensor, op)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Reduction:
        _check_op(op)
        work = self._call("all_reduce", torch.distributed.all_reduce, tensor, op=_reduce_op(op), async_op=True)

        def finish() -> None:
            # not a sync point of its own: a rank that started it has moved on, and a hang report names
            # the last sync point the user wrote; a backend timeout here is still explained
            # (:meth:`~lockstep.comm.watchdog.Watchdog.explain_escaped`)
            work.wait()
            self._finish_reduce(tensor, op)

        return Reduction(tensor, finish)

    def _finish_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``"mean"``: the sum over the world's size (floor division for integer tensors)."""
        if op == "mean":
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.world_size)
            else:
                tensor.floor_divide_(self.world_size)
        return tensor

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._call("broadcast", torch.distributed.broadcast, tensor, src=src)
        return tensor

    def all_gather_object(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._call("all_gather_object", torch.distributed.all_gather_object, out, obj)
        return out

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        self._check_src(src)
        box = [obj]
        self._call("broadcast_object", torch.distributed.broadcast_object_list, box, src=src)
        return box[0]

    def shutdown(self) -> None:
        if not self._alive:
            return
        self._alive = False
        dist = torch.distributed
        try:
            if dist.is_initialized():
                try:
                    self.barrier()
                    self._mark_closed()
                finally:
                    if self.owned:  # an adopted group belongs to whoever formed it
                        dist.destroy_process_group()
        finally:
            # after the barrier: rank 0 (the store's host) may exit while the others still tear down
            self.watchdog.stop()
            if self.record is not None:
                self.record.close()

    def _mark_closed(self) -> None:
        """Mark the group's store closed, so that this rank's next group never joins it (see form_comm)."""
        closing, self._closing = self._closing, None
        if closing is None:
            return
        try:
            closing.set(CLOSED_KEY, "1")
        except (RuntimeError, OSError):  # rank 0 closed it already: no later group can reach it either
            pass


def _reduce_op(op: str) -> Any:
    """The ``torch.distributed.ReduceOp`` of ``op`` (``"mean"``: a sum, divided afterwards)."""
    ops = torch.distributed.ReduceOp
    return {"sum": ops.SUM, "mean": ops.SUM, "max": ops.MAX, "min": ops.MIN}[op]


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; choose one of {sorted(_OPS)}")
