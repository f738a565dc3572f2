"""Sharded optimizer state for ddp (``shard_optimizer=True``, ZeRO-1): the same training as plain
ddp, each rank holding only its parameters' state, checkpoints that resume under plain ddp, one
process, or another world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.errors import ConfigError
from lockstep.strategies.zero import apply_zero
from support.dist import run_distributed

GLOBAL_BATCH = 12  # split evenly at world 1, 2 and 3: the same global mean loss everywhere


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 2, generator=gen)


def _body(directory: str, steps: int, save_at: int | None, shard: bool) -> dict[str, Any]:
    session = lockstep.Session(strategy="ddp", shard_optimizer=shard, quiet=True, timeout=60)
    model, opt = session.setup(_model(), lambda p: torch.optim.Adam(p, lr=0.01))
    session.load(directory, model=model, optimizer=opt)
    n = GLOBAL_BATCH // session.world_size
    while session.global_step < steps:
        x, y = _batch(session.global_step)
        part = slice(session.rank * n, (session.rank + 1) * n)
        session.backward(F.mse_loss(model(x[part]), y[part]))
        session.step(opt)
        if session.global_step == save_at:
            session.save(directory, model=model, optimizer=opt)
    local = opt.optim.state if hasattr(opt, "optim") else opt.state  # the rank's own optimizer state
    out = {
        "weights": {k: v.detach().clone() for k, v in session.strategy.unwrap(model).state_dict().items()},
        "local_states": len(local),
        "params": sum(1 for _ in model.parameters()),
        "sharded": type(opt).__name__ == "ZeroRedundancyOptimizer",
    }
    session.close()
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=rtol, atol=rtol * 1e-2) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sharded_optimizer_trains_like_plain_ddp_with_a_part_of_the_state(tmp_path: Path) -> None:
    plain = run_distributed(_body, 2, str(tmp_path / "plain"), 8, None, False, timeout=200)
    sharded = run_distributed(_body, 2, str(tmp_path / "zero"), 8, None, True, timeout=200)
    assert all(r["sharded"] for r in sharded) and not any(r["sharded"] for r in plain)
    # the same Adam arithmetic on the same averaged gradients, only on another rank
    assert _close(plain[0]["weights"], sharded[0]["weights"], rtol=1e-6)
    assert _close(sharded[0]["weights"], sharded[1]["weights"], rtol=0.0)
    states = [r["local_states"] for r in sharded]
    assert all(0 < s < r["params"] for s, r in zip(states, sharded)) and sum(states) == sharded[0]["params"]
    assert [r["local_states"] for r in plain] == [plain[0]["params"]] * 2


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_sharded_checkpoint_resumes_anywhere(tmp_path: Path) -> None:
    whole = run_distributed(_body, 2, str(tmp_path / "whole"), 8, None, True, timeout=200)[0]["weights"]
    folder = str(tmp_path / "ck")
    run_distributed(_body, 2, folder, 4, 4, True, timeout=200)  # saved by a sharded run at step 4
    again = run_distributed(_body, 2, folder, 8, None, True, timeout=200)[0]["weights"]
    assert _close(again, whole, rtol=0.0)  # same world: exact
    three = run_distributed(_body, 3, folder, 8, None, True, timeout=200)[0]["weights"]
    plain_one = _body(folder, 8, None, False)["weights"]  # plain ddp in this process
    assert _close(three, whole, rtol=1e-5) and _close(plain_one, whole, rtol=1e-5)


def test_shard_optimizer_is_ddps_option() -> None:
    from lockstep.session.config import SessionConfig

    assert SessionConfig("ddp", shard_optimizer=True).resolved.strategy_kwargs(1) == {"shard_optimizer": True}
    assert SessionConfig("auto", shard_optimizer=True).resolved.strategy_kwargs(2) == {"shard_optimizer": True}
    one = SessionConfig("auto", shard_optimizer=True).resolved.strategy_kwargs(1)
    assert one == {}  # one process: nothing to shard
    with pytest.raises(ConfigError, match="strategy 'fsdp' has no such option"):
        lockstep.Session(strategy="fsdp", shard_optimizer=True)
    with pytest.raises(ConfigError, match="must be True or False"):
        SessionConfig("ddp", shard_optimizer=1)  # type: ignore[arg-type]


def test_a_stepped_optimizer_is_refused() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(ConfigError, match="shard_optimizer=True needs a fresh SGD"):
        apply_zero(opt)
