"""The membership rendezvous of ``--nodes MIN:MAX`` (lockstep.comm.members): rounds, leaving, joining,
and an outsider's pickles, over a real TCPStore with one thread per worker."""

from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lockstep.comm.members import Member, Membership, MembershipError, RoundView

pytestmark = pytest.mark.timeout(60)

SECRET = b"job secret"


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))


def _membership(
    store: Any,
    node: str,
    local_rank: int = 0,
    nproc: int = 1,
    nodes: tuple[int, int] = (1, 3),
    secret: bytes = SECRET,
    **kw: Any,
) -> Membership:
    me = Member(node=node, host=f"host-{node}", local_rank=local_rank, nproc=nproc)
    return Membership(dist.PrefixStore("el/", store), secret, me, nodes, last_call=kw.pop("last_call", 0.5), **kw)


def _join_all(calls: list[Any]) -> list[RoundView]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for value in out:
        if isinstance(value, BaseException):
            raise value
    return out


def test_first_round_takes_every_node_up_to_max(store: Any) -> None:
    ms = [_membership(store, n, lr, nproc=2) for n in "abc" for lr in (0, 1)]
    views = _join_all([m.join for m in ms])
    assert {v.world_size for v in views} == {6}
    assert sorted(v.rank for v in views) == list(range(6))
    # each node's workers sit together, in local-rank order
    for v in views:
        nodes = [m.node for m in v.members]
        assert nodes == sorted(nodes, key=nodes.index) and len(set(nodes[0:2])) == 1
        assert [m.local_rank for m in v.members[0:2]] == [0, 1]


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_node_that_never_comes_back_is_dropped(store: Any) -> None:
    # last_call far above the moment between c's arrival and a's: both are in the second round
    ms = {n: _membership(store, n, last_call=3.0) for n in "abc"}
    first = dict(zip("abc", _join_all([m.join for m in ms.values()])))
    # node b died: a and c come back with their committed steps, the later-ranked first (survivors keep
    # their old order whatever the arrival order); the round closes after last_call
    later, sooner = sorted("ac", key=lambda n: -first[n].rank)
    second_of: dict[str, Any] = {}
    came = threading.Thread(target=lambda: second_of.update({later: ms[later].join(first[later], step=7)}))
    came.start()
    posts = dist.PrefixStore("el/", store)
    while not posts.check(["r1/p/1"]):  # its post is in: the other one arrives second (the test's timeout guards)
        time.sleep(0.01)  # a store's wait() would hold the interpreter lock from the joining thread
    second_of[sooner] = ms[sooner].join(first[sooner], step=7)
    came.join(30)
    second = [second_of["a"], second_of["c"]]
    assert [v.world_size for v in second] == [2, 2]
    assert [m.node for m in second[0].left] == ["b"] and second[0].joined == ()
    assert {m.step for m in second[0].members} == {7}
    # survivors keep their old order (the first round's ranks, set by arrival)
    assert [m.node for m in second[0].members] == sorted("ac", key=lambda n: first[n].rank)


def test_a_late_node_waits_and_is_let_in(store: Any) -> None:
    ms = {n: _membership(store, n) for n in "ab"}
    first = dict(zip("ab", _join_all([m.join for m in ms.values()])))
    late = _membership(store, "c")
    result: list[RoundView] = []
    joiner = threading.Thread(target=lambda: result.append(late.join()))
    joiner.start()
    while not ms["a"].waiting(first["a"]):
        threading.Event().wait(0.02)
    assert ms["b"].waiting(first["b"])
    second = _join_all([lambda: ms["a"].join(first["a"], step=15), lambda: ms["b"].join(first["b"], step=15)])
    joiner.join(30)
    assert result and result[0].rank == 2 and result[0].world_size == 3
    assert [m.node for m in second[0].joined] == ["c"] and second[0].left == ()


