"""The layout of a checkpoint folder: ``step-N`` names, listing, leftovers and pruning.

Only real folders count: a ``step-N`` symbolic link is never listed, followed or pruned.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lockstep.checkpoint.files import discard

__all__ = [
    "step_name",
    "temp_name",
    "step_of",
    "list_checkpoints",
    "latest_checkpoint",
    "remove_stale",
    "Retention",
    "prune",
]

logger = logging.getLogger("lockstep.checkpoint.core")

_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = (".tmp-step-", ".trash-step-")


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``step-000123`` (wider past a million)."""
    return f"step-{step:06d}"


def quarantine_name(name: str) -> str:
    """Where an unusable checkpoint ``step-N`` is moved aside (never listed, pruned or deleted): ``unusable-step-N-T``,
    ``T`` the time in seconds."""
    return f"unusable-{name}-{int(time.time())}"


def fallback_line(where: str, exc: BaseException, older: bool) -> str:
    """The warning of a load that skips the unusable checkpoint ``where``."""
    then = "falling back to the previous one" if older else "and no older checkpoint is left"
    return f"checkpoint {where} is unusable, {then}. {exc}"


def temp_name(step: int) -> str:
    """The name a checkpoint of ``step`` is written under before its commit (unique per process)."""
    return f".tmp-{step_name(step)}-{os.getpid()}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder name stands for, or ``None`` if it is not a ``step-N`` name."""
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The committed checkpoints in ``directory``, oldest (lowest step) first.

    Unfinished temporary folders are never listed, nor ``step-N`` symbolic links (they could lead
    into another run and shadow this run's checkpoints), which are ignored with a warning.

    Args:
        directory: the folder ``save_checkpoint`` writes into; a missing one has none.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            step = step_of(entry.name)
            if step is None:
                continue
            if entry.is_symlink():
                logger.warning(
                    "ignoring %s: a symbolic link, not a checkpoint written into %s; lockstep "
                    "follows no link out of its checkpoint folder. Remove it, or copy the "
                    "checkpoint in if it is meant to be resumed from.",
                    entry.path,
                    root,
                )
            elif entry.is_dir(follow_symlinks=False):
                found.append((step, root / entry.name))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest committed checkpoint in ``directory`` (not verified), or ``None``.

    Args:
        directory: the folder ``save_checkpoint`` writes into.
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


def remove_stale(root: Path) -> None:
    """Delete temporary folders left by saves that were killed before their commit."""
    for entry in root.iterdir():
        if entry.name.startswith(_LEFTOVER):
            logger.info("removing unfinished checkpoint %s left by an interrupted save", entry)
            discard(entry)


@dataclass(frozen=True)
class Retention:
    """Which checkpoints a save prunes once it is committed.

    The ``keep`` newest usable checkpoints up to the new one stay; one with a higher step (left by
    a run that went further) is never pruned, unless a load found it unusable. A checkpoint a load
    skipped as unusable is not counted: after a fallback from a corrupt newest checkpoint, the good
    one the run resumed from is not pruned in its place.

    Args:
        keep: how many checkpoints to keep, the new one included; ``None`` keeps all (nothing is pruned).
        unusable: the steps of checkpoints a load skipped as unusable (``load_checkpoint``'s
            ``"unusable"``); with ``keep`` set they are pruned, whatever their step.
    """

    keep: int | None = None
    unusable: frozenset[int] = frozenset()

    def doomed(self, committed: Iterable[int], step: int) -> list[int]:
        """The steps to delete, oldest first, once ``step`` is committed beside ``committed``.

        Args:
            committed: the steps of the committed checkpoints, ``step`` among them.
            step: the step just committed; never doomed.
        """
        if self.keep is None:
            return []
        others = sorted(set(committed) - {step})
        older = [s for s in others if s < step and s not in self.unusable]
        past_keep = older[: max(0, len(older) - (self.keep - 1))]
        return sorted(set(past_keep) | {s for s in others if s in self.unusable})


def prune(root: Path, retention: Retention, protect: Path) -> None:
    """Delete the checkpoints ``retention`` dooms once ``protect`` (just written) is committed."""
    step = step_of(protect.name)
    if retention.keep is None or step is None:
        return
    found = list_checkpoints(root)
    doomed = set(retention.doomed((step_of(p.name) or 0 for p in found), step))
    for old in found:
        if old == protect or step_of(old.name) not in doomed:
            continue
        if step_of(old.name) in retention.unusable:  # kept aside, never deleted: what is left in it may be recovered
            aside = old.with_name(quarantine_name(old.name))
            try:
                os.replace(old, aside)
                logger.warning("moved %s aside to %s: it failed verification at the last load", old, aside.name)
            except OSError as exc:
                logger.warning("could not move the unusable checkpoint %s aside: %s", old, exc)
            continue
        # renamed before deletion: a crash mid-delete never leaves a half-deleted folder that looks committed
        trash = old.with_name(f".trash-{old.name}-{os.getpid()}")
        try:
            os.replace(old, trash)
        except OSError as exc:
            logger.warning("could not remove old checkpoint %s: %s", old, exc)
            continue
        discard(trash)
