"""A process group whose members change while the job runs (``lockstep run --nodes MIN:MAX``), rebuilt in place.

An :class:`ElasticGroup` joins the job's rendezvous (:mod:`lockstep.comm.members`), forms each
round's group and runs the training one step at a time; when a node leaves or joins, the members
form the next round's group and take the state from the member with the most committed steps
(:func:`~lockstep.comm.handover.broadcast_state`). A step must end with its last collective
before the optimizer changes the weights, so that a committed step is held by every rank of it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TextIO

import torch

from lockstep.comm.handover import broadcast_state
from lockstep.comm.members import Member, Membership, RoundView
from lockstep.env import Settings, World, detect_world, read_settings

__all__ = ["ElasticGroup", "Handover", "Objects", "membership_from_env", "is_membership_failure", "describe_change"]

_MARKS = ("gloo", "connection", "timed out", "timeout", "nccl", "broken pipe", "reset by peer", "read error")


def is_membership_failure(exc: BaseException) -> bool:
    """True when ``exc`` is what a collective raises when a peer died or became unreachable.

    Args:
        exc: the exception a step raised.
    """
    dist_error = getattr(torch.distributed, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _MARKS)


def _ranks(members: tuple[Member, ...], ranks: list[int]) -> str:
    low, high = min(ranks), max(ranks)
    return f"rank {low}" if low == high else f"ranks {low}-{high}"


def describe_change(view: RoundView, step: int, plan: str, costs: dict[str, float]) -> str:
    """The line a membership change prints on the new rank 0 (``lockstep run: membership: left host ...``).

    Args:
        view: the new round.
        step: the step the job resumes at.
        plan: the re-planned batch (``"micro-batch 6 × accumulation 1"``), or ``""``.
        costs: seconds by phase (``"step lost"``, ``"rendezvous"``, ``"state"``).
    """
    parts = []
    for verb, group in (("left", view.left), ("joined", view.joined)):
        by_node: dict[str, list[Member]] = {}
        for m in group:
            by_node.setdefault(m.node, []).append(m)
        for node, ms in by_node.items():
            ranks = [m.rank for m in ms] if verb == "left" else [view.members.index(m) for m in ms]
            parts.append(f"{verb} host {ms[0].host} (node {node[:8]}, {_ranks(view.members, ranks)})")
    who = "; ".join(parts) or "same members"
    total = sum(costs.values())
    detail = ", ".join(f"{k} {v:.2f} s" for k, v in costs.items())
    plan_text = f"; {plan}" if plan else ""
    return (
        f"lockstep run: membership: {who}; world size {view.world_size} on {view.nodes} node"
        f"{'s' if view.nodes != 1 else ''}{plan_text}; resumed at step {step}; cost {total:.2f} s ({detail})"
    )


class Handover(Protocol):
    """The caller's side of a membership change: what is handed over, and what the change's line says."""

    def objects(self) -> dict[str, Any]:
        """Name to object with ``state_dict``/``load_state_dict`` (model, optimizer, data position), read at
        each change."""
        ...

    def plan(self, world_size: int) -> str:
        """The batch plan's text at ``world_size`` for the membership line (``""``: none)."""
        ...

    def restore(self) -> int | None:
        """Load the disk checkpoint into :meth:`objects` when no member holds the state; its step count,
        or ``None`` when there is none to load."""
        ...


@dataclass
class Objects:
    """A fixed :class:`Handover`: the same objects at every change.

    Args:
        stateful: name to object with ``state_dict``/``load_state_dict``.
        describe: the batch plan's text at a world size, for the membership line.
        from_disk: loads the disk checkpoint into ``stateful`` and returns its step count (first
            start, or every node lost).
    """

    stateful: dict[str, Any] = field(default_factory=dict)
    describe: Callable[[int], str] | None = None
    from_disk: Callable[[], int] | None = None

    def objects(self) -> dict[str, Any]:
        """:attr:`stateful`."""
        return self.stateful

    def plan(self, world_size: int) -> str:
        """:attr:`describe` at ``world_size``, or ``""``."""
        return self.describe(world_size) if self.describe is not None else ""

    def restore(self) -> int | None:
        """:attr:`from_disk`'s step count, or ``None`` without one."""
        return self.from_disk() if self.from_disk is not None else None


def membership_from_env(
    timeout: float | None = None, settings: Settings | None = None, world: World | None = None
) -> tuple[Membership, float, Any]:
    """This worker's rendezvous under ``lockstep run --nodes MIN:MAX`` (store, secret and node from it).

    Args:
        timeout: seconds a collective waits for a peer; ``$LOCKSTEP_TIMEOUT`` or 60 when ``None``.
        settings: the launcher's variables, already read; read here when ``None``.
        world: this worker as its launcher described it; read here when ``None``.

    Returns:
        The membership, the timeout, and the store's client connection (keep it alive with the group).
    """
    settings = read_settings() if settings is None else settings
    world = detect_world() if world is None else world
    host, _, port = settings.elastic_store.rpartition(":")
    low, _, high = settings.elastic_nodes.partition(":")
    seconds = float(timeout if timeout is not None else settings.timeout or 60.0)
    store = torch.distributed.TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=max(seconds, 30.0))
    )
    prefixed = torch.distributed.PrefixStore("lockstep-elastic/", store)
    me = Member.here(settings.node_id, world.local_rank, world.local_world_size)
    return Membership(prefixed, settings.secret.encode(), me, (int(low), int(high))), seconds, store