def test_a_round_below_min_times_out_with_a_clear_error(store: Any) -> None:
    m = _membership(store, "a", nodes=(2, 3), timeout=1.0)
    with pytest.raises(MembershipError, match="at least 2 node"):
        m.join()


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def test_an_outsiders_pickles_run_no_code_and_forged_posts_are_ignored(store: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ms = {n: _membership(store, n) for n in "ab"}
    first = dict(zip("ab", _join_all([m.join for m in ms.values()])))
    payload = pickle.dumps(_Marker(str(marker)))
    keys = [f"el/{k}" for k in ("closed", "r0/n", "r0/p/1", "r0/p/2", "r0/ranks", "r1/n", "r1/p/1", "r1/ranks")]
    for key in keys:
        store.set(key, payload)  # every key of the rendezvous, overwritten by someone without the secret
    assert not ms["a"].waiting(first["a"])  # a forged post is no newcomer
    forged = _membership(store, "x", secret=b"wrong")  # a process that does not hold the secret
    forged.store.set("r1/p/1", "{}")
    second = _join_all([lambda: ms["a"].join(first["a"], step=3), lambda: ms["b"].join(first["b"], step=3)])
    assert [v.world_size for v in second] == [2, 2]
    assert all(m.node in "ab" for m in second[0].members)
    assert not marker.exists()


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_node_whose_workers_arrive_apart_joins_whole_and_no_round_forms_without_the_group(store: Any) -> None:
    group = [_membership(store, "a", lr, nproc=2) for lr in (0, 1)]
    views = _join_all([m.join for m in group])
    rounds: list[list[str]] = []

    def member(i: int) -> None:  # the live group: both workers look at each step boundary
        view = views[i]
        while view.world_size < 4:
            if group[i].waiting(view):
                view = group[i].join(view, step=16)
                rounds.append([m.uid for m in view.members])
            threading.Event().wait(0.05 + 0.6 * i)  # the second worker of the node is slow

    late = [_membership(store, "c", lr, nproc=2) for lr in (0, 1)]

    def newcomer(i: int) -> RoundView:
        threading.Event().wait(1.5 * i)  # node c's second worker starts 1.5 s after the first
        return late[i].join()

    threads = [threading.Thread(target=member, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    joined = _join_all([lambda: newcomer(0), lambda: newcomer(1)])
    for t in threads:
        t.join(30)
    assert [v.world_size for v in joined] == [4, 4]
    assert all({"a/0", "a/1"} <= set(r) for r in rounds), rounds  # never a round without the live group
    assert rounds[-1] == ["a/0", "a/1", "c/0", "c/1"]


def test_nodes_min_max_is_read_like_torchruns_nnodes_and_needs_a_secret(tmp_path: Path) -> None:
    from lockstep.errors import ConfigError
    from lockstep.launch.spec import LaunchSpec, parse_nodes

    assert parse_nodes("2") == (2, None) and parse_nodes("1:3") == (1, 3)
    with pytest.raises(ConfigError, match="MIN:MAX"):
        parse_nodes("1-3")
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="needs --secret-file"):
        LaunchSpec(str(script), nodes=1, max_nodes=3, master="10.0.0.1:29400")
    with pytest.raises(ConfigError, match="needs --master"):
        LaunchSpec(str(script), nodes=1, max_nodes=3, secret="s")
    with pytest.raises(ConfigError, match="at most MAX"):
        LaunchSpec(str(script), nodes=3, max_nodes=2, master="10.0.0.1:29400", secret="s")
    assert LaunchSpec(str(script), nodes=1, max_nodes=3, master="10.0.0.1:29400", secret="s").elastic


def test_only_run_takes_a_range_of_nodes() -> None:
    import argparse

    from lockstep.cli.flags import add_launch_flags, launch_options
    from lockstep.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    args = parser.parse_args(["--nodes", "1:3", "--master", "10.0.0.1:29400"])
    assert launch_options(args, elastic=True)["max_nodes"] == 3
    with pytest.raises(ConfigError, match="a range of nodes is for `lockstep run`"):
        launch_options(args)
    assert "max_nodes" not in launch_options(parser.parse_args(["--nodes", "2"]))
