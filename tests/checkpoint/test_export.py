"""``lockstep export``: a checkpoint's model as a plain ``state_dict`` file that ``torch.load`` and the bare
module's ``load_state_dict`` take, whatever strategy and world size wrote it, a named model (an EMA) too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lockstep
from lockstep.checkpoint import ExportError, export_model
from lockstep.cli.main import main
from support.dist import run_distributed

pytestmark = pytest.mark.timeout(120)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train_and_save(folder: str, strategy: str) -> dict[str, dict[str, torch.Tensor]]:
    session = lockstep.Session(strategy=strategy, quiet=True)
    torch.manual_seed(0)
    model, optimizer = session.setup(_net(), lambda p: torch.optim.Adam(p, lr=0.1))
    ema = _net()  # an average of the weights, plain: each rank holds it whole
    ema.load_state_dict(session.model_state_dict(model))
    for _ in range(2):
        session.backward(model(torch.randn(3, 4)).square().mean())
        session.step(optimizer)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), session.model_state_dict(model).values()):
                e.mul_(0.5).add_(p, alpha=0.5)
    session.save(folder, model=model, optimizer=optimizer, ema=ema)
    saved = {"model": session.model_state_dict(model), "ema": {k: v.clone() for k, v in ema.state_dict().items()}}
    session.close()
    return saved


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_export_is_the_bare_modules_state_dict_whatever_wrote_it(tmp_path: Path, strategy: str) -> None:
    folder = tmp_path / "ckpt"
    saved = run_distributed(_train_and_save, 2, str(folder), strategy)[0]
    for name in ("model", "ema"):
        out = tmp_path / f"{name}.pt"
        path, step = export_model(folder, out, name)
        assert (path.name, step) == ("step-000002", 2)
        exported = torch.load(out, weights_only=True)
        assert exported.keys() == saved[name].keys() == _net().state_dict().keys()  # no wrapper's prefix
        assert all(torch.equal(exported[k], saved[name][k]) for k in exported)  # bit for bit
        _net().load_state_dict(exported)  # strict: every key, every shape
    assert main(["export", str(folder / "step-000002"), str(tmp_path / "again.pt")]) == 0  # a step-N folder too
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert all(torch.equal(again[k], saved["model"][k]) for k in again)


def test_nothing_to_export_is_said_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=f"no checkpoint in {tmp_path}"):
        export_model(tmp_path, tmp_path / "out.pt")
    with pytest.raises(ExportError, match="reads a local checkpoint folder, not s3://bucket/run"):
        export_model("s3://bucket/run", tmp_path / "out.pt")
    session = lockstep.Session(quiet=True)
    model, optimizer = session.setup(_net(), lambda p: torch.optim.SGD(p, lr=0.1))
    session.save(tmp_path / "ckpt", model=model, optimizer=optimizer)
    session.close()
    with pytest.raises(ExportError, match=r"holds no model named 'teacher'; it holds 'model'"):
        export_model(tmp_path / "ckpt", tmp_path / "out.pt", "teacher")
    assert not (tmp_path / "out.pt").exists()
