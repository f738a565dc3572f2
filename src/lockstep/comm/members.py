"""Who is in the job now: a rendezvous in rounds for membership that changes while the job runs.

The workers of ``lockstep run --nodes MIN:MAX`` find each other here, in one TCPStore. Every value
is JSON signed with the job's secret (:class:`~lockstep.comm.signed.SignedStore`), never a pickle:
a value an outsider wrote counts as absent, and a counter it bumped is only a hint.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lockstep.comm.signed import SignedStore
from lockstep.errors import LockstepError

__all__ = ["Member", "RoundView", "Membership", "MembershipError", "DEFAULT_LAST_CALL"]

DEFAULT_LAST_CALL = 2.0
"""Seconds a round stays open after the last arrival when a member of the last round is missing."""
_POLL_S = 0.02


class MembershipError(LockstepError):
    """The job could not form a group of at least ``MIN`` nodes in time."""


@dataclass(frozen=True)
class Member:
    """One worker as it posts itself in a round.

    Args:
        node: the id of its node (its launcher's, unique per start of ``lockstep run``).
        host: the host name, for messages.
        local_rank: its index on the node.
        nproc: workers on its node.
        rank: its rank in the last round it was in, ``-1`` for a newcomer.
        step: the last step it committed, ``-1`` for a newcomer.
    """

    node: str
    host: str
    local_rank: int
    nproc: int
    rank: int = -1
    step: int = -1

    @property
    def uid(self) -> str:
        """``node/local_rank``: unique in the job."""
        return f"{self.node}/{self.local_rank}"

    @classmethod
    def here(cls, node: str, local_rank: int, nproc: int) -> Member:
        """This process as a newcomer on this host.

        Args:
            node: the node's id.
            local_rank: its index on the node.
            nproc: workers on the node.
        """
        return cls(node=node, host=socket.gethostname(), local_rank=local_rank, nproc=nproc)


@dataclass(frozen=True)
class RoundView:
    """A closed round as one member sees it.

    Args:
        round: the round's number (its process group uses the store prefix ``pg/{round}/``).
        rank: this member's rank.
        members: every member in rank order.
        left: members of the last round that are not in this one.
        joined: members that were in no earlier round.
        opened: ``time.monotonic()`` when this member entered the round.
    """

    round: int
    rank: int
    members: tuple[Member, ...]
    left: tuple[Member, ...] = ()
    joined: tuple[Member, ...] = ()
    opened: float = field(default=0.0, compare=False)

    @property
    def world_size(self) -> int:
        """Members in this round."""
        return len(self.members)

    @property
    def nodes(self) -> int:
        """Nodes in this round."""
        return len({m.node for m in self.members})


def _nodes_of(arrivals: list[Member]) -> dict[str, list[Member]]:
    """Arrivals by node, in the order nodes first arrived."""
    nodes: dict[str, list[Member]] = {}
    for m in arrivals:
        nodes.setdefault(m.node, []).append(m)
    return nodes


def _whole(nodes: dict[str, list[Member]]) -> dict[str, list[Member]]:
    """The nodes all of whose workers arrived."""
    return {n: ms for n, ms in nodes.items() if len({m.local_rank for m in ms}) >= ms[0].nproc}


class Membership:
    """The rendezvous of one worker, in rounds over the job's store.

    The first arrival of a round leads: it closes the round when every member of the last round
    is back, when one is back and nobody new came for ``last_call`` seconds, or (first round) at
    ``MAX`` nodes, or ``MIN`` after ``last_call``. Only whole nodes count; survivors keep their
    order, newcomers follow. A worker left out tries the next round.

    Args:
        store: the job's store (a ``torch.distributed`` store; a ``PrefixStore`` keeps it apart).
        secret: the job's secret (``--secret-file``); values not signed with it count as absent.
        me: this worker, as a newcomer.
        nodes: ``(MIN, MAX)`` nodes.
        last_call: seconds a round waits after its last arrival when someone is missing.
        timeout: seconds to wait for a round of at least ``MIN`` nodes.
    """

    def __init__(
        self,
        store: Any,
        secret: bytes,
        me: Member,
        nodes: tuple[int, int],
        last_call: float = DEFAULT_LAST_CALL,
        timeout: float = 900.0,
    ) -> None:
        self.store, self.me, self.nodes = SignedStore(store, secret), me, nodes
        self.last_call, self.timeout = last_call, timeout

    def join(self, last: RoundView | None = None, step: int = -1) -> RoundView:
        """Enter the next round (the first open one for a newcomer) and wait until it closes with us in it.

        Args:
            last: the round this member was in; ``None`` for a newcomer.
            step: the last step this member committed.

        Raises:
            MembershipError: no round of at least ``MIN`` nodes formed within ``timeout``.
        """
        opened = time.monotonic()
        me = replace(self.me, rank=last.rank if last else -1, step=step)
        k = last.round + 1 if last else self._first_open()
        while True:
            view = self._enter(k, me, opened)
            if view is not None:
                return view
            k += 1  # closed without us: we came too late, the next round will have us

    def waiting(self, view: RoundView) -> bool:
        """True when a worker posted itself in the round after ``view`` (a node wants to join).

        Args:
            view: the current round.
        """
        return self.store.get_if_set(f"r{view.round + 1}/p/1") is not None

    def _first_open(self) -> int:
        closed = self.store.get_if_set("closed")
        return int(closed) + 1 if closed is not None and closed.isdigit() else 0

    def _enter(self, k: int, me: Member, opened: float) -> RoundView | None:
        n = self.store.add(f"r{k}/n", 1)
        self.store.set(f"r{k}/p/{n}", json.dumps(asdict(me)))
        if n == 1:
            self._lead(k, opened)
        ranks = self._wait_ranks(k, opened)
        uids = [m.uid for m in ranks["members"]]
        if me.uid not in uids:
            return None
        return RoundView(
            round=k,
            rank=uids.index(me.uid),
            members=tuple(ranks["members"]),
            left=tuple(ranks["left"]),
            joined=tuple(ranks["joined"]),
            opened=opened,
        )

    def _arrivals(self, k: int, seen: list[Member]) -> list[Member]:
        """Read the posts of round ``k`` not read yet (an unsigned or malformed post is skipped)."""
        count = self.store.add(f"r{k}/n", 0)
        for n in range(len(seen) + 1, count + 1):
            key = f"r{k}/p/{n}"
            if not self.store.store.check([key]):
                break  # counted but not written yet: read it on the next look
            # forged or broken: a placeholder keeps the numbering
            seen.append(_member(self.store.get(key)) or Member("?", "?", -1, 1))
        return seen

    def _previous(self, k: int) -> list[Member]:
        if k == 0:
            return []
        text = self.store.get_if_set(f"r{k - 1}/ranks")
        return _decode_ranks(text)["members"] if text else []

    def _lead(self, k: int, opened: float) -> None:
        """Close round ``k`` once :meth:`_ready` says so, and publish the ranks."""
        prev = self._previous(k)
        prev_uids = {m.uid for m in prev}
        seen: list[Member] = []
        last_arrival, count = time.monotonic(), 0
        while True:
            seen = self._arrivals(k, seen)
            real = [m for m in seen if m.node != "?"]
            if len(seen) != count:
                count, last_arrival = len(seen), time.monotonic()
            nodes = _nodes_of(real)
            whole = _whole(nodes)
            if self._ready(prev_uids, nodes, whole, time.monotonic() - last_arrival):
                self._publish(k, whole, prev)
                return
            if time.monotonic() - opened > self.timeout:
                return  # the members' own deadline reports it
            time.sleep(_POLL_S)

    def _ready(
        self, prev: set[str], nodes: dict[str, list[Member]], whole: dict[str, list[Member]], quiet: float
    ) -> bool:
        """The closing rule (see :class:`Membership`); a node partly arrived holds the round 3 x ``last_call``."""
        # its other workers are usually just slower; after that it is left out
        low, high = self.nodes
        if len(whole) < low:
            return False
        if len(whole) < len(nodes) and quiet < 3 * self.last_call:
            return False
        arrived = {m.uid for ms in whole.values() for m in ms}
        if prev and prev <= arrived or len(whole) >= high:
            return True
        return quiet >= self.last_call and (not prev or bool(prev & arrived))

    def _publish(self, k: int, whole: dict[str, list[Member]], prev: list[Member]) -> None:
        old_rank = {m.uid: i for i, m in enumerate(prev)}  # a post's own rank is of the round before
        order = sorted(whole.values(), key=lambda ms: min((old_rank.get(m.uid, 1 << 30) for m in ms), default=1 << 30))[
            : self.nodes[1]
        ]
        members = [m for ms in order for m in sorted(ms, key=lambda m: m.local_rank)]
        uids = {m.uid for m in members}
        joined = [m for m in members if m.uid not in old_rank]
        left = [replace(m, rank=i) for i, m in enumerate(prev) if m.uid not in uids]  # ranks they had
        self.store.set(
            f"r{k}/ranks",
            json.dumps(
                {
                    "members": [asdict(m) for m in members],
                    "left": [asdict(m) for m in left],
                    "joined": [asdict(m) for m in joined],
                }
            ),
        )
        self.store.set("closed", str(k))

    def _wait_ranks(self, k: int, opened: float) -> dict[str, list[Member]]:
        while True:
            text = self.store.get_if_set(f"r{k}/ranks")
            if text is not None:
                return _decode_ranks(text)
            if time.monotonic() - opened > self.timeout:
                raise MembershipError(
                    f"no group of at least {self.nodes[0]} node(s) formed within {self.timeout:g} s "
                    f"(round {k}): start more nodes with the same --master and --secret-file, or lower MIN "
                    "in --nodes MIN:MAX"
                )
            time.sleep(_POLL_S)


def _member(text: str | None) -> Member | None:
    """A post, checked for form (its signature was checked by the store)."""
    try:
        data = json.loads(text) if text is not None else None
        return Member(**data) if isinstance(data, dict) else None
    except (TypeError, ValueError):
        return None


def _decode_ranks(text: str) -> dict[str, list[Member]]:
    data = json.loads(text)
    return {key: [Member(**m) for m in data[key]] for key in ("members", "left", "joined")}
