"""The layout of a checkpoint folder: ``step-N`` names, listing, leftovers and pruning.

Only real folders count: a ``step-N`` symbolic link is never listed, followed or pruned.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from lockstep.checkpoint.files import discard

__all__ = ["step_name", "temp_name", "step_of", "list_checkpoints", "latest_checkpoint", "remove_stale", "prune"]

logger = logging.getLogger("lockstep.checkpoint.core")

_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = (".tmp-step-", ".trash-step-")


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``step-000123`` (wider past a million)."""
    return f"step-{step:06d}"


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


def prune(root: Path, keep: int | None, protect: Path) -> None:
    """Delete all but the ``keep`` newest checkpoints up to ``protect`` (just written); none newer than it."""
    if keep is None:
        return
    limit = step_of(protect.name)
    found = [p for p in list_checkpoints(root) if limit is None or (step_of(p.name) or 0) <= limit]
    for old in found[: max(0, len(found) - keep)]:
        if old == protect:
            continue
        # renamed before deletion: a crash mid-delete never leaves a half-deleted folder that looks committed
        trash = old.with_name(f".trash-{old.name}-{os.getpid()}")
        try:
            os.replace(old, trash)
        except OSError as exc:
            logger.warning("could not remove old checkpoint %s: %s", old, exc)
            continue
        discard(trash)
