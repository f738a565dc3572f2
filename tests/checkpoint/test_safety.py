"""checkpoint trust: what a checkpoint folder can make a load do (FAULTS rows 19, 29, 30, 31).

Files swapped while they are loaded, names and links that lead outside the folder, folders
named after another step, torch's refusal message, and one live job per folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep.checkpoint.files as cio
from lockstep.checkpoint import FolderInUseError, lock_folder
from lockstep.checkpoint.core import (
    CheckpointError,
    UnsafeCheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from lockstep.checkpoint.manifest import write_manifest
from lockstep.comm.group import Comm, init_comm
from lockstep.env import World
from support.dist import run_distributed

COMM = Comm(World())
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class _System:
    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _rewrite_manifest(checkpoint: Path, skip: tuple[str, ...] = ()) -> None:
    """What someone who may write into the folder can do: a manifest matching every file."""
    (checkpoint / "manifest.json").unlink()
    files = {
        p.relative_to(checkpoint).as_posix(): cio.hash_file(p)
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name not in skip
    }
    write_manifest(checkpoint, files, step=int(checkpoint.name.split("-")[1]), world_size=1)


class _Swapper(threading.Thread):
    """Replaces a file with other bytes and back, as fast as it can, until stopped."""

    def __init__(self, target: Path, other: bytes, in_place: bool) -> None:
        super().__init__(daemon=True)
        self.target, self.good, self.other, self.in_place = target, target.read_bytes(), other, in_place
        self.stop = threading.Event()

    def run(self) -> None:
        spare = self.target.with_name(self.target.name + ".swap")
        while not self.stop.is_set():
            for data in (self.other, self.good):
                if self.in_place:  # rewrite the same file (what a re-opened handle sees)
                    with open(self.target, "r+b") as f:
                        f.write(data)
                else:  # swap in another file by rename (atomic)
                    spare.write_bytes(data)
                    os.replace(spare, self.target)


def _race(swapper: _Swapper, load: Callable[[], bool], seconds: float = 2.0) -> list[str]:
    """Load again and again while ``swapper`` runs; every load is right or refused. The refusals."""
    refused = []
    swapper.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                ok = load()
            except CheckpointError as exc:
                refused.append(str(exc))
                continue
            assert ok, "a load returned values the manifest never hashed"
    finally:
        swapper.stop.set()
        swapper.join()
    return refused


# -- FAULTS row 29: a file swapped while it is loaded ------------------------------------------------


def test_metadata_swapped_during_loads_never_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    root = tmp_path / "ckpt"
    a = torch.arange(64.0)
    path = save_checkpoint(root, {"step": 1}, COMM, step=1, sharded={"m": {"a": a, "note": "hi"}})

    def load() -> bool:
        template: dict[str, dict[str, Any]] = {"m": {"a": torch.zeros(64), "note": ""}}
        load_checkpoint(root, COMM, sharded=template, fallback=False)
        assert not marker.exists()
        return torch.equal(template["m"]["a"], a) and template["m"]["note"] == "hi"

    swapper = _Swapper(path / "sharded" / ".metadata", pickle.dumps(_Evil(marker)), in_place=False)
    refused = _race(swapper, load)
    assert not marker.exists()
    assert refused and all(re.search(r"corrupt: .*(checksum mismatch|holds \d+ bytes)", r) for r in refused), refused[
        :3
    ]
    assert load()


def test_state_file_rewritten_during_loads_loads_exactly_what_was_hashed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    weights = torch.arange(1 << 18, dtype=torch.float32)
    path = save_checkpoint(root, {"w": weights}, COMM, step=1)
    other = save_checkpoint(tmp_path / "other", {"w": weights + 1}, COMM, step=1) / "state.pt"
    assert other.stat().st_size == (path / "state.pt").stat().st_size

    def load() -> bool:
        state = load_checkpoint(root, COMM, fallback=False)
        return state is not None and torch.equal(state["w"], weights)

    refused = _race(_Swapper(path / "state.pt", other.read_bytes(), in_place=True), load)
    assert refused and all(re.search(r"corrupt: .*(checksum mismatch|holds \d+ bytes)", r) for r in refused), refused[
        :3
    ]
    assert load()


# -- FAULTS row 30: names and links that lead outside the folder ------------------------------------


def _outside_shard(tmp_path: Path) -> Path:
    """A shard file outside the checkpoint with the same layout and other values."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"m": {"a": torch.full((8,), 7.0)}}, checkpoint_id=tmp_path / "elsewhere", no_dist=True)
    return tmp_path / "elsewhere" / "__0_0.distcp"


