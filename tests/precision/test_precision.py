"""precision: names and aliases, each plugin training on CPU, loss scaling, O2 master weights."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.errors import ConfigError
from lockstep.precision import (
    HalfPrecision,
    MasterWeightPrecision,
    MixedPrecision,
    Precision,
    available_precisions,
    get_precision,
)
from lockstep.session.nonfinite import FiniteCheck
from support.comm import null_comm
from support.dist import run_distributed

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, 8, generator=gen)
    return x, x[:, :1] * 0.5 - x[:, 1:2] * 0.25


def _setup(name: str, lr: float = 0.05) -> tuple[Precision, nn.Module, torch.optim.Optimizer]:
    precision = get_precision(name, CPU)
    model = precision.convert_module(_model())
    opt = precision.setup_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), model)
    return precision, model, opt


def _loss(precision: Precision, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with precision.forward_context():
        out = precision.convert_output(model(precision.convert_input(x)))
        return F.mse_loss(out.float(), y)


def _step(
    precision: Precision, opt: torch.optim.Optimizer, clip: Callable[[list[torch.Tensor]], object] | None = None
) -> bool:
    """The session's order with the plugin's hooks (``TrainStep.step``): unscale and check, clip, step, update."""
    inv_scale = precision.unscale(opt)
    finite = inv_scale is None or FiniteCheck(null_comm())(opt, inv_scale)
    if finite:
        if clip is not None:
            clip(precision.main_parameters(opt))
        precision.optimizer_step(opt)
    precision.update(overflowed=not finite)
    return finite


def _train(precision: Precision, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    x, y = _batch()
    losses = []
    for _ in range(steps):
        loss = _loss(precision, model, x, y)
        precision.backward(loss)
        _step(precision, opt)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "alias,name",
    [
        ("fp32", "fp32"),
        ("O0", "fp32"),
        ("o1", "fp16-mixed"),
        ("O2", "fp16-o2"),
        ("o3", "fp16"),
        ("BF16-Mixed", "bf16-mixed"),
        (" bf16 ", "bf16"),
        ("FP16", "fp16"),
    ],
)
def test_names_and_apex_aliases(alias: str, name: str) -> None:
    assert get_precision(alias, CPU).name == name


def test_unknown_precision_lists_choices() -> None:
    with pytest.raises(ConfigError) as info:
        get_precision("fp8", CPU)
    for name in available_precisions():
        assert name in str(info.value)
    assert "O2" in str(info.value)


@pytest.mark.parametrize("name", available_precisions())
def test_each_precision_trains_a_tiny_model(name: str) -> None:
    precision, model, opt = _setup(name)
    losses = _train(precision, model, opt, 30)
    assert all(math.isfinite(v) for v in losses[-5:])
    assert losses[-1] < 0.5 * losses[0], f"{name}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}"


@pytest.mark.parametrize(
    "name,linear,norm,inside",
    [
        ("fp32", torch.float32, torch.float32, torch.float32),
        ("bf16-mixed", torch.float32, torch.float32, torch.bfloat16),
        ("fp16-mixed", torch.float32, torch.float32, torch.float16),
        ("fp16-o2", torch.float16, torch.float32, torch.float16),
        ("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16, torch.float16, torch.float16),
    ],
)
def test_dtypes(name: str, linear: torch.dtype, norm: torch.dtype, inside: torch.dtype) -> None:
    precision, model, opt = _setup(name)
    assert model[0].weight.dtype == linear and model[3].bias.dtype == linear
    assert model[1].weight.dtype == norm and model[1].running_mean.dtype == norm
    x, _ = _batch()
    with precision.forward_context():
        hidden = model[0](precision.convert_input(x))
        assert hidden.dtype == inside
        out = precision.convert_output(model(precision.convert_input(x)))
    assert torch.get_default_dtype() == torch.float32
    assert out.dtype == (torch.float32 if name in ("fp32", "fp16-o2", "bf16", "fp16") else inside)
    assert precision.convert_input(torch.arange(3)).dtype == torch.int64  # labels stay integers
    assert precision.scales_loss == (name in ("fp16-mixed", "fp16-o2", "fp16"))


def test_o2_optimizer_holds_fp32_masters_of_the_half_model() -> None:
    precision, model, opt = _setup("fp16-o2")
    params = [p for group in opt.param_groups for p in group["params"]]
    assert len(params) == len(list(model.parameters()))
    assert all(p.dtype == torch.float32 for p in params)
    assert params[2] is model[1].weight  # fp32 BatchNorm weights are their own masters
    assert params[0] is not model[0].weight and torch.equal(params[0].half(), model[0].weight)
    _train(precision, model, opt, 5)
    assert torch.equal(params[0].half(), model[0].weight), "the model must hold the stepped masters"
    assert all(p.grad is None for p in model.parameters() if p.dtype == torch.float16)


@pytest.mark.parametrize("name", ["fp16-mixed", "fp16-o2", "fp16"])
def test_overflow_skips_the_step_and_backs_off(name: str) -> None:
    precision, model, opt = _setup(name)
    x, y = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    scale = precision.loss_scale
    precision.backward(_loss(precision, model, x, y) * float("inf"))
    assert _step(precision, opt) is False
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert precision.loss_scale == scale / 2
    precision.backward(_loss(precision, model, x, y))
    assert _step(precision, opt) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name", available_precisions())
def test_state_dict_round_trip(name: str) -> None:
    precision, model, opt = _setup(name)
    x, y = _batch()
    precision.backward(_loss(precision, model, x, y) * float("inf"))
    _step(precision, opt)
    state = precision.state_dict()
    fresh = get_precision(name, CPU)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    if precision.scales_loss:
        assert state["scale"] == 2.0**15 and fresh.loss_scale == 2.0**15
    else:
        assert state == {} and fresh.loss_scale is None
        fresh.load_state_dict({"scale": 4.0, "_growth_tracker": 0})  # from an fp16 run: ignored


def test_clip_runs_on_unscaled_grads() -> None:
    precision, model, opt = _setup("fp16-mixed", lr=0.0)
    x, y = _batch()
    seen: list[float] = []

    def clip(params: list[torch.Tensor]) -> object:
        norm = torch.nn.utils.clip_grad_norm_(params, 1e-3)
        seen.append(float(norm))
        return norm

    reference = _model()
    F.mse_loss(reference(x), y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    precision.backward(_loss(precision, model, x, y))
    assert _step(precision, opt, clip) is True
    assert seen and seen[0] == pytest.approx(float(expected), rel=2e-2)  # not 65536 times larger


def test_o2_clip_acts_on_fp32_master_grads() -> None:
    precision, model, opt = _setup("fp16-o2", lr=0.1)
    opt.param_groups[0]["momentum"] = 0.0
    masters = [p for group in opt.param_groups for p in group["params"]]
    start = [m.detach().clone() for m in masters]
    x, y = _batch()
    grads: list[torch.Tensor] = []

    def clip(params: list[torch.Tensor]) -> object:  # the main parameters: the fp32 masters, no swap of .data
        norm = torch.nn.utils.clip_grad_norm_(params, 1e-3)
        grads.extend(p.grad.clone() for p in params)
        return norm

    precision.backward(_loss(precision, model, x, y))
    assert _step(precision, opt, clip) is True
    assert all(g.dtype == torch.float32 for g in grads)
    assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) == pytest.approx(1e-3, rel=1e-4)
    for m, s, g in zip(masters, start, grads):
        assert torch.allclose(m, s - 0.1 * g, rtol=0, atol=1e-7)  # the step used the clipped fp32 grads
    assert model[0].weight.dtype == torch.float16 and model[0].weight.grad is None


def test_o2_masters_follow_a_loaded_model() -> None:
    precision, model, opt = _setup("fp16-o2", lr=0.0)
    _train(precision, model, opt, 2)
    loaded = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    _train(precision, model, opt, 1)  # lr 0: a correct step leaves the loaded weights in place
    assert torch.all(model[0].weight == 0.5)
    masters = [p for group in opt.param_groups for p in group["params"]]
    assert torch.all(masters[0] == 0.5)


def test_o2_step_needs_setup_optimizer() -> None:
    precision = get_precision("O2", CPU)
    model = precision.convert_module(_model())
    with pytest.raises(ConfigError, match="setup_optimizer"):
        precision.unscale(torch.optim.SGD(model.parameters(), lr=0.1))


def test_plugin_classes_and_fp32_clip() -> None:
    assert type(get_precision("fp32", CPU)) is Precision
    assert isinstance(get_precision("bf16-mixed", CPU), MixedPrecision)
    assert isinstance(get_precision("bf16", CPU), HalfPrecision)
    assert isinstance(get_precision("O2", CPU), MasterWeightPrecision)
    precision, model, opt = _setup("fp32")
    calls: list[int] = []
    x, y = _batch()
    precision.backward(_loss(precision, model, x, y))
    assert _step(precision, opt, lambda params: calls.append(len(params))) is True and calls == [6]  # BatchNorm too


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp16-mixed", "fp16-o2", "bf16-mixed"])
def test_gpu_precisions_train(name: str) -> None:
    device = torch.device("cuda", 0)
    precision = get_precision(name, device)
    model = precision.convert_module(_model().to(device))
    opt = precision.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    x, y = (t.to(device) for t in _batch())
    losses = []
    for _ in range(30):
        loss = _loss(precision, model, x, y)
        precision.backward(loss)
        _step(precision, opt)
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def _overflow_on_one_rank() -> list[tuple[bool, float]]:
    """fp16-mixed under ddp: rank 1's loss overflows at the second step; DDP's all-reduce hands the overflow to
    every rank, which skips that step alike and halves its scale."""
    session = lockstep.Session(strategy="ddp", precision="fp16-mixed", quiet=True, timeout=60)
    model, opt = session.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05))
    x, y = _batch()
    out = []
    for i in range(3):
        loss = F.mse_loss(model(x).float(), y)
        session.backward(loss * float("inf") if i == 1 and session.rank == 1 else loss)
        out.append((session.step(opt), session.precision.loss_scale))
    session.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_agree_on_skipped_steps() -> None:
    results = run_distributed(_overflow_on_one_rank, 2, timeout=100)
    s = 2.0**16
    assert results == [[(True, s), (False, s / 2), (True, s / 2)]] * 2
