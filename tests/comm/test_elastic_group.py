"""ElasticGroup in one process: the disk fallback when no member holds the state, a lost peer's
error rebuilds the group, any other error is the user's."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lockstep.comm.elastic import ElasticGroup, Objects, describe_change, is_membership_failure
from lockstep.comm.members import Member, Membership, RoundView

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def group() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    membership = Membership(dist.PrefixStore("el/", store), b"s", Member("a", "host-a", 0, 1), (1, 1), last_call=0.2)
    model = torch.nn.Linear(2, 1)

    def restore() -> int:  # what a disk checkpoint would give back
        with torch.no_grad():
            model.weight.fill_(0.5)
        return 5

    out = io.StringIO()
    handover = Objects(
        {"model": model}, describe=lambda world: f"micro-batch {24 // world} × accumulation 1", from_disk=restore
    )
    g = ElasticGroup(membership, handover, timeout=10, out=out)
    g.keep = store  # type: ignore[attr-defined]
    yield g, model, out
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_disk_is_the_fallback_when_no_member_holds_the_state(group: Any) -> None:
    g, model, out = group
    g.start()
    assert g.step == 5 and torch.all(model.weight == 0.5)
    assert (
        "joined host host-a (node a, rank 0); world size 1 on 1 node; micro-batch 24 × accumulation 1; "
        "resumed at step 5" in out.getvalue()
    )


def test_a_lost_peer_rebuilds_the_group_and_the_step_runs_again(group: Any) -> None:
    g, model, _ = group
    g.start()
    assert g.run_step(lambda: None) and g.step == 6

    def lost() -> None:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [10.0.0.2]:7601")

    rounds = g.view.round
    assert g.run_step(lost) is False
    assert g.step == 6 and g.view.round == rounds + 1 and dist.is_initialized()
    assert g.events[-1]["step lost"] >= 0

    def bug() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        g.run_step(bug)


def test_which_errors_are_a_lost_peer() -> None:
    assert is_membership_failure(RuntimeError("Connection closed by peer [10.0.0.2]:1234"))
    assert not is_membership_failure(ValueError("timeout"))
    view = RoundView(round=3, rank=0, members=(Member("a", "ha", 0, 1, 0, 7),), left=(Member("b", "hb", 0, 1, 1, 7),))
    line = describe_change(view, 7, "micro-batch 24 × accumulation 1", {"step lost": 0.5, "rendezvous": 2.0})
    assert line == (
        "lockstep run: membership: left host hb (node b, rank 1); world size 1 on 1 node; micro-batch 24 × "
        "accumulation 1; resumed at step 7; cost 2.50 s (step lost 0.50 s, rendezvous 2.00 s)"
    )
