"""Assemble a session's complete state for a checkpoint, and put it back.

``Session.save`` / ``Session.load`` call these. The state holds the unwrapped model, the
optimizer, the precision plugin's scaler, the training sampler's position (in global samples,
so it can be resumed at another world size), every rank's RNG, the loop's counters and the
user's extras.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.session.resume import ResumeState, capture_rng, restore_rng

if TYPE_CHECKING:
    from lockstep.session.session import Session

__all__ = ["save_session", "load_session", "resumed_line"]


def save_session(session: Session, directory: Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None, keep: int | None,
                 extras: dict[str, Any]) -> Path:
    """Gather the full state of ``session`` and write it with :func:`lockstep.checkpoint.core.save_checkpoint`."""
    from lockstep.checkpoint.core import save_checkpoint

    strategy = session.strategy
    inner = _inner(model)
    samplers = session._loaders.state_dicts()
    state: dict[str, Any] = {
        "format": 1,
        "epoch": session.epoch,
        "step": session.global_step,
        "world_size": session.world_size,
        "sampler": samplers[-1] if samplers else None,  # older versions read the last loader's
        "samplers": samplers,
        "epoch_done": session._loaders.epoch_done,
        "precision": session.precision.state_dict(),
        "rng": capture_rng(),
        "extras": extras,
    }
    sharded = None
    if strategy.sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(inner, [optimizer] if optimizer is not None else [])
        sharded = {"model": model_sd, "optimizer": optim_sd}
    else:
        state["model"] = strategy.model_state_dict(inner)
        if optimizer is not None:
            state["optimizer"] = strategy.optimizer_state_dict(inner, optimizer)
    return save_checkpoint(directory, state, session.comm, step=session.global_step, keep=keep, sharded=sharded)


def load_session(session: Session, directory: Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> ResumeState:
    """Load the newest good checkpoint into ``session``, ``model`` and ``optimizer``."""
    from lockstep.checkpoint.core import load_checkpoint

    strategy = session.strategy
    inner = _inner(model)
    sharded: dict[str, Any] | None = None
    if strategy.sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(inner, [optimizer] if optimizer is not None else [])
        sharded = {"model": model_sd, "optimizer": optim_sd}
    state = load_checkpoint(directory, session.comm, map_location=session.device, sharded=sharded)
    if state is None:
        return ResumeState()
    if sharded is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(inner, [optimizer] if optimizer is not None else [],
                       model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    else:
        strategy.load_model_state_dict(inner, state["model"])
        if optimizer is not None and "optimizer" in state:
            strategy.load_optimizer_state_dict(inner, optimizer, state["optimizer"])
    session.precision.load_state_dict(state.get("precision") or {})
    rngs = state.get("rng")
    if isinstance(rngs, list) and len(rngs) == session.world_size:
        restore_rng(rngs[session.rank])
    session.global_step = int(state["step"])
    epoch = int(state["epoch"])
    states, legacy = state.get("samplers"), False
    if states is None:  # written before checkpoints kept every loader's position
        states, legacy = ([state["sampler"]] if state.get("sampler") else []), True
    done = state.get("epoch_done")
    mid = session._loaders.restore(list(states), epoch, None if done is None else bool(done), legacy)
    path = Path(state.get("path", directory))
    return ResumeState(epoch=epoch if mid else epoch + 1, step=session.global_step, path=path,
                       extras=dict(state.get("extras") or {}), mid_epoch=mid)


def resumed_line(state: ResumeState) -> str:
    """What rank 0 prints after a resume; names the attempt when the launcher restarted the job.

    Args:
        state: what ``Session.load`` restored.

    Example::

        resumed_line(state)   # "lockstep: resumed from ckpt/step-000006 at epoch 1, step 6 (attempt 2)"
    """
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    attempt = f" (attempt {int(count) + 1})" if count.isdigit() else ""
    return f"lockstep: resumed from {state.path} at epoch {state.epoch}, step {state.step}{attempt}"


def _inner(model: nn.Module) -> nn.Module:
    from lockstep.session.loop import PrecisionModule

    return model.module if isinstance(model, PrecisionModule) else model
