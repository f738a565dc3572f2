"""comm: null object at world size 1, real collectives and the handshake at 2 and 3 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lockstep.comm.group import Comm, CommError, init_comm
from lockstep.env import World
from support.dist import run_distributed
from support.elastic import free_port as _free_port


def test_world_size_one_is_null_object() -> None:
    comm = init_comm(World())
    assert type(comm) is Comm
    t = torch.tensor([3.0])
    assert comm.all_reduce(t, "mean") is t and t.item() == 3.0
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
    assert comm.broadcast_object("x") == "x"
    comm.barrier()
    comm.shutdown()
    assert not torch.distributed.is_initialized()


def test_unknown_op_refused() -> None:
    with pytest.raises(ValueError, match="unknown reduction"):
        Comm(World()).all_reduce(torch.ones(1), "avg")


def _collectives() -> dict:
    comm = init_comm(timeout=30)
    r = comm.rank
    out = {
        "sum": comm.all_reduce(torch.tensor([float(r)])).item(),
        "mean": comm.all_reduce(torch.tensor([float(r)]), "mean").item(),
        "max": comm.all_reduce(torch.tensor([r]), "max").item(),
        "bcast": comm.broadcast(torch.tensor([r + 10]), src=1).item(),
        "objs": comm.all_gather_object(r * 2),
        "bobj": comm.broadcast_object(f"from{r}", src=0),
        "peers": [p["rank"] for p in comm.peers],
        "backend": comm.backend,
    }
    # started, then a blocking collective issued after it, then read: the two do not mix up
    started = comm.all_reduce_async(torch.tensor([float(r), -float(r)]), "max")
    meaned = comm.all_reduce_async(torch.tensor([float(r + 1)]), "mean")
    out["between"] = comm.all_reduce(torch.tensor([1])).item()
    out["async_max"] = started.wait().tolist()
    out["async_mean"] = meaned.wait().item()
    out["waited_twice"] = meaned.wait().item()  # the result again, no second wait
    comm.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_file_init(world_size: int) -> None:
    results = run_distributed(_collectives, world_size)
    total = sum(range(world_size))
    for res in results:
        assert res["sum"] == total
        assert res["mean"] == pytest.approx(total / world_size)
        assert res["max"] == world_size - 1
        assert res["bcast"] == 11
        assert res["objs"] == [2 * r for r in range(world_size)]
        assert res["bobj"] == "from0"
        assert res["peers"] == list(range(world_size))
        assert res["backend"] == "gloo"
        assert res["between"] == world_size
        assert res["async_max"] == [world_size - 1, 0.0]
        assert res["async_mean"] == res["waited_twice"] == pytest.approx((world_size + 1) / 2)


_SCRIPT = textwrap.dedent("""
    import sys, torch
    from lockstep.comm.group import init_comm
    from lockstep.env import detect_world
    comm = init_comm(detect_world(), init_method=sys.argv[1] if len(sys.argv) > 1 else None, timeout=20)
    print("SUM", int(comm.all_reduce(torch.tensor([comm.rank])).item()), flush=True)
    comm.shutdown()
