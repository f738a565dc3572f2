"""verify reads the update ratio from the first step, so a summed loss is diagnosed whatever --steps."""

from __future__ import annotations

import pytest
import torch

from lockstep.cli.main import main as cli
from lockstep.verify.compare import compare_runs
from lockstep.verify.config import VerifyConfig
from lockstep.verify.diagnose import ModelFacts, diagnose
from lockstep.verify.run import RunResult


def _result(final: list[float], first: list[float]) -> RunResult:
    return RunResult([1.0], {"w": torch.tensor(final)}, [{}], [], {"w": torch.tensor(first)})


def test_the_ratio_comes_from_the_first_step() -> None:
    """After several steps the final weights no longer differ by a constant factor; the first step does."""
    config = VerifyConfig(model="support.models:mlp", shape=(16,), steps=5)
    model = torch.nn.Module()
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(2)))
    init = {"w": torch.tensor([1.0, 1.0])}
    # first updates (0.2, 0.4) and (0.1, 0.2); the final weights have parted ways
    reference, parallel = _result([3.0, 1.5], [1.2, 1.4]), _result([2.0, 2.5], [1.1, 1.2])
    comparison = compare_runs(reference, parallel, init, model, config)
    assert comparison.tensors[0].ratio == pytest.approx(0.5)
    diagnosis = diagnose(comparison, ModelFacts({"": "Net"}), config)
    assert "in the first step every layer moved 0.5x as far" in diagnosis.causes[0]
    assert "the loss is a sum over the batch instead of a mean" in diagnosis.causes[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_summed_loss_is_diagnosed_at_the_default_steps(capsys: pytest.CaptureFixture) -> None:
    code = cli(
        [
            "verify",
            "support.models:mlp",
            "--shape",
            "16",
            "--classes",
            "4",
            "--batch",
            "16",
            "--loss",
            "support.models:summed_cross_entropy",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "update x0.5" in out, out + err
    assert (
        "likely cause: in the first step every layer moved 0.5x as far as in the single process (~1/2): "
        "the loss is a sum over the batch instead of a mean" in out
    )
