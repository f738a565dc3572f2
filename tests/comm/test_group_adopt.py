"""A process group formed before lockstep (Ray Train's TorchTrainer does this) is adopted, and a
multi-node job whose host name resolves to loopback is refused up front."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from lockstep.comm.group import CommError, check_reachable_host
from lockstep.env import Settings
from support.dist import run_distributed


def _formed_first(keep_env: bool) -> tuple[int, int, float, bool]:
    import torch
    import torch.distributed as dist

    import lockstep

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["LOCKSTEP_INIT_METHOD"], rank=rank, world_size=size)
    if not keep_env:  # the group alone says where this process is
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
    session = lockstep.Session(strategy="ddp", quiet=True)
    model, opt = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    session.backward(model(torch.ones(3, 2)).sum())
    session.step(opt)
    total = session.all_reduce(float(session.rank))
    session.close()
    still = dist.is_initialized()  # lockstep leaves a group it did not form to its owner
    dist.destroy_process_group()
    return session.rank, session.world_size, total, still


@pytest.mark.slow
@pytest.mark.parametrize("keep_env", [True, False])
def test_an_existing_group_is_adopted(keep_env: bool) -> None:
    results = run_distributed(_formed_first, 2, keep_env)
    assert results == [(0, 2, 1.0, True), (1, 2, 1.0, True)]


def _async_save_then_close(folder: str) -> tuple[int, int, bool]:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    import lockstep

    dist.init_process_group(
        "gloo",
        init_method=os.environ["LOCKSTEP_INIT_METHOD"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    before = len(_world.pg_map)
    session = lockstep.Session(strategy="ddp", quiet=True)
    model, opt = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    session.save(folder, model=model, optimizer=opt, blocking=False)  # makes the writers' group
    during = len(_world.pg_map)
    session.close()
    after, still = len(_world.pg_map), dist.is_initialized()
    dist.destroy_process_group()
    return during - before, after - before, still


@pytest.mark.slow
def test_closing_on_an_adopted_group_destroys_only_the_writers_group(tmp_path: Path) -> None:
    # the background save's own gloo group is lockstep's; the adopted default group stays its owner's
    results = run_distributed(_async_save_then_close, 2, str(tmp_path / "ckpt"))
    assert results == [(1, 0, True), (1, 0, True)]
    assert (tmp_path / "ckpt" / "step-000000" / "manifest.json").is_file()


def test_host_name_resolving_to_loopback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    with pytest.raises(CommError, match="node1.*127.0.1.1.*GLOO_SOCKET_IFNAME"):
        check_reachable_host("gloo", Settings())
    with pytest.raises(CommError, match="NCCL_SOCKET_IFNAME"):
        check_reachable_host("nccl", Settings())
    check_reachable_host("gloo", Settings(gloo_ifname="eth0"))  # the interface is named: no lookup
    check_reachable_host("gloo", Settings(), master_addr="127.0.0.1")  # every "node" is this host
    with pytest.raises(CommError):
        check_reachable_host("gloo", Settings(), master_addr="192.0.2.1")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "192.0.2.7")
    check_reachable_host("gloo", Settings())
