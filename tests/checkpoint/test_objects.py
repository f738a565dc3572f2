"""Checkpoints on a real S3 server (SeaweedFS ``weed mini``, tests/support/s3.py): sessions at world 1, 2
and 3 save to and resume from ``s3://``; a rank SIGKILLed at random points of its uploads never
leaves a checkpoint that a resume takes; corrupt and missing objects are named and skipped; a
second job on the same prefix is refused."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint.files import CorruptCheckpointError
from lockstep.checkpoint.layout import step_name
from lockstep.checkpoint.lock import FolderInUseError
from lockstep.checkpoint.manifest import MANIFEST_FILE
from lockstep.checkpoint.objects import committed_steps, load_objects, object_reader, save_objects
from lockstep.checkpoint.objlock import lock_objects
from lockstep.checkpoint.storage import open_storage
from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.session.preempt import Preempted
from support.dist import run_distributed
from support.parity import session_step

GLOBAL_BATCH = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def _kill_at(rank: int, kill: tuple[int, int, str, str] | None, signum: int = 9) -> None:
    """Make this rank SIGKILL itself (or send itself ``signum``) at its ``k``-th object write (before or after
    it), if it is ``kill``'s rank; it touches ``kill[3]`` first, so the test knows the planned kill (not another
    failure) ended the run."""
    if kill is None or kill[0] != rank:
        return
    from lockstep.checkpoint.storage import FsspecStorage

    count = [0]
    for method in ("put", "put_new"):
        original = getattr(FsspecStorage, method)

        def wrapped(self: Any, name: str, data: bytes, _original: Any = original) -> Any:
            count[0] += 1
            if count[0] == kill[1] and kill[2] == "before":
                Path(kill[3]).write_text(name)
                os.kill(os.getpid(), signum)
            out = _original(self, name, data)
            if count[0] == kill[1] and kill[2] == "after":
                Path(kill[3]).write_text(name)
                os.kill(os.getpid(), signum)
            return out

        setattr(FsspecStorage, method, wrapped)


def _train(
    env: dict[str, str],
    url: str,
    steps: int,
    blocking: bool = True,
    kill: tuple[int, int, str, str] | None = None,
    expect: int | None = None,
) -> dict[str, Any]:
    os.environ.update(env)
    session = lockstep.Session(
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single", quiet=True, timeout=60
    )
    _kill_at(session.rank, kill)
    model, opt = session.setup(_model(), lambda p: torch.optim.Adam(p, lr=0.01))
    resume = session.load(url, model=model, optimizer=opt)
    assert expect is None or resume.step == expect, f"resumed from step {resume.step}, not {expect}"
    loaded = {
        "step": resume.step,
        "path": resume.path,
        "weights": {k: v.clone() for k, v in session.strategy.model_state_dict(model).items()},
    }
    while session.global_step < steps:
        session_step(session, model, opt, GLOBAL_BATCH)
        if session.global_step % 2 == 0:
            session.save(url, model=model, optimizer=opt, keep=2, blocking=blocking)
    out = {**loaded, "final": session.strategy.model_state_dict(model)}
    session.close()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_conditional_put_is_honoured_by_the_server(s3: Any) -> None:
    storage = open_storage(s3.url())
    assert storage.put_new("step-000001/manifest.json", b"first")
    assert not storage.put_new("step-000001/manifest.json", b"second")  # If-None-Match: * -> 412
    assert storage.get("step-000001/manifest.json") == b"first"
    assert storage.list() == {"step-000001/manifest.json": 5}


@pytest.mark.e2e  # resumes at two other world sizes; make test resumes through the object store in the other tests here
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world_2_saves_and_resumes_at_1_and_3(s3: Any) -> None:
    url = s3.url()
    first = run_distributed(_train, 2, s3.env, url, 6, timeout=200)
    storage = open_storage(url)
    assert committed_steps(storage) == [4, 6]  # keep=2, pruned
    assert {"step-000006/sharded/__0_0.distcp", "step-000006/sharded/__1_0.distcp"} <= set(storage.list())
    for world in (1, 3):
        resumed = run_distributed(_train, world, s3.env, url, 6, timeout=200)
        for rank in resumed:
            assert rank["step"] == 6 and rank["path"] == f"{url}/step-000006"
            assert _same(rank["weights"], first[0]["final"])


def _corrupt(s3: Any, url: str, step: int, how: str) -> str:
    storage = open_storage(url)
    name = next(n for n in storage.list(f"step-{step:06d}/") if n.endswith("__1_0.distcp"))
    bucket, prefix = url[len("s3://") :].split("/", 1)
    client = s3.client()
    if how == "flip":
        data = bytearray(storage.get(name))
        data[len(data) // 2] ^= 0x40
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=bytes(data))
    else:
        client.delete_object(Bucket=bucket, Key=f"{prefix}/{name}")
    return name


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", [pytest.param("flip", marks=pytest.mark.e2e), "missing"])
def test_bad_object_is_named_and_the_previous_checkpoint_used(s3: Any, how: str) -> None:
    url = s3.url()
    first = run_distributed(_train, 2, s3.env, url, 4, timeout=200)
    assert committed_steps(open_storage(url)) == [2, 4]
    name = _corrupt(s3, url, 4, how)
    with pytest.raises(CorruptCheckpointError, match=name.split("/")[-1]):
        load_objects(url, Comm(World()), fallback=False)
    resumed = run_distributed(_train, 2, s3.env, url, 4, timeout=200)
    assert [r["step"] for r in resumed] == [2, 2]
    assert _same(resumed[0]["final"], first[0]["final"])  # step 2 was intact: retrained to 4 alike


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_keep_after_a_fallback_prunes_the_corrupt_checkpoint(s3: Any) -> None:
    url, comm = s3.url(), Comm(World())
    for step in (1, 2, 3):
        save_objects(url, {"step": step, "w": torch.full((8,), float(step))}, comm, step=step)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/step-000003/state.pt", Body=b"not the saved bytes")
    loaded = load_objects(url, comm)
    assert loaded is not None and loaded["step"] == 2 and loaded["unusable"] == [3]
    save_objects(url, {"step": 4}, comm, step=4, keep=2, unusable=loaded["unusable"])
    storage = open_storage(url)
    assert committed_steps(storage) == [2, 4]  # the corrupt 3 went, not the good 2
    (aside,) = {name.split("/")[0] for name in storage.list() if name.startswith("unusable-step-000003-")}
    assert storage.get(f"{aside}/state.pt") == b"not the saved bytes"  # moved aside, not deleted


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_job_on_the_prefix_is_refused_naming_the_holder(s3: Any) -> None:
    url = s3.url()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from lockstep.checkpoint.objlock import lock_objects
        from lockstep.comm.group import Comm
        from lockstep.env import World
        lock = lock_objects({url!r}, Comm(World()))
        print("held", flush=True)
        sys.stdin.read()
        lock.release()
    """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **s3.env},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError, match=rf"{url} is in use by another job \(host .*, pid {holder.pid},"):
            lock_objects(url, Comm(World()))
    finally:
        holder.communicate("", timeout=30)
    lock_objects(url, Comm(World())).release()  # free once the holder ended


