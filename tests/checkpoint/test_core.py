"""checkpoint: round trip, layout, pruning, and the faults of FAULTS rows 16-21.

The sharded part and the multi-process cases (world size change, FSDP2) are in
``test_checkpoint_dist.py``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lockstep.checkpoint.files as cio
from lockstep.checkpoint.core import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedStateError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from lockstep.checkpoint.layout import Retention
from lockstep.checkpoint.manifest import write_manifest
from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.errors import ConfigError

COMM = Comm(World())


def _state(step: int, n: int = 64) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Linear(n, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, n)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "epoch": step // 3,
        "extras": {"name": "run", "scores": [0.5, 0.75], "shape": torch.Size([2]), "t": torch.arange(3)},
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_round_trip_and_layout(tmp_path: Path) -> None:
    state = _state(5)
    path = save_checkpoint(tmp_path, state, COMM, step=5)
    assert path == tmp_path / "step-000005"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    loaded = load_checkpoint(tmp_path, COMM)
    assert loaded is not None and loaded.pop("path") == str(path) and loaded.pop("unusable") == []
    assert isinstance(loaded["rng"], list) and len(loaded["rng"]) == 1  # one entry per saving rank
    _assert_same({**state, "rng": [state["rng"]]}, loaded)
    manifest = read_manifest(path)
    assert manifest["step"] == 5 and manifest["world_size"] == 1 and manifest["torch_version"] == torch.__version__
    assert manifest["files"]["state.pt"]["size"] == (path / "state.pt").stat().st_size
    save_checkpoint(tmp_path, {"step": 6}, COMM, step=6)
    assert "rng" not in (load_checkpoint(tmp_path, COMM) or {})


def test_listing_ignores_unfinished_and_orders_by_step(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "missing") == [] and latest_checkpoint(tmp_path) is None
    assert load_checkpoint(tmp_path / "missing", COMM) is None and load_checkpoint(tmp_path, COMM) is None
    for step in (10, 9, 1234567):
        save_checkpoint(tmp_path, {"step": step}, COMM, step=step)
    (tmp_path / ".tmp-step-2000000-1").mkdir()
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-3000000").write_text("a file, not a checkpoint")
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-000009", "step-000010", "step-1234567"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1234567"
    assert load_checkpoint(tmp_path, COMM)["step"] == 1234567  # type: ignore[index]


def test_keep_prunes_oldest_but_never_the_new_one(tmp_path: Path) -> None:
    for step in range(1, 5):
        save_checkpoint(tmp_path, {"step": step}, COMM, step=step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    # resumed from an older step (say step 4 was bad): the new save survives its own pruning, and
    # checkpoints newer than it are never pruned (they may be another attempt's, or the good ones)
    save_checkpoint(tmp_path, {"step": 2}, COMM, step=2, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003", "step-000004"]
    assert _leftovers(tmp_path) == []


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"v": torch.zeros(3)}, COMM, step=7)
    save_checkpoint(tmp_path, {"v": torch.ones(3)}, COMM, step=7)
    loaded = load_checkpoint(tmp_path, COMM, fallback=False)
    assert loaded is not None and torch.equal(loaded["v"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["step-000007"]


@pytest.mark.parametrize("kwargs", [{"step": -1}, {"step": 1.5}, {"step": 1, "keep": 0}, {"step": True}])
def test_bad_arguments_are_config_errors(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="step|keep"):
        save_checkpoint(tmp_path, {}, COMM, **kwargs)


class _Opaque:
    pass


@pytest.mark.parametrize(
    "value, fragment", [(np.float64(0.9), "numpy.float64"), (_Opaque(), "_Opaque"), (lambda: 1, "function")]
)
def test_state_that_could_never_load_is_refused_before_writing(tmp_path: Path, value: Any, fragment: str) -> None:
    with pytest.raises(UnsupportedStateError, match=fragment) as info:
        save_checkpoint(tmp_path, {"extras": {"best": [1, value]}}, COMM, step=1)
    assert "state['extras']['best'][1]" in str(info.value)
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []


# -- FAULTS row 16: disk full ---------------------------------------------------------------------


class _FillingDisk:
    """A real file that reports ENOSPC once ``limit`` bytes have gone to it."""

    def __init__(self, path: Path, limit: int) -> None:
        self.f = open(path, "wb")
        self.limit = limit
        self.written = 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.written + size > self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += size
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _FillingDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()


@pytest.mark.parametrize("victim, limit", [("state.pt", 4000), ("manifest.json", 100)])
def test_disk_full_keeps_previous_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: str, limit: int
) -> None:
    save_checkpoint(tmp_path, _state(1), COMM, step=1)
    real_open = cio._open_for_write
    monkeypatch.setattr(cio, "_open_for_write", lambda p: _FillingDisk(p, limit) if p.name == victim else real_open(p))
    with pytest.raises(CheckpointError, match="no space left on device") as info:
        save_checkpoint(tmp_path, _state(2, n=512), COMM, step=2)
    assert str(tmp_path) in str(info.value) and "intact" in str(info.value)
    assert "unexpected pos" not in str(info.value)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]  # no temp files left
    loaded = load_checkpoint(tmp_path, COMM, fallback=False)
    assert loaded is not None and loaded["step"] == 1
    _assert_same(_state(1)["model"], loaded["model"])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_from_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/full returns a real ENOSPC from write(2), through Python's buffered file."""
    monkeypatch.setattr(cio, "_open_for_write", lambda p: open("/dev/full", "wb"))
    with pytest.raises(CheckpointError, match="no space left on device"):
        save_checkpoint(tmp_path, _state(1, n=4096), COMM, step=1)
    assert list(tmp_path.iterdir()) == []


