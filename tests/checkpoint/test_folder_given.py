"""A checkpoint folder that cannot be one is refused on every rank, in one line naming it, before the first step:
a file, one ``step-N`` checkpoint given for its folder (which a save would nest a checkpoint inside), a bucket
that does not exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.checkpoint.files import CheckpointFolderError
from support.dist import run_distributed

pytestmark = pytest.mark.timeout(120)


def _load(directory: str) -> str:
    session = lockstep.Session(quiet=True)
    model, optimizer = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        session.load(directory, model=model, optimizer=optimizer)
    except CheckpointFolderError as exc:
        return str(exc)
    finally:
        session.close()
    return "loaded"


def _save_once(directory: str) -> None:
    session = lockstep.Session(quiet=True)
    model, optimizer = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    session.save(directory, model=model, optimizer=optimizer)
    session.close()


def test_a_file_given_as_the_folder_is_refused(tmp_path: Path) -> None:
    given = tmp_path / "ckpt"
    given.write_text("notes\n")
    said = _load(str(given))
    assert said.startswith(f"checkpoint folder {given} is a file") and "\n" not in said
    assert given.read_text() == "notes\n"  # untouched


def test_one_checkpoint_given_for_its_folder_is_refused_and_nothing_is_written_inside_it(tmp_path: Path) -> None:
    _save_once(str(tmp_path / "runs"))
    (step,) = (tmp_path / "runs").iterdir()
    before = sorted(p.name for p in step.iterdir())
    said = _load(str(step))
    assert said.startswith(f"{step} is one checkpoint (step 0) of the folder {tmp_path / 'runs'}: give ")
    assert sorted(p.name for p in step.iterdir()) == before  # no lock file, no nested step-N


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_missing_bucket_is_named_on_every_rank(s3: Any) -> None:
    url = "s3://no-such-bucket-lockstep/run"
    said = run_distributed(_load, 2, url)
    assert said[0] == said[1].replace(" (reported by rank 0)", "")  # the same line on both ranks
    assert said[0].startswith(f"checkpoint folder {url} cannot be used: ") and "create the bucket" in said[0]