def _point_shards_at(path: Path, relative_path: str) -> None:
    metadata_file = path / "sharded" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # the test trusts its own file
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=relative_path) for index, info in metadata.storage_data.items()
    }
    metadata_file.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("how", ["absolute", "parent", "unlisted", "linked shard", "linked state"])
def test_paths_leading_outside_are_refused(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, {"step": 1}, COMM, step=1, sharded={"m": {"a": torch.zeros(8)}})
    path = save_checkpoint(root, {"step": 2}, COMM, step=2, sharded={"m": {"a": torch.arange(8.0)}})
    outside = _outside_shard(tmp_path)
    skip: tuple[str, ...] = ()
    if how == "absolute":
        _point_shards_at(path, str(outside))
    elif how == "parent":
        _point_shards_at(path, os.path.relpath(outside, path / "sharded"))
    elif how == "unlisted":
        shutil.copy(outside, path / "sharded" / "extra.distcp")
        _point_shards_at(path, "extra.distcp")
        skip = ("extra.distcp",)
    elif how == "linked shard":
        (path / "sharded" / "__0_0.distcp").unlink()
        (path / "sharded" / "__0_0.distcp").symlink_to(outside)
    else:
        other = save_checkpoint(tmp_path / "other", {"step": 2, "planted": True}, COMM, step=2)
        (path / "state.pt").unlink()
        (path / "state.pt").symlink_to(other / "state.pt")
    _rewrite_manifest(path, skip)
    template = {"m": {"a": torch.full((8,), -1.0)}}
    with pytest.raises(UnsafeCheckpointError, match="refusing to read"):
        load_checkpoint(root, COMM, sharded=template)  # not skipped by fallback either
    assert torch.equal(template["m"]["a"], torch.full((8,), -1.0))


@pytest.mark.parametrize("name", ["../elsewhere/state.pt", "/etc/hostname", "sharded/../state.pt"])
def test_manifest_names_outside_the_folder_are_refused(tmp_path: Path, name: str) -> None:
    path = save_checkpoint(tmp_path, {"step": 1}, COMM, step=1)
    files = read_manifest(path)["files"]
    write_manifest(path, {**files, name: files["state.pt"]}, step=1, world_size=1)
    with pytest.raises(UnsafeCheckpointError, match="absolute name or one that climbs out"):
        load_checkpoint(tmp_path, COMM)


def test_linked_step_folder_never_shadows_or_prunes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, other = tmp_path / "ckpt", tmp_path / "other-run"
    foreign = save_checkpoint(other, {"step": 999, "w": torch.full((2,), 9.0)}, COMM, step=999)
    for step in (1, 2, 3):
        save_checkpoint(root, {"step": step}, COMM, step=step, keep=3)
    (root / "step-000999").symlink_to(foreign, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="lockstep.checkpoint.core"):
        state = load_checkpoint(root, COMM)
    assert state is not None and state["step"] == 3 and state["path"] == str(root / "step-000003")
    assert "step-000999" in caplog.text and "symbolic link" in caplog.text
    save_checkpoint(root, {"step": 4}, COMM, step=4, keep=2)
    assert [p.name for p in list_checkpoints(root)] == ["step-000003", "step-000004"]
    assert (root / "step-000999").is_symlink() and read_manifest(foreign)["step"] == 999
    (root / "step-000998").symlink_to(tmp_path / "gone", target_is_directory=True)  # dangling
    for step in (998, 999):  # saving that step replaces the link only
        save_checkpoint(root, {"step": step}, COMM, step=step)
        assert not (root / f"step-000{step}").is_symlink()
    assert load_checkpoint(other, COMM)["step"] == 999  # type: ignore[index]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_folder_named_after_another_step_is_refused(tmp_path: Path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, {"step": step}, COMM, step=step)
    shutil.copytree(tmp_path / "step-000002", tmp_path / "step-000999")
    with pytest.raises(CheckpointError, match="records step 2.*rename it to step-000002"):
        load_checkpoint(tmp_path, COMM, fallback=False)
    state = load_checkpoint(tmp_path, COMM)
    assert state is not None and state["path"] == str(tmp_path / "step-000002")