class ElasticGroup:
    """The process group of a job whose nodes may leave and join (see the module docstring).

    Args:
        membership: this worker's rendezvous.
        handover: what a joiner or a survivor takes from the live peer at each change, the plan
            the change's line names, and the disk fallback (:class:`Handover`; :class:`Objects`
            for a fixed set).
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: seconds a collective waits for a peer (how long a cut link takes to detect).
        out: where the membership line goes (rank 0 only); stdout when omitted.
        store: the store's client connection behind ``membership``, kept open with the group.
    """

    def __init__(
        self,
        membership: Membership,
        handover: Handover,
        backend: str = "gloo",
        timeout: float = 60.0,
        out: TextIO | None = None,
        store: Any = None,
    ) -> None:
        self.membership, self.handover, self.backend = membership, handover, backend
        self.timeout, self.out = timeout, out
        self.view: RoundView | None = None
        self.step = 0  # steps committed by the job, handed over with the state
        self.events: list[dict[str, Any]] = []
        self._store = store
        self._restored = False

    @classmethod
    def from_env(cls, handover: Handover, **options: Any) -> ElasticGroup:
        """The group of a worker of ``lockstep run --nodes MIN:MAX`` (store, secret and node from it).

        Args:
            handover: see :class:`ElasticGroup`.
            **options: ``backend``, ``timeout``, ``out``.
        """
        membership, timeout, store = membership_from_env(options.pop("timeout", None))
        return cls(membership, handover, timeout=timeout, store=store, **options)

    @property
    def rank(self) -> int:
        """This worker's rank in the current group."""
        return self.view.rank if self.view else 0

    @property
    def world_size(self) -> int:
        """Workers in the current group."""
        return self.view.world_size if self.view else 1

    def state_dict(self) -> dict[str, int]:
        """The committed step count, handed over with the rest of the state."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take the committed step count from the peer."""
        self.step = int(state["step"])

    @property
    def joined(self) -> bool:
        """True once :meth:`start` formed this worker's first group."""
        return self.view is not None

    def start(self) -> RoundView:
        """Join the job (a node starting late joins a running group) and take the live state."""
        return self._regroup(committed=-1, lost=0.0, first=True)

    def commit(self) -> None:
        """Count one committed step, for a caller that runs its steps without :meth:`run_step`."""
        self.step += 1

    def recover(self, lost: float) -> RoundView:
        """After a peer's death (:func:`is_membership_failure`): form the next round's group, take the state.

        Args:
            lost: seconds of the step in progress that were lost (for the membership line).
        """
        return self._regroup(committed=self.step, lost=lost)

    def run_step(self, fn: Callable[[], Any]) -> bool:
        """Run one training step, unless the membership changes first; count it when it ends.

        Args:
            fn: the step: forward, backward, all_reduce of gradients, then ``optimizer.step()``.

        Returns:
            True when committed; False when a node left or joined: the group was rebuilt and the
            state taken from a peer (run the step at :attr:`step` again).
        """
        began = time.monotonic()
        try:
            if self.admit():
                return False
            fn()
        except Exception as exc:  # noqa: BLE001 - only a peer's death is handled; the rest is raised
            if not is_membership_failure(exc):
                raise
            self.recover(time.monotonic() - began)
            return False
        self.commit()
        return True

    def close(self) -> None:
        """Destroy the current process group (barrier first, so no rank leaves while others send)."""
        dist = torch.distributed
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()

    def admit(self) -> bool:
        """Let in the nodes waiting to join at this step boundary (every rank calls it).

        Returns:
            True when the group was rebuilt (the state then came from a peer).
        """
        # whether someone waits is what rank 0 saw, so every rank makes the same decision
        assert self.view is not None
        began = time.monotonic()
        try:
            flag = torch.tensor([1 if self.rank == 0 and self.membership.waiting(self.view) else 0])
            torch.distributed.broadcast(flag, 0)
        except Exception as exc:  # noqa: BLE001 - a peer died between steps
            if not is_membership_failure(exc):
                raise
            flag = torch.tensor([1])
        if not flag.item():
            return False
        self._regroup(committed=self.step, lost=time.monotonic() - began)
        return True

    def _regroup(self, committed: int, lost: float, first: bool = False) -> RoundView:
        """Form the next round's group and take the state; again if a peer dies meanwhile."""
        began = time.monotonic()
        while True:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # a dead peer's group cannot be used again
            # not retried: a member that cannot reach the store is the one cut off, and must stop
            view = self.membership.join(None if first else self.view, step=committed)
            try:
                return self._form(view, lost, began)
            except Exception as exc:  # noqa: BLE001 - only a peer's death is retried
                if not is_membership_failure(exc):
                    raise
                # the state was loaded only if the whole broadcast arrived; a restore counts as held
                committed, first = (self.step if self._restored else committed), False

    def _form(self, view: RoundView, lost: float, began: float) -> RoundView:
        dist = torch.distributed
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"pg/{view.round}/", self.membership.store.store),
            rank=view.rank,
            world_size=view.world_size,
            timeout=timedelta(seconds=self.timeout),
        )
        self.view, formed = view, time.monotonic()
        steps = torch.tensor([m.step for m in view.members])
        src = int(torch.argmax(steps).item())  # the first member with the most committed steps
        if int(steps[src]) < 0 and view.rank == src and (restored := self.handover.restore()) is not None:
            self.step, self._restored = restored, True  # nobody holds it in memory: the disk
        sent = broadcast_state({**self.handover.objects(), "elastic": self}, src)
        costs = {"step lost": lost, "rendezvous": formed - began, "state": time.monotonic() - formed}
        plan = self.handover.plan(view.world_size)
        event = {
            "round": view.round,
            "world_size": view.world_size,
            "step": self.step,
            "src": src,
            "bytes": sent,
            "left": [m.host for m in view.left],
            "joined": [m.host for m in view.joined],
            **costs,
        }
        self.events.append(event)
        if self.rank == 0 and (view.left or view.joined):
            print(describe_change(view, self.step, plan, costs), file=self.out or sys.stdout, flush=True)
        return view
