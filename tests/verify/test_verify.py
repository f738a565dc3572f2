"""verify: batches and slices, comparisons, diagnosis rules, and real 2-process comparisons.

The model factories the multi-process tests pass are ``support.models:NAME`` (tests/support/models.py);
the workers import that module to build them.
"""

from __future__ import annotations

import re

import pytest
import torch

from lockstep.cli.main import main as cli
from lockstep.errors import ConfigError
from lockstep.verify.compare import Comparison, ForwardDiff, LossDiff, TensorDiff, relative_difference, update_ratio
from lockstep.verify.config import VerifyConfig
from lockstep.verify.diagnose import ModelFacts, diagnose, random_modules
from lockstep.verify.inputs import apply_dropout_mode, make_batches, shard
from lockstep.verify.record import ActivationRecorder, recorded_rows
from support.models import VERIFY_FLAGS, mlp

# -- fast, single-process -------------------------------------------------------------------


def test_batches_are_fixed_and_slices_contiguous() -> None:
    config = VerifyConfig(model="support.models:mlp", shape=(16,), classes=4, steps=3, batch=8)
    first, again = make_batches(config), make_batches(config)
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert first[0][0].shape == (8, 16) and first[0][1].shape == (8,)
    x = torch.arange(8)
    assert [m[0].tolist() for m in shard((x, x), rank=1, nproc=2, accumulate=2)] == [[4, 5], [6, 7]]
    assert [m[0].tolist() for m in shard((x, x), rank=0, nproc=2, accumulate=1)] == [[0, 1, 2, 3]]


def test_dataset_batches_cover_every_sample_before_repeating() -> None:
    config = VerifyConfig(model="support.models:mlp", data="support.models:dataset", steps=3, batch=16)
    batches = make_batches(config)
    labels = torch.cat([y for _, y in batches]).tolist()
    assert len(labels) == 48 and sorted(labels[:40]) == list(range(40))  # one full epoch first
    assert batches[0][0].shape == (16, 16)
    assert [y.tolist() for _, y in make_batches(config)] == [y.tolist() for _, y in batches]


@pytest.mark.parametrize(
    "changes, text",
    [
        ({"batch": 10, "nproc": 3}, "cannot be split evenly over 3 processes"),
        ({"nproc": 1}, "at least 2"),
        ({"strategy": "dp"}, "choose one of ddp, fsdp"),
        ({"dropout": "maybe"}, "choose one of disable, align"),
        ({"precision": "fp8"}, "unknown precision"),
        ({"shape": None}, "--shape"),
        ({"model": "nomodule"}, "unknown model"),
        pytest.param(
            {"sync_bn": True},
            r"sync_bn=True \(--sync-bn\) needs GPUs",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines"),
        ),
    ],
)
def test_bad_config_refused(changes: dict, text: str) -> None:
    values = {"model": "support.models:mlp", "shape": (16,), **changes}
    with pytest.raises(ConfigError, match=text):
        VerifyConfig(**values)


def test_tolerance_follows_precision() -> None:
    assert VerifyConfig(model="convnet").effective_tolerance == 1e-5
    assert VerifyConfig(model="convnet", precision="O0").resolved.precision == "fp32"
    assert VerifyConfig(model="convnet", precision="bf16-mixed").effective_tolerance == 1e-2
    assert VerifyConfig(model="convnet", precision="fp16-mixed", tolerance=0.1).effective_tolerance == 0.1


def test_relative_difference_and_update_ratio() -> None:
    assert relative_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == pytest.approx(0.2)
    assert relative_difference(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_difference(torch.tensor([3]), torch.tensor([4])) == float("inf")
    init = torch.zeros(4)
    ref = torch.tensor([1.0, -2.0, 0.5, 3.0])
    assert update_ratio(2 * ref, ref, init) == pytest.approx(2.0)
    assert update_ratio(ref.flip(0), ref, init) is None  # not a scaled copy


def test_recorder_keeps_the_same_samples_in_both_runs() -> None:
    config = VerifyConfig(model="support.models:mlp", shape=(16,), batch=24, nproc=3, accumulate=2)
    assert recorded_rows(config, reference=False) == ([0, 1, 2, 3], 4)
    assert recorded_rows(config, reference=True) == ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19], 24)
    model = mlp()
    x = torch.randn(24, 16)
    whole = ActivationRecorder(model, *recorded_rows(config, reference=True))
    model(x)
    whole.close()
    rank1 = ActivationRecorder(model, *recorded_rows(config, reference=False))
    model.eval()(x[8:12])  # rank 1's first micro-batch, dropout off in both
    rank1.close()
    assert whole.order == ["hidden", "act", "drop", "out", ""] and whole.outputs["out"].shape == (12, 4)
    assert torch.allclose(rank1.outputs["hidden"], whole.outputs["hidden"][4:8])
    small = ActivationRecorder(model, [0], 24, budget=40)  # room for hidden's 32 values, not act's
    model(x)
    assert list(small.outputs) == ["hidden"]


def test_dropout_disable_and_random_module_detection() -> None:
    model = mlp()
    assert random_modules(model, torch.randn(8, 16)) == ["drop"]  # not the layers after it
    assert apply_dropout_mode(model, "disable") == ["drop"]
    assert random_modules(model, torch.randn(8, 16)) == []


def _comparison(ratios: list[float | None], forward: list[ForwardDiff] | None = None) -> Comparison:
    tensors = [TensorDiff(f"l{i}.weight", "parameter", f"l{i}", 0.3, r) for i, r in enumerate(ratios)]
    return Comparison(1e-5, [LossDiff(0, 1.0, 1.0, 0.0)], tensors, forward or [])


