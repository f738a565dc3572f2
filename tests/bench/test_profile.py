"""One device's step taken apart: DDP's buckets as torch forms them, the phases and readiness measured."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from lockstep.bench.profile import _spread, ddp_buckets, profile_step
from lockstep.errors import ConfigError


def test_buckets_are_those_torch_assigns() -> None:
    # a model whose gradients span a 1 MiB first bucket and more than one 25 MiB bucket
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096), nn.Linear(4096, 2048), nn.Linear(2048, 2048))
    params = list(net.parameters())
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    torch_buckets, _ = dist._compute_bucket_assignment_by_size(params[::-1], limits, [False] * len(params))
    last = len(params) - 1
    assert ddp_buckets(params) == [[last - i for i in bucket] for bucket in torch_buckets]
    assert len(torch_buckets) >= 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_profile_covers_every_gradient_once_and_its_readiness_lies_inside_backward() -> None:
    prof = profile_step("convnet", batch_size=8, steps=3, warmup=1, threads=1)
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.optimizer_s > 0
    assert sum(b.nbytes for b in prof.buckets) == prof.grad_bytes == prof.param_bytes
    assert sum(b.tensors for b in prof.buckets) == len(list(_convnet().parameters()))
    assert all(0 <= b.ready_s <= prof.backward_s for b in prof.buckets)
    assert sum(prof.fsdp_units) == prof.param_bytes
    elements = sum(r * c for r, c in (m for b in prof.buckets for m in b.matrices)) + sum(
        b.vectors for b in prof.buckets
    )
    assert elements * 4 == prof.grad_bytes  # every gradient is a matrix or a vector of the buckets
    assert prof.loader_samples_per_s is None and prof.compute_s == pytest.approx(
        prof.forward_s + prof.backward_s + prof.optimizer_s
    )
    assert prof.compute_spread_s >= 0.0


def test_the_spread_is_the_standard_deviation_of_whole_steps() -> None:
    """Forward, backward and optimizer are summed per step first: a slow forward with a fast backward is
    a steady step; one step has no spread."""
    steady = {"forward": [0.010, 0.020], "backward": [0.020, 0.010], "optimizer": [0.001, 0.001]}
    assert _spread(steady) == 0.0
    uneven = {"forward": [0.010, 0.014], "backward": [0.020, 0.020], "optimizer": [0.001, 0.001]}
    assert _spread(uneven) == pytest.approx(0.002)
    assert _spread({"forward": [0.010], "backward": [0.020], "optimizer": [0.001]}) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_loader_is_timed_too() -> None:
    prof = profile_step("convnet", data="digits", batch_size=16, steps=2, warmup=0, threads=1)
    assert prof.loader_samples_per_s is not None and prof.loader_samples_per_s > 0


def test_nothing_to_time_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least one timed step"):
        profile_step("convnet", steps=0)


def _convnet() -> nn.Module:
    from lockstep.zoo.models import ModelSpec

    return ModelSpec("convnet").build(1, 10, 28)
