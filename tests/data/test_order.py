"""The epoch's order as a function (lockstep.data.order): a bijection of range(N) computed a block at a time,
a function of (seed, epoch) only, positions of earlier versions finished in their own permutation."""

from __future__ import annotations

import pytest
import torch

from lockstep.data.order import BLOCK, PERMUTATION, EpochOrder, saved_permutation
from lockstep.data.samplers import TrainSampler, epoch_order
from lockstep.data.seeding import derive_seed
from lockstep.data.steps import StepSampler, plan_batches
from lockstep.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 65, 1000, BLOCK - 1, BLOCK, 2 * BLOCK + 3, 100_003])
def test_the_order_is_a_permutation_of_range_n(n: int) -> None:
    order = EpochOrder(n, seed=7, epoch=2)
    values = order.take(0, n)
    assert sorted(values) == list(range(n))
    assert len(order) == n


def test_any_slice_is_the_slice_of_the_whole_across_blocks_and_only_two_blocks_are_held() -> None:
    n = 3 * BLOCK + 11
    whole = EpochOrder(n, seed=1, epoch=0).take(0, n)
    order = EpochOrder(n, seed=1, epoch=0)
    for lo, hi in [(0, 1), (BLOCK - 3, BLOCK + 4), (n - 5, n), (5, 2 * BLOCK + 7), (n - 1, n + 10), (10, 10)]:
        assert order.take(lo, hi) == whole[lo:hi], (lo, hi)
        assert len(order._blocks) <= 2  # what it holds does not grow with N
    assert [order[i] for i in (0, BLOCK, n - 1)] == [whole[0], whole[BLOCK], whole[n - 1]]
    with pytest.raises(IndexError):
        order[n]


def test_the_order_is_a_function_of_seed_and_epoch_only() -> None:
    n = 5000
    a, again = EpochOrder(n, 3, 4).take(0, n), EpochOrder(n, 3, 4).take(0, n)
    assert a == again
    others = [EpochOrder(n, 3, 5).take(0, n), EpochOrder(n, 4, 4).take(0, n), EpochOrder(n, 4, 3).take(0, n)]
    assert all(o != a for o in others) and others[1] != others[2]
    assert EpochOrder(n, 3, 4, shuffle=False).take(0, n) == list(range(n))
    # shuffled for real: position and index are uncorrelated (Spearman's rho of a fixed order; |rho| of a
    # uniformly random permutation of 5000 exceeds 0.05 with probability below 0.1 %)
    mean = (n - 1) / 2
    rho = sum((i - mean) * (v - mean) for i, v in enumerate(a)) / sum((i - mean) ** 2 for i in range(n))
    assert abs(rho) < 0.05, rho


def test_a_position_of_an_earlier_version_finishes_its_epoch_in_its_permutation_then_the_new_one() -> None:
    n, plan = 100, plan_batches(10, 1, 10)
    legacy = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed("lockstep", 0, 3))).tolist()
    assert epoch_order(n, 0, 3, permutation=1) == legacy  # permutation 1: torch.randperm, as before
    saved = {"seed": 0, "epoch": 3, "cursor": 40, "order": "lockstep", "shuffle": True, "dataset_len": n}
    assert saved_permutation(saved) == 1 and saved_permutation({"seed": 0, "epoch": 3, "cursor": 0}) == PERMUTATION
    sampler = StepSampler(n, plan, 0)
    sampler.load_state_dict(saved)
    sampler.set_epoch(3)
    assert [i for batch in sampler for i in batch] == legacy[40:]
    assert sampler.state_dict()["permutation"] == 1
    sampler.set_epoch(4)
    assert [i for batch in sampler for i in batch] == epoch_order(n, 0, 4) and sampler.permutation == PERMUTATION
    padded = TrainSampler(n, 2, 1)
    padded.load_state_dict({"epoch": 3, "seen": 40, "seed": 0, "shuffle": True, "order": "lockstep", "dataset_len": n})
    padded.set_epoch(3)
    assert list(padded) == legacy[40:][1::2]


def test_a_permutation_this_version_does_not_know_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="permutation 9 of the data order"):
        saved_permutation({"seed": 0, "epoch": 0, "cursor": 0, "permutation": 9})