@pytest.mark.slow
@pytest.mark.e2e  # 21 two-rank runs: make test-e2e
@pytest.mark.timeout(3000)  # 20 jobs killed and restarted: 2 to 30 minutes on 2 cores, by load
def test_kill_9_during_uploads_never_resumes_from_a_partial_checkpoint(s3: Any, tmp_path: Path) -> None:
    """20 SIGKILLs of a rank at random object writes (blocking and background saves); every resume
    loads the newest committed checkpoint; every finished run ends bit-identical to an uninterrupted one."""
    steps = 8
    whole = run_distributed(_train, 2, s3.env, s3.url(), steps, timeout=200)[0]["final"]
    rng = random.Random(22)
    url, kills = s3.url(), 0
    while True:
        # rank 0 writes the lock object, then 5 objects a save (state.pt, .metadata, its shard,
        # manifest, latest); rank 1 its shard: 4 saves in a whole run
        rank, marker = rng.randrange(2), tmp_path / f"killed-{kills}"
        kill = (
            (rank, rng.randint(1, 21 if rank == 0 else 4), rng.choice(["before", "after"]), str(marker))
            if kills < 20
            else None
        )
        newest = (committed_steps(open_storage(url)) or [0])[-1]
        try:
            out = run_distributed(_train, 2, s3.env, url, steps, kills % 2 == 0, kill, newest, timeout=200)
        except AssertionError as exc:  # only the planned SIGKILL may end an attempt
            assert kill is not None and marker.exists(), str(exc)[-3000:]
            kills += 1
            print(
                f"kill {kills}: rank {kill[0]}, {kill[2]} writing {marker.read_text()}; this run resumed from "
                f"step {newest}, committed now {committed_steps(open_storage(url))}",
                flush=True,
            )
            continue
        assert _same(out[0]["final"], whole) and _same(out[1]["final"], whole)
        if kill is None:
            break
        url = s3.url()  # that run finished before its kill point: the next kills start a fresh run


