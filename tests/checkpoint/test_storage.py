"""The object-store checkpoint protocol on the storage interface, in one process (no server).

The protocol (:mod:`lockstep.checkpoint.objects`) runs here over :class:`LocalStorage` and over a
storage that fails on purpose; ``tests/checkpoint/test_objects.py`` runs it against a real S3 server.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.checkpoint.files import CheckpointError, CorruptCheckpointError
from lockstep.checkpoint.lock import FolderInUseError
from lockstep.checkpoint.objects import LATEST, committed_steps, load_objects, save_objects
from lockstep.checkpoint.objlock import lock_objects
from lockstep.checkpoint.storage import FsspecStorage, LocalStorage, ObjectStoreError, is_url, location
from lockstep.comm.group import Comm
from lockstep.env import World

COMM = Comm(World())


def _save(storage: Any, step: int, keep: int | None = None, value: float = 1.0) -> str:
    model = {"w": torch.full((3,), value), "b": torch.arange(4.0)}
    return save_objects(
        "mem://x",
        {"step": step, "extras": {"v": value}},
        COMM,
        step=step,
        keep=keep,
        replicated={"model": model},
        position=[{"cursor": step}],
        storage=storage,
    )


def test_urls_and_locations() -> None:
    assert is_url("s3://b/r") and is_url("gs://b/r") and not is_url("runs/a") and not is_url("file:///tmp/a")
    assert location("s3://b/r/") == "s3://b/r" and location("file:///tmp/a") == Path("/tmp/a")


def test_save_load_prune_and_latest(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for step in (1, 2, 3):
        _save(storage, step, keep=2, value=float(step))
    assert committed_steps(storage) == [2, 3]
    assert storage.get(LATEST) == b"step-000003"
    manifest = json.loads(storage.get("step-000003/manifest.json"))
    assert manifest["world_size"] == 1 and manifest["step"] == 3 and manifest["position"] == [{"cursor": 3}]
    assert all(len(r["xxh3_128"]) == 32 for r in manifest["files"].values())
    state = load_objects("mem://x", COMM, storage=storage)
    assert state is not None and state["step"] == 3 and torch.equal(state["model"]["w"], torch.full((3,), 3.0))


def test_partial_upload_is_never_used_and_is_cleaned(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _save(storage, 1)
    storage.put("step-000002/state.pt", b"half")  # a save killed before its manifest
    state = load_objects("mem://x", COMM, storage=storage)
    assert state is not None and state["step"] == 1
    _save(storage, 3)
    assert not storage.list("step-000002/")  # older partial uploads go at the next commit


@pytest.mark.parametrize("damage", ["flip", "missing", "manifest"])
def test_bad_checkpoint_is_named_and_the_previous_used(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = LocalStorage(tmp_path)
    _save(storage, 1, value=1.0)
    _save(storage, 2, value=2.0)
    shard = next(n for n in storage.list("step-000002/") if n.endswith(".distcp"))
    if damage == "flip":
        data = bytearray(storage.get(shard))
        data[len(data) // 2] ^= 1
        storage.put(shard, bytes(data))
    elif damage == "missing":
        storage.delete([shard])
    else:
        storage.put(
            "step-000002/manifest.json", storage.get("step-000002/manifest.json").replace(b'"step": 2', b'"step": 9')
        )
    state = load_objects("mem://x", COMM, storage=storage)
    assert state is not None and state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))
    named = shard if damage != "manifest" else "manifest.json"
    assert any(named in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(CorruptCheckpointError, match=named.split("/")[-1]):
        load_objects("mem://x", COMM, storage=storage, fallback=False)


def test_commit_is_refused_when_the_manifest_exists(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert storage.put_new("a/m", b"1") and not storage.put_new("a/m", b"2") and storage.get("a/m") == b"1"


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _save(storage, 5, value=1.0)
    _save(storage, 5, value=7.0)
    state = load_objects("mem://x", COMM, storage=storage)
    assert state is not None and torch.equal(state["model"]["w"], torch.full((3,), 7.0))


class _Flaky:
    """An fsspec file system whose writes fail ``fails`` times, then work (or always fail)."""

    def __init__(self, fails: int) -> None:
        self.fails, self.calls, self.data = fails, 0, {}

    def _strip_protocol(self, url: str) -> str:
        return url.split("://", 1)[1]

    def pipe_file(self, path: str, data: bytes, mode: str = "overwrite") -> None:
        self.calls += 1
        if self.calls <= self.fails:
            raise ConnectionError("connection reset by peer")
        self.data[path] = data


def test_transient_errors_are_retried_then_the_object_named() -> None:
    flaky = _Flaky(fails=2)
    FsspecStorage("s3://b/run", fs=flaky, retries=3, backoff=0.001).put("step-000001/state.pt", b"x")
    assert flaky.calls == 3 and flaky.data == {"b/run/step-000001/state.pt": b"x"}
    dead = _Flaky(fails=100)
    with pytest.raises(ObjectStoreError, match=r"s3://b/run/step-000001/state.pt after 4 tries.*reset"):
        FsspecStorage("s3://b/run", fs=dead, retries=3, backoff=0.001).put("step-000001/state.pt", b"x")
    assert dead.calls == 4


class _SilentServer:
    """A TCP server that accepts every connection and never answers: an S3 endpoint that hung."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)  # held open, never read from or answered

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_a_server_that_stops_answering_is_named_after_one_request_per_try(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    server = _SilentServer()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    try:
        storage = FsspecStorage(
            "s3://b/run",
            retries=1,
            backoff=0.001,
            upload_deadline=1,
            endpoint_url=server.endpoint,
            config_kwargs={"read_timeout": 1},
        )
        cut_short = r"upload s3://b/run/step-000001/state.pt after 2 tries.*did not answer"
        with pytest.raises(ObjectStoreError, match=cut_short):
            storage.put("step-000001/state.pt", b"x")
        # one connection per try: neither botocore nor s3fs retried behind FsspecStorage's back
        assert len(server.accepted) == 2
        with pytest.raises(ObjectStoreError, match=r"upload s3://b/run/LOCK after 2 tries"):
            storage.put_new("LOCK", b"x")
        with pytest.raises(ObjectStoreError, match=r"download s3://b/run/step-000001/manifest.json after 2 tries"):
            storage.get("step-000001/manifest.json")
    finally:
        server.close()


def test_object_lock_names_the_holder_and_is_taken_over_when_dead(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    lock = lock_objects("mem://x", COMM, storage=storage)
    assert lock.name == ".lockstep.lock/00000001"
    with pytest.raises(FolderInUseError, match=r"in use by another job \(host .*pid"):
        lock_objects("mem://x", COMM, storage=storage)
    lock.release()
    assert json.loads(storage.get(lock.name))["released"] is True
    lock = lock_objects("mem://x", COMM, storage=storage)  # the next generation; the older one is gone
    assert storage.list(".lockstep.lock/") == {".lockstep.lock/00000002": len(storage.get(lock.name))}
    lock.release()
    body = {"host": "elsewhere", "pid": 1, "since": "then", "renewed": 0, "token": "t"}
    storage.put(".lockstep.lock/00000003", json.dumps(body).encode())  # a holder that stopped renewing
    lock = lock_objects("mem://x", COMM, storage=storage, ttl=30)
    assert lock.held and lock.name == ".lockstep.lock/00000004"
    lock.release()


def test_two_jobs_taking_over_one_dead_holder_end_with_one_holder(tmp_path: Path) -> None:
    """Both read the dead holder; the first takes over (and deletes that generation); the second, acting
    on what it read, must not remove the first one's lock nor hold one too."""

    class Stale(LocalStorage):
        frozen: dict[str, int] | None = None

        def list(self, prefix: str = "") -> dict[str, int]:
            if self.frozen is not None and prefix.startswith(".lockstep.lock"):
                seen, self.frozen = self.frozen, None
                return seen
            return super().list(prefix)

    dead = {"host": "elsewhere", "pid": 1, "since": "then", "renewed": 0, "token": "t"}
    LocalStorage(tmp_path).put(".lockstep.lock/00000001", json.dumps(dead).encode())
    second = Stale(tmp_path)
    second.frozen = second.list(".lockstep.lock/")  # it read the dead holder...
    first = lock_objects("mem://x", COMM, storage=LocalStorage(tmp_path), ttl=30)  # ...then the first took over
    with pytest.raises(FolderInUseError, match="in use by another job"):
        lock_objects("mem://x", COMM, storage=second, ttl=30)
    assert first.name == ".lockstep.lock/00000002" and list(second.list(".lockstep.lock/")) == [first.name]
    assert json.loads(second.get(first.name))["token"] == first.body["token"]  # the first job's lock, intact
    first.release()


def test_upload_failure_leaves_no_commit(tmp_path: Path) -> None:
    class Failing(LocalStorage):
        def put(self, name: str, data: bytes) -> None:
            if name.endswith(".distcp"):
                raise ObjectStoreError(f"cannot upload {self.where(name)} after 6 tries: boom")
            super().put(name, data)

    storage = Failing(tmp_path)
    with pytest.raises(CheckpointError, match="distcp after 6 tries"):
        _save(storage, 1)
    assert committed_steps(storage) == [] and not storage.list("step-000001/")


class _LostAnswer:
    """A file system whose first exclusive create succeeds on the server but whose answer is lost."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.creates = 0

    def pipe_file(self, path: str, data: bytes, mode: str = "overwrite") -> None:
        self.creates += 1
        if path in self.data:
            raise FileExistsError(path)
        self.data[path] = data
        if self.creates == 1:
            raise ConnectionError("the answer was lost")

    def cat_file(self, path: str) -> bytes:
        if path not in self.data:
            raise FileNotFoundError(path)
        return self.data[path]


def test_a_conditional_put_whose_answer_was_lost_is_not_taken_for_another_writers() -> None:
    fs = _LostAnswer()
    storage = FsspecStorage("s3://b/run", fs=fs, retries=2, backoff=0.001)
    assert storage.put_new("step-000001/manifest.json", b"mine")  # created by the try whose answer was lost
    fs2 = _LostAnswer()
    fs2.data["b/run/step-000001/manifest.json"] = b"theirs"
    fs2.creates = 1
    assert not FsspecStorage("s3://b/run", fs=fs2, retries=2, backoff=0.001).put_new(
        "step-000001/manifest.json", b"mine"
    )
