"""checkpoint across ranks: the sharded (torch.distributed.checkpoint) part, world size changes
(FAULTS row 20), every rank failing together, and a real FSDP2 model on gloo."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep.checkpoint.files as cio
from lockstep.checkpoint.core import (
    CheckpointError,
    CorruptCheckpointError,
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


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


# -- the sharded part (torch.distributed.checkpoint), one process ---------------------------------


def _flip_a_bit(shard: Path) -> None:
    """Flip one bit in the middle of ``shard`` (inside a tensor's bytes), its size unchanged."""
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def test_sharded_round_trip_and_verification(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"step": 1}, COMM, step=1, sharded={"m": {"a": torch.zeros(8), "note": "one"}})
    a = torch.arange(8.0)
    path = save_checkpoint(tmp_path, {"step": 2}, COMM, step=2, sharded={"m": {"a": a, "note": "hi"}})
    files = read_manifest(path)["files"]
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "state.pt"} <= set(files)
    template = {"m": {"a": torch.empty(8), "note": ""}}
    loaded = load_checkpoint(tmp_path, COMM, sharded=template)
    assert loaded is not None and loaded["step"] == 2
    assert torch.equal(template["m"]["a"], a) and template["m"]["note"] == "hi"  # filled in place
    _flip_a_bit(path / "sharded" / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match="corrupt: checksum mismatch"):
        load_checkpoint(tmp_path, COMM, sharded=template, fallback=False)
    loaded = load_checkpoint(tmp_path, COMM, sharded=template)
    assert loaded is not None and loaded["step"] == 1 and torch.equal(template["m"]["a"], torch.zeros(8))
    assert template["m"]["note"] == "one"
    save_checkpoint(tmp_path, {"step": 3}, COMM, step=3)
    with pytest.raises(CheckpointError, match="no sharded state"):
        load_checkpoint(tmp_path, COMM, sharded=template)


def test_a_checkpoint_hashed_with_sha256_by_an_earlier_version_loads_and_is_still_checked(tmp_path: Path) -> None:
    import hashlib
    import json

    a = torch.arange(8.0)
    path = save_checkpoint(tmp_path, {"step": 1, "w": a}, COMM, step=1, sharded={"m": {"a": a}})
    manifest = read_manifest(path)
    assert all({"size", "xxh3_128"} <= set(record) for record in manifest["files"].values())
    assert "parts" in manifest["files"]["sharded/__0_0.distcp"]  # each item DCP wrote hashed alone
    files = {
        name: {"size": r["size"], "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
        for name, r in manifest["files"].items()
    }
    (path / "manifest.json").unlink()
    write_manifest(path, files, step=1, world_size=1)  # the records of a checkpoint written before xxh3_128
    assert "xxh3_128" not in json.dumps(read_manifest(path))
    template = {"m": {"a": torch.zeros(8)}}
    loaded = load_checkpoint(tmp_path, COMM, sharded=template, fallback=False)
    assert loaded is not None and torch.equal(loaded["w"], a) and torch.equal(template["m"]["a"], a)
    _flip_a_bit(path / "sharded" / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch .*sha256"):
        load_checkpoint(tmp_path, COMM, sharded=template, fallback=False)


def test_sharded_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem

    save_checkpoint(tmp_path, {"step": 1}, COMM, step=1, sharded={"m": {"a": torch.ones(4)}})

    def full(self: Any, path: Any, mode: str) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystem, "create_stream", full)
    with pytest.raises(CheckpointError, match="no space left on device") as info:
        save_checkpoint(tmp_path, {"step": 2}, COMM, step=2, sharded={"m": {"a": torch.zeros(4)}})
    assert "sharded" in str(info.value)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]
    monkeypatch.undo()
    template = {"m": {"a": torch.zeros(4)}}
    assert load_checkpoint(tmp_path, COMM, sharded=template, fallback=False)["step"] == 1  # type: ignore[index]
    assert torch.equal(template["m"]["a"], torch.ones(4))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["metadata", "value"])