def _stopped(env: dict[str, str], url: str, steps: int, term: tuple[int, int, str, str]) -> dict[str, Any]:
    """Background saves every 2 steps until a SIGTERM (sent by a rank to itself during one of its uploads)
    stops the job: what the stop reported."""
    os.environ.update(env)
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=60)
    _kill_at(session.rank, term, signal.SIGTERM)
    model, opt = session.setup(_model(), lambda p: torch.optim.Adam(p, lr=0.01))
    session.load(url, model=model, optimizer=opt)
    try:
        while session.global_step < steps:
            session_step(session, model, opt, GLOBAL_BATCH)
            if session.global_step % 2 == 0:
                session.save(url, model=model, optimizer=opt, keep=2, blocking=False)
    except Preempted as stop:
        return {"step": stop.step, "path": str(stop.path)}
    session.close()
    return {"step": None, "path": None}


@pytest.mark.slow
@pytest.mark.e2e  # three two-rank runs a case
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_during_a_background_upload_commits_whole_checkpoints_only(s3: Any, tmp_path: Path, rank: int) -> None:
    """A preemption that lands while a background save uploads: the upload finishes inside the grace, the stop's
    own save is committed, every committed checkpoint verifies, and the resumed run ends bit-identical."""
    steps = 12
    url, marker = s3.url(), tmp_path / "signalled"
    # rank 0's third write is inside the first background save; rank 1's second, inside the second save
    stops = run_distributed(_stopped, 2, s3.env, url, 10 * steps, (rank, 3 - rank, "before", str(marker)), timeout=200)
    assert marker.exists() and stops[0]["step"] == stops[1]["step"] is not None
    stopped = stops[0]["step"]
    assert stops[0]["path"] == f"{url}/step-{stopped:06d}" and committed_steps(open_storage(url))[-1] == stopped
    storage = open_storage(url)
    for step in committed_steps(storage):  # each one whole: every object its manifest lists reads back and verifies
        files = json.loads(storage.get(f"{step_name(step)}/{MANIFEST_FILE}"))["files"]
        read = object_reader(storage, step, files)
        assert all(read(name) is not None for name in files)
    resumed = run_distributed(_train, 2, s3.env, url, stopped + steps, False, None, stopped, timeout=200)
    again = run_distributed(_train, 2, s3.env, s3.url(), stopped + steps, timeout=200)[0]["final"]
    assert _same(resumed[0]["final"], again) and _same(resumed[1]["final"], again)


@pytest.mark.slow
@pytest.mark.e2e  # lockstep train end to end, its checkpoints in S3
@pytest.mark.timeout(400)
def test_lockstep_train_out_url_resumes_from_s3(s3: Any, tmp_path: Any) -> None:
    url = s3.url()
    flags = ["--nproc", "2", "--out", url, "--max-steps", "3", "--progress", "off"]

    def train(*more: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lockstep", "train", *flags, *more],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    first = train("--epochs", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    assert committed_steps(open_storage(f"{url}/checkpoints")) == [3]
    second = train("--epochs", "2")
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {url}/checkpoints/step-000003" in second.stdout
    assert committed_steps(open_storage(f"{url}/checkpoints")) == [3, 6]
    assert not list(tmp_path.iterdir())  # nothing written locally
