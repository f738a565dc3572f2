"""Reading a checkpoint: the walk back from the newest (:func:`read_newest`), then the one the ranks agreed on
(:func:`read_chosen`): ``state.pt``, then its DCP part, each phase agreed.

Shared by a folder's load and an object store's: only where the verified bytes come from differs
(a :class:`Checkpoints`). Each byte is hashed once, by the rank that reads it, as it is read: the choice
checks only what is cheap (the manifest, each file's presence and size), and a file that fails its
check makes every rank walk back to the next older checkpoint alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from lockstep.checkpoint.files import (
    SHARDED_DIR,
    STATE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from lockstep.checkpoint.layout import fallback_line
from lockstep.checkpoint.portable import PREFIX, join_tensors, marked, templates
from lockstep.checkpoint.safety import Reader, load_state_file, read_dcp_metadata
from lockstep.checkpoint.write import agree
from lockstep.comm.group import Comm

__all__ = ["Checkpoints", "read_newest", "read_chosen"]

logger = logging.getLogger("lockstep.checkpoint.read")


class Checkpoints(Protocol):
    """The committed checkpoints of one folder or URL, as the walk back from the newest sees them."""

    url: str

    def candidates(self) -> list[Any]:
        """Every committed checkpoint (a picklable key: a folder's path, an object store's step), oldest first."""
        ...

    def plausible(self, key: Any) -> dict[str, Any]:
        """Rank 0: the checked manifest of ``key`` when every file it lists is there at its size (no hashing).

        Raises:
            CheckpointError: it is not (:class:`CorruptCheckpointError`, or a manifest of another step).
        """
        ...

    def where(self, key: Any) -> str:
        """The checkpoint's path or URL, for messages and ``"path"``."""
        ...

    def step(self, key: Any) -> int:
        """The step ``key`` was saved at."""
        ...

    def reader(self, key: Any, files: dict[str, Any]) -> tuple[Path, Reader | None]:
        """The folder :func:`read_chosen` reads and the reader of its verified bytes (``None``: the folder's files)."""
        ...


def read_newest(
    found: Checkpoints,
    comm: Comm,
    map_location: torch.device | str | None,
    sharded: dict[str, Any] | None,
    fallback: bool,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Every rank: read the newest checkpoint every rank can verify; ``None`` when there is none (``into``: as
    :func:`read_chosen` takes it).

    Rank 0 walks back from the newest and proposes the first plausible one; every rank reads it,
    checking each byte as it is read; a check that fails on any rank is raised on every rank, and
    (``fallback``) every rank walks back alike; any other error (a template that does not fit, a file
    that cannot be read) is raised, never taken for a reason to resume from an older step. The state
    has ``"path"`` and ``"unusable"`` (the steps skipped) added.

    Raises:
        CorruptCheckpointError: every checkpoint is unusable, or the newest one (``fallback=False``).
        UnsafeCheckpointError: an unsafe pickle or name; never skipped.
        CheckpointError: the checkpoint chosen cannot be read into what was given.
    """
    keys: list[Any] = []
    error: CheckpointError | None = None
    if comm.is_main:
        try:
            keys = found.candidates()
        except CheckpointError as exc:
            error = exc
    agree(comm, error)
    bad: list[tuple[int, str]] = []  # (step, why) of each checkpoint skipped
    while True:
        choice, error = None, None
        if comm.is_main:
            try:
                choice = _next_choice(found, keys, bad, fallback)
            except CheckpointError as exc:
                error = exc
        choice, bad = agree(comm, error, (choice, bad))[0]  # rank 0's view: the walk stays in step
        if choice is None:
            break
        key, manifest = choice
        path, read = found.reader(key, manifest["files"])
        try:
            state = read_chosen(path, manifest["files"], comm, map_location, sharded, read, found.where(key), into)
        except CorruptCheckpointError as exc:  # every rank raised the same: every rank walks back alike
            if not fallback:
                raise
            if comm.is_main:
                logger.warning("%s", fallback_line(found.where(key), exc, older=bool(keys)))
            bad.append((found.step(key), str(exc)))
            continue
        state["unusable"] = [skipped for skipped, _ in bad]
        return state
    if bad:
        raise CorruptCheckpointError(
            f"no usable checkpoint in {found.url}; every one failed verification:\n  "
            + "\n  ".join(why for _, why in bad)
        )
    return None


def _next_choice(
    found: Checkpoints, keys: list[Any], bad: list[tuple[int, str]], fallback: bool
) -> tuple[Any, dict[str, Any]] | None:
    """Rank 0: pop the newest plausible checkpoint off ``keys`` (newest last); the others go to ``bad``."""
    while keys:
        key = keys.pop()
        try:
            return key, found.plausible(key)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            if not fallback:
                raise
            logger.warning("%s", fallback_line(found.where(key), exc, older=bool(keys)))
            bad.append((found.step(key), str(exc)))
    return None


def read_chosen(
    path: Path,
    files: dict[str, Any],
    comm: Comm,
    map_location: torch.device | str | None,
    sharded: dict[str, Any] | None,
    read: Reader | None = None,
    name: str | None = None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Every rank: read the agreed checkpoint and its DCP part; one rank's failure raises on every rank.

    ``into``: live tensors by DCP name (the replicated model's and optimizer's), filled in place where they fit.
    """
    where = "cpu" if map_location is None else map_location
    state, metadata, error = None, None, None
    try:
        state, metadata = _read_state(path, files, where, sharded, read)
    except CheckpointError as exc:
        error = exc
    agree(comm, error)
    assert state is not None
    if metadata is not None:  # a DCP part: replicated tensors (ddp) and/or sharded state dicts (fsdp)
        from lockstep.checkpoint.sharded import load_sharded

        filled, error = {}, None
        try:
            filled = templates(metadata, marked(state), where, into)
        except CheckpointError as exc:
            error = exc
        agree(comm, error)
        agree(comm, load_sharded(path, files, metadata, {**filled, **(sharded or {})}, comm, read))
        state = join_tensors(state, filled)
    state["path"] = name if name is not None else str(path)
    return state


def _read_state(
    path: Path, files: dict[str, Any], map_location: Any, sharded: dict[str, Any] | None, read: Reader | None
) -> tuple[dict[str, Any], Any]:
    """This rank's ``state.pt`` and, when ``sharded`` is given, the verified DCP metadata."""
    state = load_state_file(path, files, map_location, read)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_FILE} holds a {type(state).__name__}, not a checkpoint dict")
    if sharded is None and not marked(state):
        return state, None  # state.pt alone (written before ddp's tensors went through DCP)
    if not any(name.startswith(SHARDED_DIR + "/") for name in files):
        raise CheckpointError(
            f"checkpoint {path} has no sharded state, but "
            + (
                "sharded= templates were given: it was saved without sharded= (another strategy?)"
                if sharded is not None
                else "its state.pt names tensors stored there"
            )
        )
    metadata = read_dcp_metadata(path, files, read)
    if sharded is not None and all(name.startswith(PREFIX) for name in metadata.state_dict_metadata):
        raise CheckpointError(
            f"checkpoint {path} holds full state dicts, not sharded ones, but sharded= "
            "templates were given: it was saved without sharded= (another strategy?)"
        )
    return state, metadata