def test_sharded_malicious_content_is_refused(tmp_path: Path, where: str) -> None:
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    root = tmp_path / "ckpt"
    path = save_checkpoint(root, {"step": 1}, COMM, step=1, sharded={"m": {"a": torch.ones(2), "v": 1}})
    sharded = path / "sharded"
    if where == "metadata":  # dcp reads .metadata with plain pickle.load
        (sharded / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    else:  # and non-tensor values with torch.load(weights_only=False)
        for f in sharded.iterdir():
            f.unlink()
        dcp.save({"m": {"a": torch.ones(2), "v": _Evil(marker)}}, checkpoint_id=sharded, no_dist=True)
    files = {
        p.relative_to(path).as_posix(): cio.hash_file(p)
        for p in path.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    write_manifest(path, files, step=1, world_size=1)
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        load_checkpoint(root, COMM, sharded={"m": {"a": torch.zeros(2), "v": 0}})
    assert not marker.exists()


# -- FAULTS row 20: save with 2 ranks, load with 1 and with 3 -------------------------------------


def _full_disk(path: Path) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def _save_with_two(root: str) -> dict[str, Any]:
    comm = init_comm(timeout=60)
    torch.manual_seed(100 + comm.rank)
    rng = torch.get_rng_state()  # differs per rank
    torch.manual_seed(0)
    model = nn.Linear(4, 2)  # the same on every rank
    for step in (1, 2):
        model.weight.data.fill_(float(step))
        save_checkpoint(root, {"model": model.state_dict(), "step": step, "rng": rng}, comm, step=step)
    if comm.rank == 0:  # only rank 0 writes; its disk fills up
        cio._open_for_write = _full_disk
    error = None
    try:
        save_checkpoint(root, {"model": model.state_dict(), "step": 3, "rng": rng}, comm, step=3)
    except CheckpointError as exc:
        error = str(exc)
    comm.shutdown()
    return {"rng": rng.tolist(), "error": error}  # plain lists: tensors cannot outlive the process


def _load_with_three(root: str) -> dict[str, Any]:
    comm = init_comm(timeout=60)
    state = load_checkpoint(root, comm)
    comm.shutdown()
    assert state is not None
    return {
        "step": state["step"],
        "rngs": len(state["rng"]),
        "weight": state["model"]["weight"].tolist(),
        "path": state["path"],
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_world_size_change_and_shared_failure(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = run_distributed(_save_with_two, 2, str(root), timeout=100)
    for rank, result in enumerate(saved):  # rank 0's ENOSPC reached rank 1 too: no hang
        assert result["error"] is not None and "no space left on device" in result["error"]
        assert ("reported by rank 0" in result["error"]) == (rank == 1)
    assert [p.name for p in root.iterdir()] == ["step-000001", "step-000002"]
    alone = load_checkpoint(root, COMM)  # world size 1
    assert alone is not None and alone["step"] == 2 and read_manifest(alone["path"])["world_size"] == 2
    assert torch.equal(alone["model"]["weight"], torch.full((2, 4), 2.0))
    assert len(alone["rng"]) == 2
    for rank in range(2):
        assert alone["rng"][rank].tolist() == saved[rank]["rng"]
    assert saved[0]["rng"] != saved[1]["rng"]
    bad = root / "step-000002" / "state.pt"  # corrupt the newest: all three ranks fall back together
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    three = run_distributed(_load_with_three, 3, str(root), timeout=100)
    for result in three:
        assert result["step"] == 1 and result["rngs"] == 2 and result["path"] == str(root / "step-000001")
        assert result["weight"] == [[1.0] * 4] * 2


# -- a real FSDP2 model (fully_shard on CPU, gloo) ------------------------------------------------


def _fsdp_round_trip(root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    comm = init_comm(timeout=60)
    mesh = init_device_mesh("cpu", (comm.world_size,))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    model, opt = build(0)
    msd, osd = get_state_dict(model, [opt])
    save_checkpoint(
        root, {"step": 5, "rng": torch.get_rng_state()}, comm, step=5, sharded={"model": msd, "optimizer": osd}
    )
    fresh, fresh_opt = build(1)
    differed = not torch.equal(fresh[0].weight.full_tensor(), model[0].weight.full_tensor())
    tm, to = get_state_dict(fresh, [fresh_opt])
    template = {"model": tm, "optimizer": to}
    state = load_checkpoint(root, comm, sharded=template)
    assert state is not None
    set_state_dict(fresh, [fresh_opt], model_state_dict=template["model"], optim_state_dict=template["optimizer"])
    loaded_equal = all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    x = torch.randn(3, 4)  # one more step each: same optimizer state => same result
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).sum().backward()
        o.step()
    stepped_equal = all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    files = sorted(read_manifest(state["path"])["files"])
    comm.shutdown()
    return {
        "differed": differed,
        "loaded": loaded_equal,
        "stepped": stepped_equal,
        "files": files,
        "step": state["step"],
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_sharded_save_and_load(tmp_path: Path) -> None:
    results = run_distributed(_fsdp_round_trip, 2, str(tmp_path), timeout=150)
    for result in results:
        assert result["differed"] and result["loaded"] and result["stepped"] and result["step"] == 5
        assert {"state.pt", "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(result["files"])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000005"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-000005"]
