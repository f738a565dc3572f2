"""The job's :class:`~lockstep.comm.Comm` under ``lockstep run --nodes MIN:MAX``: :class:`ElasticComm`.

Its collectives run over the current round's group of an :class:`~lockstep.comm.elastic.ElasticGroup`;
its rank and world size change when a node leaves or joins, so read ``comm.rank`` and
``comm.world_size`` at each use. A collective that fails because a peer died raises as usual; its
caller (the session) calls :meth:`~lockstep.comm.elastic.ElasticGroup.recover`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lockstep.comm.collectives import GroupComm
from lockstep.comm.elastic import ElasticGroup, Handover, Objects, membership_from_env
from lockstep.env import Settings, World

__all__ = ["ElasticComm"]


class ElasticComm(GroupComm):
    """Collectives over the current membership round; rank 0 of a world of 1 until it joins.

    It joins at :meth:`join`, which is given what a change hands over (the session's model,
    optimizer and data position), or at its first collective, handing nothing over.

    Args:
        here: this worker as its node's launcher described it (its local rank and node size).
        open_group: makes the job's :class:`~lockstep.comm.elastic.ElasticGroup` for a handover, at the join.
    """

    membership = "elastic"

    def __init__(self, here: World, open_group: Callable[[Handover], ElasticGroup]) -> None:
        self._here = here
        self._open_group = open_group
        self.group: ElasticGroup | None = None  # made at the join
        super().__init__(here, "gloo", peers=[])

    @classmethod
    def from_settings(cls, here: World, timeout: timedelta, settings: Settings) -> ElasticComm:
        """The comm of a worker of ``lockstep run --nodes MIN:MAX`` (store, secret and node from its launcher).

        The rendezvous store is reached now; the group forms at the join.

        Args:
            here: this worker as its launcher described it.
            timeout: how long a collective waits for a peer (how long a cut link takes to detect).
            settings: the launcher's variables (:func:`~lockstep.env.read_settings`).
        """
        membership, seconds, store = membership_from_env(timeout.total_seconds(), settings, here)
        return cls(here, lambda handover: ElasticGroup(membership, handover, timeout=seconds, store=store))

    @property  # the base class keeps a fixed world; this one follows the rounds
    def world(self) -> World:
        """The current round's world (rank 0 of 1 before :meth:`join`)."""
        view = self.group.view if self.group is not None else None
        if view is None:
            return World(source="lockstep run --nodes")
        nodes = list(dict.fromkeys(m.node for m in view.members))
        me = view.members[view.rank]
        return World(
            rank=view.rank,
            local_rank=me.local_rank,
            world_size=view.world_size,
            local_world_size=me.nproc,
            node_rank=nodes.index(me.node),
            num_nodes=len(nodes),
            source="lockstep run --nodes",
        )

    @world.setter
    def world(self, value: World) -> None:
        self._here = value

    @property
    def round(self) -> int:
        """The membership round this worker is in (a new one after each change; ``-1`` before :meth:`join`)."""
        view = self.group.view if self.group is not None else None
        return view.round if view is not None else -1

    @property
    def joined(self) -> bool:
        """True once this worker is in the job's group."""
        return self.group is not None and self.group.joined

    def join(self, handover: Handover | None = None) -> bool:
        """Enter the job, once: the first round's group forms and the state comes from a live peer.

        Args:
            handover: what this and every later change hands over (nothing when ``None``).

        Returns:
            True when this call joined (False: already in).
        """
        if self.joined:
            return False
        if self.group is None:
            self.group = self._open_group(handover if handover is not None else Objects())
        self.group.start()
        return True

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.join()  # a script that never joined explicitly joins at its first collective
        return super()._call(name, fn, *args, **kwargs)

    def shutdown(self) -> None:
        if not self.joined:
            self._alive = False
            return
        super().shutdown()
