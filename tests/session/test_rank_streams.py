"""Each rank's own random stream after ``Session.setup`` (FAULTS row 49), and a script's own seed kept.

Identical initial weights come from the broadcast at ``setup``; the draws a loop makes after it
(nanoGPT's ``torch.randint`` batches, dropout) must differ between ranks and repeat run to run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lockstep
from lockstep.session.rng import rank_seed
from support.dist import run_distributed


def _draws(script_seed: int | None) -> tuple[list[int], list[float]]:
    if script_seed is not None:
        torch.manual_seed(script_seed + int(__import__("os").environ["RANK"]))  # nanoGPT's 1337 + rank
    session = lockstep.Session(quiet=True, timeout=60)
    model = session.setup(nn.Linear(3, 2))
    draws = torch.randint(1000, (4,)).tolist()
    weights = session.strategy.unwrap(model).weight.flatten().tolist()
    session.close()
    return draws, weights


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_after_setup_each_rank_draws_its_own_stream_again_on_every_run() -> None:
    first = run_distributed(_draws, 2, None)
    second = run_distributed(_draws, 2, None)
    assert first[0][1] == first[1][1]  # the same initial weights everywhere (broadcast)
    assert first[0][0] != first[1][0]  # then each rank draws its own numbers
    assert first == second  # and the same ones on every run
    torch.manual_seed(rank_seed(0, 1))
    assert torch.randint(1000, (4,)).tolist() == first[1][0]  # rank 1's stream is rank_seed(seed, 1)
    torch.manual_seed(0)
    nn.Linear(3, 2)  # rank 0 continues the seed's own stream after the model's initialisation
    assert torch.randint(1000, (4,)).tolist() == first[0][0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_seed_the_script_set_before_the_session_is_kept() -> None:
    ranks = run_distributed(_draws, 2, 1337)
    for rank, (draws, _) in enumerate(ranks):
        torch.manual_seed(1337 + rank)
        nn.Linear(3, 2)
        assert torch.randint(1000, (4,)).tolist() == draws, f"rank {rank}"
