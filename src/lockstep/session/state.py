"""What a checkpoint holds besides the model and optimizer, and how a session is put back.

:class:`TrainState` is the loop's own state (counters, every training loader's position in global
samples, whether the epoch had finished, every rank's RNG); :func:`save_state` / :func:`load_state`
build the checkpoint from it and the model, optimizer, precision and extras; :class:`ResumeState`
is what ``Session.load`` returns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.session.loaders import TrainLoaders
from lockstep.session.rng import capture_rng, restore_rng, seed_everything

if TYPE_CHECKING:  # the session builds them; importing them here would only cost import time
    from lockstep.checkpoint.background import PendingSave, WriterGroup
    from lockstep.precision.base import Precision
    from lockstep.session.named import NamedState
    from lockstep.session.wrappers import ModelWrappers
    from lockstep.strategies.base import Strategy

__all__ = [
    "ResumeState",
    "TrainState",
    "save_state",
    "load_state",
    "resumed_line",
    "capture_rng",
    "restore_rng",
    "seed_everything",
]  # the last three live in lockstep.session.rng


class Where(Protocol):
    """Whatever knows this process's rank and the world size (the job's ``Comm``, or a ``World``)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


FORMAT = 1
"""The layout of a session checkpoint's state (``state["format"]``); a load refuses a newer one."""


@dataclass(frozen=True)
class ResumeState:
    """Where training continues after ``Session.load``.

    Args:
        epoch: the epoch to start (or continue) from; pass it to ``Session.epochs(n, start=...)``.
        step: optimizer steps taken so far.
        path: the checkpoint that was loaded (a URL as a ``str``), or ``None`` when training starts fresh.
        extras: the user's own values given to ``Session.save`` (``{}`` when fresh).
        mid_epoch: True when the checkpoint was taken mid-``epoch``; the training loader continues from its position.
        unusable: the steps of the newer checkpoints skipped as unusable (corrupt); the next
            ``Session.save`` into the same folder does not count them in its ``keep``, and prunes them.
        world_size: the world size the checkpoint was saved at (``None`` when fresh).
    """

    epoch: int = 0
    step: int = 0
    path: Path | str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    mid_epoch: bool = False
    unusable: tuple[int, ...] = ()
    world_size: int | None = None

    @property
    def resumed(self) -> bool:
        """True when a checkpoint was loaded."""
        return self.path is not None


