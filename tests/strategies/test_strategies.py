"""strategies: registry and options, single/dp/ddp/fsdp behaviour, parity with one process.

Multi-process checks run real gloo jobs through ``tests/support/dist.py``; each launched body checks
several things to keep the number of launches small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lockstep.comm.group import init_comm
from lockstep.errors import ConfigError
from lockstep.session.config import SessionConfig
from lockstep.strategies import (
    DDPStrategy,
    SingleStrategy,
    Strategy,
    UnusedParametersError,
    available_strategies,
    explain_ddp_error,
    get_strategy,
    register_strategy,
    strategy_for_model,
    unwrap_module,
)
from lockstep.strategies.ddp import reducer_parameter_names
from lockstep.strategies.fsdp import fsdp_blocks
from support.comm import null_comm
from support.dist import run_distributed

CPU = torch.device("cpu")
GLOBAL_BATCH = 12
STEPS = 50
ACCUM_STEPS = 10


def _make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    accumulate: int = 1,
    no_sync: Callable[[], Any] | None = None,
) -> None:
    for _ in range(steps):
        pieces = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        for i, (xc, yc) in enumerate(pieces):
            last = i == len(pieces) - 1
            with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
                (F.mse_loss(model(xc), yc) / accumulate).backward()
        opt.step()
        opt.zero_grad()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def _max_rel_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


def _reference(steps: int) -> dict[str, Any]:
    """One process, the whole global batch: what every distributed run must reproduce."""
    model = _make_model(0)
    opt = _sgd(model)
    x, y = _data()
    _train(model, opt, x, y, steps)
    momentum = [opt.state[p]["momentum_buffer"].numpy().copy() for p in model.parameters()]
    F.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    return {
        "weights": _numpy(model.state_dict()),
        "momentum": momentum,
        "norm": norm,
        "grads": [g.numpy() for g in grads],
    }


# -- registry and options ----------------------------------------------------------------------


def test_registry_lists_and_refuses_unknown() -> None:
    assert available_strategies() == ["auto", "ddp", "dp", "fsdp", "horovod", "single"]
    with pytest.raises(ConfigError) as info:
        get_strategy("horovodd", null_comm(), CPU)
    for name in available_strategies():
        assert name in str(info.value)
    assert isinstance(get_strategy("DDP", null_comm(), CPU), DDPStrategy)


def test_unknown_or_mistyped_option_is_refused() -> None:
    with pytest.raises(ConfigError, match="find_unused_parameters") as info:
        get_strategy("ddp", null_comm(), CPU, find_unused=True)
    assert "'find_unused'" in str(info.value) and "bucket_cap_mb" in str(info.value)
    with pytest.raises(ConfigError, match="True or False"):
        get_strategy("single", null_comm(), CPU, sync_bn=1)
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        get_strategy("ddp", null_comm(), CPU, bucket_cap_mb=-1).validate(nn.Linear(1, 1))


def test_auto_resolves_and_filters_options() -> None:
    strategy = get_strategy("auto", null_comm(), CPU, find_unused_parameters=True, sync_bn=False)
    assert isinstance(strategy, SingleStrategy)
    assert "find_unused_parameters" not in strategy.options
    with pytest.raises(ConfigError, match="no strategy has the option 'nope'"):
        get_strategy("auto", null_comm(), CPU, nope=1)


def test_register_custom_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    import lockstep.strategies as strategies

    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))

    @register_strategy("Mine")
    class Mine(Strategy):
        name = "mine"

    assert "mine" in available_strategies()
    assert type(get_strategy("mine", null_comm(), CPU)) is Mine
    with pytest.raises(TypeError):
        register_strategy("bad")(int)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_dp_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match="dp.*needs CUDA GPUs") as info:
        get_strategy("dp", null_comm(), CPU)
    assert "'ddp'" in str(info.value)


def test_sync_bn_on_cpu_is_refused_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # every rank's device is then the CPU
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match="sync_bn=True .* needs GPUs"):  # by the Session's options, before any group
        SessionConfig("single", sync_bn=True)
    assert isinstance(model[1], nn.BatchNorm1d)  # untouched


# -- single process ----------------------------------------------------------------------------


def test_single_state_dicts_round_trip() -> None:
    strategy = get_strategy("single", null_comm(), CPU)
    model = strategy.setup_module(_make_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    _train(model, opt, x, y, 3)
    state = strategy.model_state_dict(model)
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    before = state["0.weight"].clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(state["0.weight"], before), "the state dict must not alias live weights"
    strategy.load_model_state_dict(model, state)
    assert torch.equal(model[0].weight, before)

    saved = strategy.optimizer_state_dict(model, opt)
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    strategy.load_optimizer_state_dict(model, fresh, saved)
    assert fresh.param_groups[0]["lr"] == 0.01
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
        assert fresh.state[p]["step"] == opt.state[p]["step"]


def test_checkpoint_eval_and_optimizer_hooks() -> None:
    strategy = get_strategy("single", null_comm(), CPU)
    model = strategy.setup_module(_make_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    _train(model, opt, x, y, 2)
    assert strategy.sharded_state(model, opt) is None
    full, sharded = strategy.checkpoint_state(model, opt)
    assert sharded is None and full is not None and set(full) == {"model", "optimizer"}
    assert set(strategy.checkpoint_state(model, None)[0] or {}) == {"model"}
    other = strategy.setup_module(_make_model(1))
    fresh = torch.optim.Adam(other.parameters(), lr=0.5)
    strategy.load_checkpoint_state(other, fresh, full, None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert fresh.param_groups[0]["lr"] == 0.01
    # evaluation hooks of a strategy without collectives in its forward: nothing to do
    with strategy.eval_context(model):
        model(x)
    assert strategy.extra_eval_forwards(model, 3) == 0
    assert strategy_for_model(model, null_comm(), CPU).name == "single"
    # an optimizer built on the bare model is fine unless the strategy replaces the parameters
    strategy.check_optimizer(opt)
    with pytest.raises(ConfigError, match="replaces the model's parameters: pass an optimizer factory"):
        get_strategy("fsdp", null_comm(), CPU).check_optimizer(opt)


def test_load_refuses_mismatched_keys() -> None:
    strategy = get_strategy("single", null_comm(), CPU)
    model = strategy.setup_module(_make_model(0))
    prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="no 'module.' prefix"):
        strategy.load_model_state_dict(model, prefixed)
    wrong = dict(model.state_dict(), **{"0.bias": torch.zeros(3)})
    with pytest.raises(ConfigError, match="'0.bias' has shape"):
        strategy.load_model_state_dict(model, wrong)


@pytest.mark.slow
def test_unwrap_strips_wrappers_and_clip_matches_torch() -> None:
    bare = _make_model(0)
    assert unwrap_module(nn.DataParallel(bare)) is bare  # without GPUs DataParallel is a shell
    assert unwrap_module(torch.compile(nn.DataParallel(bare))) is bare
    strategy = get_strategy("single", null_comm(), CPU)
    model = strategy.setup_module(bare)
    x, y = _data()
    F.mse_loss(model(x), y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = strategy.clip_grad_norm(model, 0.01)
    assert torch.allclose(norm, expected)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert after == pytest.approx(0.01, rel=1e-4)
    with pytest.raises(ConfigError, match="max_norm"):
        strategy.clip_grad_norm(model, 0.0)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_ddp_and_fsdp_with_one_process_leave_model_unwrapped(name: str) -> None:
    strategy = get_strategy(name, null_comm(), CPU)
    model = _make_model(0)
    assert strategy.setup_module(model) is model
    with strategy.no_backward_sync(model):
        pass
    assert list(strategy.model_state_dict(model)) == list(model.state_dict())


def test_explain_ddp_error_names_parameters() -> None:
    model = _Dead()
    message = (
        "Expected to have finished reduction in the prior iteration ...\n"
        "Parameter indices which did not receive grad for rank 1: 2 3\n In addition, ..."
    )
    err = explain_ddp_error(RuntimeError(message), model)
    assert isinstance(err, UnusedParametersError)
    assert err.rank == 1 and err.names == ["dead.weight", "dead.bias"]
    assert "find_unused_parameters=True" in str(err) and "dead.weight" in str(err)
    detail = "Parameters which did not receive grad for rank 0: dead.weight, dead.bias\n"
    assert explain_ddp_error(RuntimeError(detail), model).names == ["dead.weight", "dead.bias"]  # type: ignore[union-attr]
    assert explain_ddp_error(RuntimeError("CUDA out of memory"), model) is None


def test_ddp_forward_names_unused_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DDP wrapper lockstep makes raises DDP's unused-parameter error with the names."""
    from lockstep.strategies.ddp import _LockstepDDP

    message = "Parameter indices which did not receive grad for rank 1: 2 3"

    def fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    monkeypatch.setattr(nn.parallel.DistributedDataParallel, "forward", fail)
    wrapper = _LockstepDDP.__new__(_LockstepDDP)  # no process group: only its forward is under test
    nn.Module.__init__(wrapper)
    wrapper.module = _Dead()
    with pytest.raises(UnusedParametersError, match="dead.weight, dead.bias"):
        wrapper(torch.ones(1, 2))