""")


def _launch(
    tmp_path: Path, envs: list[dict[str, str]], args: list[str], text: str = _SCRIPT
) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "s.py"
    script.write_text(text)
    procs = []
    for extra in envs:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(extra)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return outs


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("scheme", ["env", "tcp"])
def test_init_by_env_and_tcp(tmp_path: Path, scheme: str) -> None:
    port = _free_port()
    base = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = [] if scheme == "env" else [f"tcp://127.0.0.1:{port}"]
    outs = _launch(tmp_path, [{**base, "RANK": "0"}, {**base, "RANK": "1"}], args)
    for o in outs:
        assert o.returncode == 0, o.stdout
        assert "SUM 1" in o.stdout


_TWO_GROUPS = textwrap.dedent("""
    import os, pathlib, sys, time, torch
    import lockstep.comm.group as group
    marks, rank, kept, opened = pathlib.Path(sys.argv[2]), int(os.environ["RANK"]), [], [0]
    real_open = group.open_store

    def open_store(*args, **kwargs):
        store = real_open(*args, **kwargs)
        if rank == 0:
            kept.append(store)  # rank 0's first store (and its server) lives on until released below
        else:
            opened[0] += 1
            (marks / f"opened-{opened[0]}").touch()
        return store

    group.open_store = open_store
    comm = group.init_comm(init_method=sys.argv[1], timeout=30)
    comm.shutdown()
    if rank == 0:  # rank 1 has reached the first group's store again, forming its second group
        while not (marks / "opened-2").exists():
            time.sleep(0.01)
        kept.clear()
    comm = group.init_comm(init_method=sys.argv[1], timeout=30)
    print("SUM", int(comm.all_reduce(torch.ones(1)).item()), flush=True)
    comm.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_second_group_never_joins_the_first_groups_store(tmp_path: Path) -> None:
    """rank 0 hosts the store of each group: a rank that forms its next group while rank 0 still tears the
    last one down reaches the old store (its own post there), and must wait for the next one, not fail
    with "two processes claim rank 1" (seen once in make test)."""
    port = _free_port()
    base = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    marks = tmp_path / "marks"
    marks.mkdir()
    envs = [{**base, "RANK": "0"}, {**base, "RANK": "1"}]
    outs = _launch(tmp_path, envs, [f"tcp://127.0.0.1:{port}", str(marks)], _TWO_GROUPS)
    for o in outs:
        assert o.returncode == 0 and "SUM 2" in o.stdout, o.stdout
    assert (marks / "opened-2").exists()  # rank 1 did reach the old store


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_second_group_on_a_store_that_outlives_the_first_reads_only_its_own_keys(tmp_path: Path) -> None:
    """A file store (like the launcher's agent store) keeps the first group's keys while a rank still holds it:
    the second group's handshake must not read them (it failed with "two processes claim rank 1", one pid twice)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    envs = [{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}]
    outs = _launch(tmp_path, envs, [f"file://{tmp_path}/rdzv", str(marks)], _TWO_GROUPS)
    for o in outs:
        assert o.returncode == 0 and "SUM 2" in o.stdout, o.stdout
    assert (marks / "opened-2").exists()  # rank 1 opened the store again while rank 0 still held the first


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_world_size_mismatch_refused(tmp_path: Path) -> None:
    """FAULTS row 8: both ranks and both values are named."""
    init = f"file://{tmp_path}/rdzv"
    outs = _launch(tmp_path, [{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "3"}], [init])
    for o in outs:
        assert o.returncode != 0
        assert "disagree on the world size" in o.stdout
        assert "WORLD_SIZE=2" in o.stdout and "WORLD_SIZE=3" in o.stdout
        assert "rank 0" in o.stdout and "rank 1" in o.stdout


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_duplicate_rank_refused(tmp_path: Path) -> None:
    """FAULTS row 9: RANK=0 twice is a configuration error, not a store timeout."""
    init = f"file://{tmp_path}/rdzv"
    outs = _launch(tmp_path, [{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "2"}], [init])
    for o in outs:
        assert o.returncode != 0
        assert "two processes claim rank 0" in o.stdout


def test_out_of_range_rank_refused_before_any_group() -> None:
    """FAULTS row 9: RANK=2 with WORLD_SIZE=2 fails in env, before a process group exists."""
    from lockstep.env import WorldError, detect_world

    with pytest.raises(WorldError, match="rank 2 is out of range for world_size 2"):
        detect_world({"RANK": "2", "WORLD_SIZE": "2"})
    assert not torch.distributed.is_initialized()


def test_busy_port_named(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        world = World(rank=0, world_size=2, local_world_size=2, master_port=port)
        with pytest.raises(CommError, match=str(port)):
            init_comm(world, timeout=5)


def test_store_that_never_listens_is_named() -> None:
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = World(rank=1, world_size=2, local_world_size=2, master_port=port)
    with pytest.raises(CommError, match=f"rank 1 could not reach the rendezvous store at 127.0.0.1:{port} within 1 s"):
        init_comm(world, timeout=1)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_rank_that_starts_before_the_store_joins_when_it_listens(tmp_path: Path) -> None:
    """Rank 1 starts first and waits for rank 0's store (probing it, not torch's backoff)."""
    port = _free_port()
    code = textwrap.dedent(f"""
        import sys
        from lockstep.comm.group import init_comm
        from lockstep.env import World
        rank = int(sys.argv[1])
        print("joining", flush=True)
        comm = init_comm(World(rank=rank, world_size=2, local_world_size=2, master_port={port}), timeout=60)
        print("sum", comm.all_reduce(__import__("torch").tensor([rank + 1.0])).item())
        comm.shutdown()
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for r in (1, 0):  # rank 0 (the store) starts only once rank 1 is joining, however slow the machine
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, text=True, env=env))
        assert procs[-1].stdout is not None and procs[-1].stdout.readline() == "joining\n"
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("sum 3.0" in out for out in outs), outs