def test_prune_never_removes_a_newer_checkpoint(tmp_path: Path) -> None:
    for step in (5, 6):
        save_checkpoint(tmp_path, {"step": step}, COMM, step=step)
    save_checkpoint(tmp_path, {"step": 2}, COMM, step=2, keep=1)  # resumed from an earlier step
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000005", "step-000006"]
    save_checkpoint(tmp_path, {"step": 3}, COMM, step=3, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000005", "step-000006"]
    save_checkpoint(tmp_path, {"step": 5}, COMM, step=5, keep=1)  # caught up: its own older ones go
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000005", "step-000006"]


# -- FAULTS row 19: torch's refusal, shown without its advice ---------------------------------------


def test_refusal_names_the_global_and_never_suggests_disabling_the_check(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe.pt"
    torch.save({"x": _System(marker)}, probe)
    torch.load(probe, weights_only=False)  # the payload really runs...
    assert marker.exists()
    marker.unlink()
    path = save_checkpoint(tmp_path / "ckpt", {"step": 1}, COMM, step=1)
    torch.save({"x": _System(marker)}, path / "state.pt")
    _rewrite_manifest(path)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(tmp_path / "ckpt", COMM)
    message = str(info.value)
    assert f"unsupported GLOBAL {os.system.__module__}.system" in message
    for advice in ("weights_only=False", "set to `False`", "Re-running", "will likely succeed", "\n"):
        assert advice not in message
    assert not marker.exists()  # ...but never through lockstep


# -- FAULTS row 31: one live job per checkpoint folder ----------------------------------------------


def test_second_lock_in_the_same_process_is_refused_then_released(tmp_path: Path) -> None:
    lock = lock_folder(tmp_path, COMM)
    assert lock.held and lock.path is not None and lock.path.exists()
    with pytest.raises(FolderInUseError) as info:
        lock_folder(tmp_path, COMM)
    message = str(info.value)
    assert "\n" not in message and f"pid {os.getpid()}" in message and socket.gethostname() in message
    save_checkpoint(tmp_path, {"step": 1}, COMM, step=1, keep=1)  # the lock file is no checkpoint
    save_checkpoint(tmp_path, {"step": 2}, COMM, step=2, keep=1)
    assert lock.path.exists() and [p.name for p in list_checkpoints(tmp_path)] == ["step-000002"]
    lock.release()
    lock.release()
    assert [p.name for p in tmp_path.iterdir()] == ["step-000002"]
    with lock_folder(tmp_path, COMM) as again:
        assert again.held
    assert not again.held


_HOLDER = textwrap.dedent("""
    import sys, time
    from lockstep.checkpoint import lock_folder
    from lockstep.comm.group import Comm
    from lockstep.env import World
    lock = lock_folder(sys.argv[1], Comm(World()))
    print("locked", flush=True)
    time.sleep(60)
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_live_holder_refuses_and_dead_holder_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderInUseError, match=f"host {socket.gethostname()}, pid {holder.pid}"):
            lock_folder(tmp_path, COMM)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with caplog.at_level(logging.INFO, logger="lockstep.checkpoint.core"):
        lock = lock_folder(tmp_path, COMM)
    assert lock.held and f"pid {holder.pid}" in caplog.text
    lock.release()


def _lock_on_two(root: str) -> dict[str, Any]:
    comm = init_comm(timeout=60)
    error, held = None, None
    try:
        lock = lock_folder(root, comm)
        held = lock.held
        comm.barrier()
        lock.release()
    except FolderInUseError as exc:
        error = str(exc)
    comm.shutdown()
    return {"error": error, "held": held}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_rank_learns_the_folder_is_in_use(tmp_path: Path) -> None:
    with lock_folder(tmp_path, COMM):
        results = run_distributed(_lock_on_two, 2, str(tmp_path), timeout=100)
    for rank, result in enumerate(results):
        assert result["error"] is not None and f"pid {os.getpid()}" in result["error"]
        assert ("reported by rank 0" in result["error"]) == (rank == 1)
    results = run_distributed(_lock_on_two, 2, str(tmp_path), timeout=100)
    assert [r["held"] for r in results] == [True, False] and [r["error"] for r in results] == [None, None]