# -- FAULTS row 17: killed in the middle of a save ------------------------------------------------

_KILLER = textwrap.dedent("""
    import os, sys, torch
    import lockstep.checkpoint.files as cio
    from lockstep.checkpoint.core import save_checkpoint
    from lockstep.comm.group import Comm
    from lockstep.env import World
    root, where = sys.argv[1], sys.argv[2]
    comm = Comm(World())
    save_checkpoint(root, {"w": torch.full((8,), 1.0), "step": 1}, comm, step=1)
    real_open = cio._open_for_write

    class Dying:
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, data):
            view = memoryview(data).cast("B")
            for i in range(0, len(view), 1 << 16):
                self.n += self.f.write(view[i:i + (1 << 16)])
                if self.n > 1 << 20:
                    self.f.flush()
                    os.kill(os.getpid(), 9)   # SIGKILL with 1 MiB of the file on disk
            return len(view)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *a):
            self.f.close()

    def opener(path):
        if path.name == "manifest.json" and where == "manifest":
            os.kill(os.getpid(), 9)           # data complete and fsync'd, not yet committed
        return Dying(real_open(path)) if where == "data" else real_open(path)

    cio._open_for_write = opener
    save_checkpoint(root, {"w": torch.full((4 << 20,), 2.0), "step": 2}, comm, step=2)
    print("save finished")
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["data", "manifest"])
def test_killed_mid_save_resumes_from_previous(tmp_path: Path, where: str) -> None:
    script = tmp_path / "kill.py"
    script.write_text(_KILLER)
    root = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), str(root), where], capture_output=True, text=True, timeout=50)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    leftovers = _leftovers(root)
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-step-000002-")
    written = (root / leftovers[0] / "state.pt").stat().st_size
    if where == "data":  # cut off after 1 MiB of 16 MiB
        assert 1 << 20 < written < 16 << 20
    else:  # whole file, no manifest yet
        assert written > 16 << 20 and not (root / leftovers[0] / "manifest.json").exists()
    assert [p.name for p in list_checkpoints(root)] == ["step-000001"]
    loaded = load_checkpoint(root, COMM, fallback=False)
    assert loaded is not None and loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(8))
    save_checkpoint(root, {"step": 3}, COMM, step=3)  # the next save cleans up
    assert _leftovers(root) == [] and [p.name for p in list_checkpoints(root)] == ["step-000001", "step-000003"]


# -- FAULTS row 18: truncated or bit-flipped ------------------------------------------------------


def _two_checkpoints(root: Path) -> torch.Tensor:
    save_checkpoint(root, {"w": torch.zeros(4096), "step": 1}, COMM, step=1)
    weights = torch.arange(4096, dtype=torch.float32)
    save_checkpoint(root, {"w": weights, "step": 2}, COMM, step=2)
    return weights


def test_bit_flip_in_tensor_data_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weights = _two_checkpoints(tmp_path)
    bad = tmp_path / "step-000002" / "state.pt"
    data = bytearray(bad.read_bytes())
    start = bytes(data).index(weights.numpy().tobytes())
    data[start + weights.numel() * 2] ^= 0x10  # the middle of the tensor's bytes
    bad.write_bytes(bytes(data))
    silently_wrong = torch.load(bad, weights_only=True)["w"]  # what plain torch.load does
    assert not torch.equal(silently_wrong, weights)
    with pytest.raises(CorruptCheckpointError, match="corrupt: checksum mismatch") as info:
        load_checkpoint(tmp_path, COMM, fallback=False)
    assert str(bad) in str(info.value)
    with caplog.at_level(logging.WARNING, logger="lockstep.checkpoint.core"):
        loaded = load_checkpoint(tmp_path, COMM)
    assert loaded is not None and loaded["step"] == 1 and torch.equal(loaded["w"], torch.zeros(4096))
    assert "step-000002" in caplog.text and "checksum mismatch" in caplog.text


@pytest.mark.parametrize("size", [0, 1, "half"])
def test_truncated_file_is_refused(tmp_path: Path, size: int | str) -> None:
    _two_checkpoints(tmp_path)
    bad = tmp_path / "step-000002" / "state.pt"
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size // 2 if size == "half" else size)
    with pytest.raises(CorruptCheckpointError, match=r"corrupt: state.pt holds \d+ bytes, its manifest says"):
        load_checkpoint(tmp_path, COMM, fallback=False)
    loaded = load_checkpoint(tmp_path, COMM, fallback=True)
    assert loaded is not None and loaded["step"] == 1


@pytest.mark.parametrize("damage", ["delete", "edit"])
def test_missing_or_edited_manifest_is_corrupt(tmp_path: Path, damage: str) -> None:
    _two_checkpoints(tmp_path)
    manifest = tmp_path / "step-000002" / "manifest.json"
    if damage == "delete":
        manifest.unlink()
    else:
        manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 3'))
    with pytest.raises(CorruptCheckpointError, match="corrupt: .*manifest.json"):
        load_checkpoint(tmp_path, COMM, fallback=False)
    assert load_checkpoint(tmp_path, COMM)["step"] == 1  # type: ignore[index]


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    for path in list_checkpoints(tmp_path):
        (path / "state.pt").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="no usable checkpoint") as info:
        load_checkpoint(tmp_path, COMM)
    assert "step-000001" in str(info.value) and "step-000002" in str(info.value)


def _flip_a_byte(checkpoint: Path) -> None:
    bad = checkpoint / "state.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))


def test_keep_after_a_fallback_prunes_the_corrupt_checkpoint_not_the_good_one(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"step": step, "w": torch.full((8,), float(step))}, COMM, step=step)
    _flip_a_byte(tmp_path / "step-000003")
    loaded = load_checkpoint(tmp_path, COMM)
    assert loaded is not None and loaded["step"] == 2 and loaded["unusable"] == [3]
    corrupt = (tmp_path / "step-000003" / "state.pt").read_bytes()
    # the run goes on from step 2 and next saves at step 4: keep=2 keeps 2 and 4, the corrupt 3 is moved aside
    save_checkpoint(tmp_path, {"step": 4, "w": torch.full((8,), 4.0)}, COMM, step=4, keep=2, unusable=[3])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000004"]
    assert _leftovers(tmp_path) == []
    (aside,) = tmp_path.glob("unusable-step-000003-*")  # never deleted: what is left in it may be recovered
    assert (aside / "state.pt").read_bytes() == corrupt
    _flip_a_byte(tmp_path / "step-000004")  # one more corruption: step 2 is still there to resume from
    again = load_checkpoint(tmp_path, COMM)
    assert again is not None and again["step"] == 2 and torch.equal(again["w"], torch.full((8,), 2.0))
    assert again["unusable"] == [4]


def test_a_fallback_with_nothing_older_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tmp_path, {"step": 1, "w": torch.zeros(8)}, COMM, step=1)
    save_checkpoint(tmp_path, {"step": 2, "w": torch.ones(8)}, COMM, step=2)
    _flip_a_byte(tmp_path / "step-000002")
    with caplog.at_level("WARNING"):
        assert load_checkpoint(tmp_path, COMM)["step"] == 1  # type: ignore[index]
    assert "step-000002 is unusable, falling back to the previous one" in caplog.text
    caplog.clear()
    _flip_a_byte(tmp_path / "step-000001")
    with caplog.at_level("WARNING"), pytest.raises(CorruptCheckpointError, match="no usable checkpoint"):
        load_checkpoint(tmp_path, COMM)
    assert "step-000001 is unusable, and no older checkpoint is left" in caplog.text


@pytest.mark.parametrize(
    "committed, step, keep, unusable, doomed",
    [
        ([1, 2, 3, 4], 4, 2, set(), [1, 2]),
        ([1, 2, 3, 4], 4, 2, {3}, [1, 3]),  # the corrupt 3 is not counted: 2 stays
        ([2, 3, 5], 3, 2, {5}, [5]),  # a newer checkpoint goes only once a load found it unusable
        ([2, 3, 5], 3, 1, set(), [2]),
        ([1, 2, 3], 3, None, {2}, []),  # keep=None: nothing pruned, not even a corrupt one
        ([1, 3], 3, 1, {3}, [1]),  # the step just written replaced the corrupt one of its name
    ],
)
def test_retention_dooms_past_keep_and_the_unusable(
    committed: list[int], step: int, keep: int | None, unusable: set[int], doomed: list[int]
) -> None:
    assert Retention(keep, frozenset(unusable)).doomed(committed, step) == doomed


# -- FAULTS row 19: malicious pickle --------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _plant(checkpoint: Path, payload: Any) -> None:
    """Replace state.pt with ``payload`` and write a manifest whose checksums match it."""
    torch.save(payload, checkpoint / "state.pt")
    write_manifest(checkpoint, {"state.pt": cio.hash_file(checkpoint / "state.pt")}, step=2, world_size=1)


def test_malicious_pickle_is_refused_and_never_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe.pt"
    torch.save({"x": _Evil(marker)}, probe)
    torch.load(probe, weights_only=False)  # the payload really works...
    assert marker.exists()
    marker.unlink()
    root = tmp_path / "ckpt"
    _two_checkpoints(root)
    _plant(root / "step-000002", {"x": _Evil(marker)})
    calls: list[dict[str, Any]] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    for fallback in (True, False):
        with pytest.raises(UnsafeCheckpointError, match="weights_only=True") as info:
            load_checkpoint(root, COMM, fallback=fallback)
        assert "unsafe" in str(info.value) and "io.open" in str(info.value)
    assert not marker.exists()  # ...but never through lockstep
    assert calls and all(k.get("weights_only") is True for k in calls)


# -- FAULTS row 21: map_location -------------------------------------------------------------------


def test_always_weights_only_and_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, {"w": torch.ones(3), "nested": {"b": torch.zeros(2)}}, COMM, step=1)
    calls: list[dict[str, Any]] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    assert load_checkpoint(tmp_path, COMM)["w"].device == torch.device("cpu")  # type: ignore[index]
    on_meta = load_checkpoint(tmp_path, COMM, map_location="meta")
    assert on_meta is not None and on_meta["w"].is_meta and on_meta["nested"]["b"].is_meta
    load_checkpoint(tmp_path, COMM, map_location=torch.device("cpu"))
    assert [c["map_location"] for c in calls] == ["cpu", "meta", torch.device("cpu")]
    assert all(c["weights_only"] is True for c in calls)


@pytest.mark.gpu
def test_cuda_checkpoint_loads_on_cpu_by_default(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"w": torch.ones(3, device="cuda:0")}, COMM, step=1)
    loaded = load_checkpoint(tmp_path, COMM)
    assert loaded is not None and loaded["w"].device.type == "cpu"
    local = load_checkpoint(tmp_path, COMM, map_location=f"cuda:{torch.cuda.device_count() - 1}")
    assert local is not None and local["w"].device.index == torch.cuda.device_count() - 1


def test_a_newer_checkpoint_format_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session writes its state's format and refuses one newer than it reads."""
    import lockstep
    import lockstep.session.state as session_state

    session = lockstep.Session(quiet=True)
    model, opt = session.setup(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    session.save(tmp_path, model=model, optimizer=opt)
    assert session.load(tmp_path, model=model, optimizer=opt).resumed  # the current format loads
    monkeypatch.setattr(session_state, "FORMAT", session_state.FORMAT + 1)
    session.save(tmp_path, model=model, optimizer=opt)  # as a newer version would write it
    monkeypatch.undo()
    with pytest.raises(cio.CheckpointError, match="written by a newer lockstep .*upgrade lockstep"):
        session.load(tmp_path, model=model, optimizer=opt)
    save_checkpoint(tmp_path / "raw", {"step": 1, "model": model.state_dict()}, COMM, step=1)  # no session state
    with pytest.raises(cio.CheckpointError, match="holds no session state .*not written by session.save"):
        session.load(tmp_path / "raw", model=model, optimizer=opt)
    session.close()


def _save_from_own_folder(base: str) -> str:
    """Each rank runs in a folder of its own, as two nodes without a shared disk see ``snapshots``."""
    import lockstep
    from lockstep.checkpoint import CheckpointError

    session = lockstep.Session(strategy="ddp", quiet=True, timeout=60)
    model, opt = session.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)
    session.save(os.path.join(base, "shared"), model=model, optimizer=opt)  # one folder every rank sees
    os.makedirs(os.path.join(base, f"node{session.rank}"))
    os.chdir(os.path.join(base, f"node{session.rank}"))
    try:
        session.save("snapshots", model=model, optimizer=opt)
    except CheckpointError as exc:
        message = str(exc)
    else:
        message = ""
    session.close()
    return message


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_folder_not_shared_by_every_rank_is_refused_at_the_save(tmp_path: Path) -> None:
    from support.dist import run_distributed

    messages = run_distributed(_save_from_own_folder, 2, str(tmp_path), timeout=90)
    assert [p.name for p in list_checkpoints(tmp_path / "shared")] == ["step-000001"]
    for message in messages:  # the same error on every rank
        assert message.startswith("the checkpoint folder snapshots is not shared by every rank: rank 1 (host "), message
        assert "a shared file system" in message and "s3://bucket/run" in message, message
    assert list((tmp_path / "node0" / "snapshots").iterdir()) == []  # rank 0's unfinished save is gone
    assert not (tmp_path / "node1" / "snapshots").exists()  # nothing half-written where rank 1 runs


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real file system with no space left: a 1 MiB tmpfs filled up (needs root to mount)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with open(mount / "filler", "wb") as out:
            with contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_stream_writers_unexpected_pos_on_a_full_disk_is_said_as_no_space(full_disk: Path) -> None:
    from lockstep.checkpoint.files import DiskFullError
    from lockstep.checkpoint.sharded import sharded_error

    torch_text = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    said = sharded_error(torch_text, full_disk / ".tmp-step-000008-1" / "sharded", "write")
    assert isinstance(said, DiskFullError) and "no space left on device" in str(said)
    elsewhere = sharded_error(torch_text, Path(os.getcwd()) / "ckpt" / "sharded", "write")  # space there: as it is
    assert not isinstance(elsewhere, DiskFullError) and "unexpected pos 704 vs 598" in str(elsewhere)
