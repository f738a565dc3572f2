"""Replicated state written by every rank: ddp's tensors go through DCP, each rank writing a part;
the state loads back exactly as it was saved, at any world size; checkpoints of ``state.pt`` alone
(written before) still load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from lockstep.checkpoint.portable import join_tensors, marked, own_share, split_tensors
from lockstep.comm.group import Comm
from lockstep.env import World
from support.dist import run_distributed

COMM = Comm(World())


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_split_and_join_give_back_the_same_tree() -> None:
    model, opt = _trained()
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "pair": (torch.ones(1), [2, torch.zeros(2)])}
    skeleton, tensors = split_tensors(tree)
    assert len(tensors) == 6 + 6 * 3 + 2 and sorted(marked(skeleton)) == sorted(tensors)
    assert "full/optimizer/state/0/exp_avg" in tensors and "full/model/0.weight" in tensors
    assert _same(join_tensors(skeleton, tensors), tree)  # int keys, OrderedDict, tuples kept
    with pytest.raises(CheckpointError, match="full/model/0.weight"):
        join_tensors(skeleton, {})


def test_replicated_state_round_trips_and_state_pt_holds_no_tensor_of_it(tmp_path: Path) -> None:
    model, opt = _trained()
    full = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    path = save_checkpoint(tmp_path, {"step": 1}, COMM, step=1, replicated=full)
    files = verify_checkpoint(path)["files"]
    assert {"state.pt", "sharded/.metadata", "sharded/__0_0.distcp"} <= set(files)
    assert files["state.pt"]["size"] < 0.1 * files["sharded/__0_0.distcp"]["size"]
    loaded = load_checkpoint(tmp_path, COMM)
    assert loaded is not None and _same({k: loaded[k] for k in full}, full) and loaded["step"] == 1


def test_a_checkpoint_of_state_pt_alone_still_loads(tmp_path: Path) -> None:
    model, opt = _trained()
    session = lockstep.Session(quiet=True)
    wrapped, optimizer = session.setup(model, lambda p: torch.optim.Adam(p, lr=0.01))
    session.backward(wrapped(torch.randn(4, 64)).sum())
    assert session.step(optimizer)
    session.save(tmp_path / "new", model=wrapped, optimizer=optimizer)
    state = load_checkpoint(tmp_path / "new", COMM)
    assert state is not None
    del state["path"]
    state["rng"] = state["rng"][0]  # this rank's (the save gathers them)
    old = save_checkpoint(tmp_path / "old", state, COMM, step=state["step"])  # the layout of earlier versions
    assert sorted(verify_checkpoint(old)["files"]) == ["state.pt"]
    session.close()

    torch.manual_seed(1)
    fresh = lockstep.Session(quiet=True)
    other, other_opt = fresh.setup(_trained()[0].apply(_reset), lambda p: torch.optim.Adam(p, lr=0.01))
    resumed = fresh.load(tmp_path / "old", model=other, optimizer=other_opt)
    assert resumed.step == 1
    assert _same(fresh.strategy.model_state_dict(other), state["model"])
    assert _same(fresh.strategy.optimizer_state_dict(other, other_opt), state["optimizer"])
    fresh.close()


def _reset(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.weight)


def _ddp_save(directory: str) -> dict[str, Any]:
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=60)
    model, opt = session.setup(_trained()[0], lambda p: torch.optim.Adam(p, lr=0.01))
    part = torch.randn(8, 64, generator=torch.Generator().manual_seed(session.rank))
    session.backward(model(part).sum())
    session.step(opt)
    path = session.save(directory, model=model, optimizer=opt)
    out = {"path": str(path), "model": session.strategy.model_state_dict(model)}
    session.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_every_ddp_rank_writes_a_part_and_one_process_reads_it_all(tmp_path: Path) -> None:
    saved = run_distributed(_ddp_save, 2, str(tmp_path), timeout=100)[0]
    files = verify_checkpoint(saved["path"])["files"]
    parts = [files[f"sharded/__{rank}_0.distcp"]["size"] for rank in (0, 1)]
    assert min(parts) > 0.3 * sum(parts)  # the bytes are spread, neither writes all
    assert files["state.pt"]["size"] < min(parts)  # and rank 0's state.pt holds none of them
    loaded = load_checkpoint(tmp_path, COMM)  # one process: another world size
    assert loaded is not None and len(loaded["rng"]) == 2
    assert _same(loaded["model"], saved["model"])


def test_each_tensor_is_copied_by_one_rank_with_the_bytes_balanced() -> None:
    tensors = {"a": torch.ones(100), "b": torch.ones(60), "c": torch.ones(50), "d": torch.ones(10, dtype=torch.float64)}
    shares = [own_share(tensors, rank, 2) for rank in (0, 1)]
    assert sorted(shares[0]) + sorted(shares[1]) == ["a", "d", "b", "c"]  # largest first, to the lighter rank
    for share in shares:
        for name, copy in share.items():
            assert torch.equal(copy, tensors[name]) and copy.data_ptr() != tensors[name].data_ptr()
    tensors["a"].add_(1)  # training goes on: the copy does not change
    assert torch.equal(shares[0]["a"], torch.ones(100))
    alone = [own_share({"w": torch.ones(3)}, rank, 3) for rank in range(3)]
    assert [sorted(s) for s in alone] == [["w"], [], []]  # ranks without a share still take part


def _ddp_save_small(directory: str) -> dict[str, Any]:
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=60)
    model, opt = session.setup(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    session.backward(model(torch.ones(2, 4) * session.rank).sum())
    session.step(opt)
    path = session.save(directory, model=model, optimizer=opt)
    out = {"path": str(path), "model": session.strategy.model_state_dict(model)}
    session.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_with_no_share_still_saves_and_the_checkpoint_loads(tmp_path: Path) -> None:
    # two tensors (weight, bias) over three ranks: rank 2 writes no tensor, but takes part
    saved = run_distributed(_ddp_save_small, 3, str(tmp_path), timeout=100)[0]
    files = verify_checkpoint(saved["path"])["files"]
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(files)
    loaded = load_checkpoint(tmp_path, COMM)
    assert loaded is not None and len(loaded["rng"]) == 3
    assert _same(loaded["model"], saved["model"])