class TrainState:
    """The training loop's own state: counters, loader positions, the epoch's end, every rank's RNG.

    Args:
        where: the job's collectives, which own this rank and the world size (a checkpoint's RNG states
            are picked by rank, and restored only at the same world size); one process when ``None``.
        say: prints the line of a resume at another world size (:meth:`replan_line`); ``None``: quiet.
        on_pass: called when a training loader's iterator is made (the session's membership joins there).
    """

    def __init__(
        self,
        where: Where | None = None,
        say: Callable[[str], None] | None = None,
        *,
        on_pass: Callable[[], None] | None = None,
    ) -> None:
        self.where = where if where is not None else World()
        self.say = say
        self.epoch = 0
        self.global_step = 0
        self.skipped_steps = 0
        self.epochs_counted = False  # True once session.epochs started one: a loop without epochs stays in epoch 0
        self._resumed_from: tuple[int, int | None] | None = None  # (world size, global batch) of a checkpoint
        self.loaders = TrainLoaders(on_add=self._say_replan, on_pass=on_pass)

    @property
    def rank(self) -> int:
        """This process's rank, as the job's collectives say."""
        return self.where.rank

    @property
    def world_size(self) -> int:
        """Ranks in the job, as the job's collectives say."""
        return self.where.world_size

    @property
    def epoch_done(self) -> bool:
        """True once a training loader ran out and every batch it handed out was trained."""
        return self.loaders.finished

    def count_step(self) -> None:
        """Count one optimizer step taken."""
        self.global_step += 1

    def count_skipped(self) -> None:
        """Count one step skipped on every rank for a non-finite loss."""
        self.skipped_steps += 1

    def start_epoch(self, epoch: int) -> None:
        """Enter ``epoch``: every training loader follows (one resumed mid-epoch keeps its position).

        Args:
            epoch: the epoch number.
        """
        self.epoch = epoch
        self.epochs_counted = True
        self.loaders.set_epoch(epoch)

    def position(self) -> dict[str, Any]:
        """The counters and every training loader's position, without the RNG (what a peer hands over)."""
        return {
            "epoch": self.epoch,
            "step": self.global_step,
            "skipped": self.skipped_steps,
            "samplers": self.loaders.state_dicts(),
            "epoch_done": self.loaders.finished,
        }

    def load_position(self, position: dict[str, Any]) -> None:
        """Go back to (or take a peer's) :meth:`position`.

        Args:
            position: what :meth:`position` returned, here or on a peer.
        """
        self.epoch, self.global_step, self.skipped_steps = position["epoch"], position["step"], position["skipped"]
        self.loaders.load_positions(position["samplers"], bool(position["epoch_done"]))

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (``"rng"`` is this rank's; the save gathers every rank's)."""
        samplers = self.loaders.state_dicts()
        return {
            "epoch": self.epoch,
            "step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world_size,
            "samplers": samplers,
            "epoch_done": self.loaders.finished,
            "epochs_counted": self.epochs_counted,
            "rng": capture_rng(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Put back a checkpoint's counters, loader positions and this rank's RNG (at the same world size only).

        Args:
            state: the loaded checkpoint, ``"rng"`` being the list of every rank's state.

        Returns:
            True when the checkpoint was taken in the middle of its epoch (:attr:`epoch` is where training continues).
        """
        rngs = state.get("rng")
        if isinstance(rngs, list) and len(rngs) == self.world_size:
            restore_rng(rngs[self.rank])
        self.global_step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        epoch, states = int(state["epoch"]), list(state["samplers"])
        saved = [s for s in states if s] or [{}]
        self._resumed_from = (int(state["world_size"]), saved[0].get("global_batch"))
        mid = self.loaders.restore(states, epoch, bool(state["epoch_done"]))
        # a loop that counts no epochs (no session.epochs, its own batches: nanoGPT's) stays in its epoch
        counted = bool(state.get("epochs_counted", True)) or any(states)
        self.epochs_counted = self.epochs_counted or counted
        self.epoch = epoch if mid or not counted else epoch + 1
        self._say_replan()
        return mid

    def _say_replan(self) -> None:
        """Said once a loader knows the new plan: after the load, or when the first loader is made."""
        line = self.replan_line()
        if line is not None and self.say is not None:
            self.say(line)

    def replan_line(self) -> str | None:
        """Once, after a resume at another world size: how the first loader's steps are planned now; else ``None``."""
        first = self.loaders.first
        steps = first.steps if first is not None else None
        if self._resumed_from is None or steps is None:
            return None
        (world, batch), self._resumed_from = self._resumed_from, None
        if world == self.world_size:
            return None
        plan = steps.plan
        kept = "kept" if batch in (None, plan.global_batch) else f"(was {batch})"
        return (
            f"lockstep: world size {world} -> {self.world_size}: global batch {plan.global_batch} {kept}, "
            f"{plan.describe()}"
        )


def save_state(
    directory: Path | str,
    train: TrainState,
    *,
    comm: Comm,
    strategy: Strategy,
    precision: Precision,
    model: ModelWrappers,
    optimizer: torch.optim.Optimizer | None,
    keep: int | None,
    named: NamedState,
    blocking: bool = True,
    writers: WriterGroup | None = None,
    unusable: frozenset[int] = frozenset(),
) -> Path | str | PendingSave:
    """Write ``train`` with the model, optimizer, precision state and the ``named`` values as one checkpoint.

    The models' and optimizers' tensors go through ``torch.distributed.checkpoint``, each rank its
    part (each named model under ``"models"``, with its optimizer); a stateful object's
    ``state_dict()`` is taken now. With ``blocking=False`` the state is copied and written in the
    background, and a :class:`~lockstep.checkpoint.background.PendingSave` is returned. ``unusable``: steps a load found
    corrupt there (not counted in ``keep``; pruned). Every rank calls it.
    """
    from lockstep.checkpoint.background import save_checkpoint_async
    from lockstep.checkpoint.core import save_checkpoint

    # live tensors: each rank copies only the share it writes (checkpoint.portable.own_share)
    full, sharded = _live_state(strategy, model, optimizer, named)
    extras = dict(named.extras)
    objects = {name: obj.state_dict() for name, obj in named.objects.items()}
    if not blocking:  # the user's tensors and objects may change while the state is written
        extras, objects = copy.deepcopy(extras), copy.deepcopy(objects)
    state: dict[str, Any] = {
        "format": FORMAT,
        **train.state_dict(),
        "precision": precision.state_dict(),
        "extras": extras,
        "objects": objects,
    }
    position = _json_or_none(state.get("samplers"))  # recorded in an object store's manifest
    if blocking:
        return save_checkpoint(
            directory,
            state,
            comm,
            step=train.global_step,
            keep=keep,
            unusable=unusable,
            sharded=sharded,
            replicated=full,
            position=position,
        )
    return save_checkpoint_async(
        directory,
        state,
        comm,
        step=train.global_step,
        keep=keep,
        unusable=unusable,
        sharded=sharded,
        replicated=full,
        writers=writers,
        position=position,
    )