def test_reducer_parameter_names_follow_ddp_order() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Linear(2, 2), shared, shared, nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    assert reducer_parameter_names(model) == ["0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]


def test_fsdp_blocks_choose_units() -> None:
    seq = _make_model(0)
    assert fsdp_blocks(seq) == [seq[0], seq[2]]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 4)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(3)])
            self.act = nn.ReLU()

    net = Net()
    assert fsdp_blocks(net) == [net.embed, *net.layers]
    assert fsdp_blocks(net, (nn.Sequential,)) == list(reversed(list(net.layers)))


@pytest.mark.gpu
def test_gpu_sync_bn_and_dp() -> None:
    device = torch.device("cuda", 0)
    model = get_strategy("single", null_comm(), device, sync_bn=True).setup_module(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    )
    assert isinstance(model[1], nn.SyncBatchNorm)
    assert model(torch.randn(8, 4, device=device)).shape == (8, 4)
    strategy = get_strategy("dp", null_comm(), device)
    wrapped = strategy.setup_module(_make_model(0))
    assert isinstance(wrapped, nn.DataParallel) and strategy.unwrap(wrapped) is wrapped.module
    out = wrapped(torch.randn(8, 6, device=device))
    assert out.shape == (8, 3) and out.device == device


# -- multi-process bodies ------------------------------------------------------------------------