def _facts() -> ModelFacts:
    return ModelFacts({"": "Net", "l0": "Linear", "l1": "BatchNorm1d", "l2": "Linear"}, batchnorm=["l1"])


@pytest.mark.parametrize(
    "ratios, text",
    [
        ([2.0, 2.02, 1.98], "gradients are summed over ranks instead of averaged"),
        ([0.5, 0.5, 0.51], "loss is a sum over the batch instead of a mean"),
        ([1.3, 1.3, 1.3], "scaled by a constant"),
        ([1.0, None, 1.0], "first in l0 (Linear)"),
    ],
)
def test_diagnosis_of_scaled_updates(ratios: list, text: str) -> None:
    config = VerifyConfig(model="support.models:mlp", shape=(16,))
    diagnosis = diagnose(_comparison(ratios), _facts(), config)
    assert not diagnosis.equivalent and text in diagnosis.causes[0]
    assert "first differing layers in module order: l0 (Linear), l1 (BatchNorm1d), l2 (Linear)" in diagnosis.verdict


def test_diagnosis_prefers_first_forward_difference() -> None:
    config = VerifyConfig(model="support.models:mlp", shape=(16,))
    forward = [ForwardDiff("l0", 0, 0.0), ForwardDiff("l1", 1, 0.2), ForwardDiff("l2", 1, 0.3)]
    diagnosis = diagnose(_comparison([1.0, 1.0, 1.0], forward), _facts(), config)
    assert diagnosis.causes[0].startswith("BatchNorm statistics are computed per rank: l1 (BatchNorm1d)")


def test_cli_refuses_bad_flags_with_exit_2() -> None:
    assert cli(["verify", "support.models:mlp", "--shape", "16", "--batch", "15"]) == 2
    assert cli(["verify", "support.models:nothing", "--shape", "16"]) == 2


def test_flags_after_the_model_are_verifys_own_and_never_guessed(capsys: pytest.CaptureFixture) -> None:
    from lockstep.cli.main import parse_args
    from lockstep.cli.verify import config_from_args

    config = config_from_args(parse_args(["verify", "support.models:mlp", "--nproc", "2", "--shape", "16"]))
    assert (config.model, config.nproc, config.shape) == ("support.models:mlp", 2, (16,))
    for abbreviated in (["--n", "2"], ["--step=3"]):  # once taken for --nproc / --steps
        with pytest.raises(SystemExit) as exit_info:
            cli(["verify", "support.models:mlp", *abbreviated])
        assert exit_info.value.code == 2
        flag = abbreviated[0].split("=")[0]
        assert capsys.readouterr().err.startswith(f"lockstep verify: unknown option {flag}; ")


# -- real processes ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy, accumulate", [("ddp", 1), ("fsdp", 1), ("ddp", 2)])
def test_batchnorm_free_model_is_equivalent(strategy: str, accumulate: int, capsys: pytest.CaptureFixture) -> None:
    code = cli(["verify", "support.models:mlp", *VERIFY_FLAGS, "--strategy", strategy, "--accumulate", str(accumulate)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: EQUIVALENT within tolerance 1e-05" in out
    assert "dropout disabled for the comparison in: drop" in out
    assert "first forward pass: every module's output agrees on every rank" in out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_batchnorm_without_sync_bn_is_named(capsys: pytest.CaptureFixture) -> None:
    code = cli(["verify", "support.models:bn_mlp", *VERIFY_FLAGS])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "verdict: NOT EQUIVALENT (tolerance 1e-05" in out
    assert "likely cause: BatchNorm statistics are computed per rank: bn (BatchNorm1d)" in out
    assert "bn.running_mean" in out  # buffers are compared too


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_rank_dependent_layer_is_named(capsys: pytest.CaptureFixture) -> None:
    code = cli(["verify", "support.models:broken", *VERIFY_FLAGS])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "likely cause: middle (RankScaledLinear) computes a different output on rank 1" in out
    assert "hidden (Linear)" in out  # the layer before it agrees, and is shown as agreeing
    assert re.search(r"middle \(RankScaledLinear\)\s+1\.0e\+00  differs on rank 1  <- first difference", out)


def test_diagnosis_of_randomness_suggests_dropout_modes() -> None:
    config = VerifyConfig(model="support.models:mlp", shape=(16,), dropout="align")
    facts = ModelFacts({"": "Net", "l0": "Linear", "l1": "MyNoise", "l2": "Linear"}, random=["l1"])
    forward = [ForwardDiff("l0", 0, 0.0), ForwardDiff("l1", 1, 0.5)]
    diagnosis = diagnose(_comparison([1.0, 1.0, 1.0], forward), facts, config)
    assert "l1 (MyNoise) draws random numbers" in diagnosis.causes[0]
    assert "--dropout disable" in diagnosis.causes[0] and "--dropout align" in diagnosis.causes[0]
    assert "first forward pass first differs at l1 (MyNoise) on rank 1" in diagnosis.verdict


def test_equivalent_verdict_states_tolerance() -> None:
    config = VerifyConfig(model="support.models:mlp", shape=(16,), precision="bf16-mixed")
    comparison = Comparison(
        1e-2, [LossDiff(0, 1.0, 1.001, 1e-3)], [TensorDiff("l0.weight", "parameter", "l0", 4e-3, 1.0)], []
    )
    diagnosis = diagnose(comparison, _facts(), config)
    assert diagnosis.equivalent and diagnosis.causes == []
    assert diagnosis.verdict.startswith("verdict: EQUIVALENT within tolerance 1e-02")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.gpu(count=2)
def test_sync_bn_makes_batchnorm_equivalent_on_gpus(capsys: pytest.CaptureFixture) -> None:
    code = cli(["verify", "support.models:bn_mlp", *VERIFY_FLAGS, "--sync-bn"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: EQUIVALENT within tolerance 1e-05" in out