def _live_state(
    strategy: Strategy, model: ModelWrappers, optimizer: torch.optim.Optimizer | None, named: NamedState
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The models' and optimizers' live state as a checkpoint holds it: ``(replicated, sharded)``, one ``None``."""
    full, sharded = strategy.checkpoint_state(model.wrapped, optimizer, copy=False)
    for name, entry in named.models.items():
        more_full, more_sharded = strategy.checkpoint_state(entry.layers.wrapped, entry.optimizer, copy=False)
        if more_full is not None and full is not None:
            full.setdefault("models", {})[name] = more_full
        if more_sharded is not None and sharded is not None:
            sharded.setdefault("models", {})[name] = more_sharded
    return full, sharded


def _json_or_none(value: Any) -> Any:
    """``value`` if JSON can hold it as it is (the loaders' positions), else ``None``."""
    import json

    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def load_state(
    directory: Path | str,
    train: TrainState,
    *,
    comm: Comm,
    device: torch.device,
    strategy: Strategy,
    precision: Precision,
    model: ModelWrappers,
    optimizer: torch.optim.Optimizer | None,
    named: NamedState,
    say: Callable[[str], None] | None = None,
) -> ResumeState:
    """Load the newest good checkpoint in ``directory`` into ``train``, the models, optimizers and named objects.

    Returns a fresh :class:`ResumeState` when there is none; raises ``CheckpointError`` for a
    checkpoint of a newer format than :data:`FORMAT`, or one without a named model. A named object
    the checkpoint lacks keeps its state, and ``say`` tells so. Every rank calls it.
    """
    from lockstep.checkpoint.core import load_checkpoint
    from lockstep.checkpoint.files import CheckpointError
    from lockstep.checkpoint.portable import split_tensors
    from lockstep.checkpoint.storage import location

    inner = model.wrapped
    sharded = strategy.sharded_state(inner, optimizer)
    if sharded is not None and named.models:
        sharded["models"] = {
            name: strategy.sharded_state(entry.layers.wrapped, entry.optimizer) for name, entry in named.models.items()
        }
    live = _live_state(strategy, model, optimizer, named)[0] if sharded is None else None
    into = split_tensors(live)[1] if live is not None else None  # loaded in place where the tensors fit
    state = load_checkpoint(directory, comm, map_location=device, sharded=sharded, into=into)
    if state is None:
        return ResumeState()
    written = state.get("format")
    if not isinstance(written, int):
        raise CheckpointError(
            f"{state.get('path', directory)} holds no session state (no checkpoint format): it was not "
            "written by session.save; resume from a checkpoint the session saved"
        )
    if written > FORMAT:  # every rank read the same state: every rank raises alike
        raise CheckpointError(
            f"{state.get('path', directory)} was written by a newer lockstep (checkpoint format "
            f"{written}; this version reads up to {FORMAT}): upgrade lockstep to resume from it"
        )
    strategy.load_checkpoint_state(inner, optimizer, state, sharded)
    saved_models = state.get("models") or {}
    for name, entry in named.models.items():
        if sharded is None and name not in saved_models:
            raise CheckpointError(
                f"{state.get('path', directory)} holds no model {name!r} (saved as {sorted(saved_models) or 'none'}): "
                f"load it with the names it was saved with, or start {name} fresh by leaving it out"
            )
        part = sharded["models"][name] if sharded is not None else None
        strategy.load_checkpoint_state(entry.layers.wrapped, entry.optimizer, saved_models.get(name, {}), part)
    saved_objects = state.get("objects") or {}
    for name, obj in named.objects.items():
        if name in saved_objects:
            obj.load_state_dict(saved_objects[name])
        elif say is not None:
            say(f"lockstep: {state.get('path', directory)} holds no {name!r}: it keeps its state as it is")
    precision.load_state_dict(state.get("precision") or {})
    mid = train.load_state_dict(state)
    return ResumeState(
        epoch=train.epoch,
        step=train.global_step,
        path=location(state.get("path", directory)),
        extras=dict(state.get("extras") or {}),
        mid_epoch=mid,
        unusable=tuple(state.get("unusable") or ()),
        world_size=int(state["world_size"]),
    )


def resumed_line(state: ResumeState, count: int | None) -> str:
    """What rank 0 prints after a resume; names the attempt when the launcher restarted the job
    (``count``: its restarts so far, ``Settings.restart_count``)."""
    attempt = f" (attempt {count + 1})" if count is not None else ""
    return f"lockstep: resumed from {state.path} at epoch {state.epoch}, step {state.step}{attempt}"