class _Dead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.dead = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _parity_body(name: str) -> dict[str, Any]:
    comm = init_comm(timeout=60)
    rank, world = comm.rank, comm.world_size
    strategy = get_strategy(name, comm, CPU)
    model = strategy.setup_module(_make_model(seed=rank))  # ranks start different
    out: dict[str, Any] = {"initial": _numpy(strategy.model_state_dict(model))}
    n = GLOBAL_BATCH // world
    x, y = _data()
    xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    opt = _sgd(model)
    _train(model, opt, xs, ys, STEPS)

    state = strategy.model_state_dict(model)
    out["final"] = _numpy(state)
    out["devices"] = sorted({v.device.type for v in state.values()})
    _make_model(99).load_state_dict(state)  # strict: the bare module's keys
    saved = strategy.optimizer_state_dict(model, opt)
    out["momentum"] = [saved["state"][i]["momentum_buffer"].numpy() for i in sorted(saved["state"])]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for entry in opt.state.values():
            entry["momentum_buffer"].zero_()
    strategy.load_model_state_dict(model, state)
    strategy.load_optimizer_state_dict(model, opt, saved)
    out["reloaded"] = _numpy(strategy.model_state_dict(model))
    again = strategy.optimizer_state_dict(model, opt)
    out["momentum_reloaded"] = [again["state"][i]["momentum_buffer"].numpy() for i in sorted(again["state"])]

    F.mse_loss(model(xs), ys).backward()
    out["norm"] = float(strategy.clip_grad_norm(model, 0.01))
    out["clipped"] = float(torch.linalg.vector_norm(torch.stack([_full(p.grad).norm() for p in model.parameters()])))
    opt.zero_grad()

    # Gradient accumulation: 2 micro-batches per step, the first without gradient sync.
    model2 = strategy.setup_module(_make_model(seed=rank))
    with strategy.no_backward_sync(model2):
        F.mse_loss(model2(xs), ys).backward()
    local = [None if p.grad is None else _full(p.grad).norm().item() for p in model2.parameters()]
    out["nosync_grads"] = comm.all_gather_object(local)
    model3 = strategy.setup_module(_make_model(seed=rank))
    opt3 = _sgd(model3)
    _train(model3, opt3, xs, ys, ACCUM_STEPS, accumulate=2, no_sync=lambda: strategy.no_backward_sync(model3))
    out["accumulated"] = _numpy(strategy.model_state_dict(model3))
    comm.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name,world_size", [("ddp", 2), pytest.param("ddp", 3, marks=pytest.mark.e2e), ("fsdp", 2), ("fsdp", 3)]
)
def test_parity_with_single_process(name: str, world_size: int) -> None:
    results = run_distributed(_parity_body, world_size, name, timeout=200)
    ref = _reference(STEPS)
    ref_accum = _reference(ACCUM_STEPS)["weights"]
    initial = _numpy(_make_model(0).state_dict())
    for rank, res in enumerate(results):
        assert _max_rel_diff(res["initial"], initial) == 0.0, f"rank {rank} did not start from rank 0's weights"
        assert _max_rel_diff(res["final"], ref["weights"]) <= 1e-5, f"rank {rank} diverged from 1 process"
        assert _max_rel_diff(res["final"], results[0]["final"]) == 0.0, "ranks disagree"
        assert res["devices"] == ["cpu"]
        assert _max_rel_diff(res["reloaded"], res["final"]) == 0.0
        for got, back, want in zip(res["momentum"], res["momentum_reloaded"], ref["momentum"]):
            assert np.abs(got - want).max() <= 1e-5 * (np.abs(want).max() + 1e-12)
            assert np.array_equal(got, back)
        assert res["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert res["clipped"] == pytest.approx(0.01, rel=1e-4)
        assert _max_rel_diff(res["accumulated"], ref_accum) <= 1e-5
    gathered = results[0]["nosync_grads"]
    if name == "ddp":
        # Without sync each rank keeps the gradient of its own slice: they differ.
        assert gathered[0] != gathered[1] and None not in gathered[0]
    else:
        # FSDP holds unsharded gradients back until the synchronising backward.
        assert all(g is None for rank_grads in gathered for g in rank_grads)


def _fault_body() -> dict[str, Any]:
    comm = init_comm(timeout=60)
    out: dict[str, Any] = {}
    try:
        with mock.patch("torch.cuda.is_available", return_value=False):  # the ranks' devices are CPUs
            SessionConfig("ddp", sync_bn=True)  # every rank refuses it alike, before any model is touched
    except ConfigError as exc:
        out["sync_bn"] = str(exc)
    strategy = get_strategy("ddp", comm, CPU)
    model = strategy.setup_module(_Dead())
    x = torch.randn(4, 3)
    try:
        for _ in range(2):
            model(x).sum().backward()
    except UnusedParametersError as exc:
        out["unused"] = (exc.names, str(exc), isinstance(exc.__cause__, RuntimeError))
    tolerant = get_strategy("ddp", comm, CPU, find_unused_parameters=True)
    model = tolerant.setup_module(_Dead())
    for _ in range(2):
        model(x).sum().backward()
    out["tolerant_ok"] = model.module.a.weight.grad is not None
    comm.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unused_parameter_and_sync_bn_errors_at_two_ranks() -> None:
    for rank, res in enumerate(run_distributed(_fault_body, 2, timeout=100)):
        assert "sync_bn=True (--sync-bn) needs GPUs" in res["sync_bn"]
        names, message, chained = res["unused"]
        assert names == ["dead.weight", "dead.bias"]
        assert f"rank {rank}" in message and "find_unused_parameters=True" in message and chained
        assert res["tolerant_ok"]
