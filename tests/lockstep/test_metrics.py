"""metrics: sums and counts reduced once; distributed evaluation equals single-process (FAULTS 11)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lockstep.comm.group import Comm
from lockstep.data.loader import make_loader
from lockstep.env import World
from lockstep.errors import ConfigError
from lockstep.metrics import SumCount, accuracy, evaluate
from support.dist import run_distributed

SOLO = Comm(World())


def _tiny(n: int = 5) -> tuple[torch.nn.Module, TensorDataset]:
    """A fixed, deterministic model and dataset (the same in every process)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    return model, TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def _digits() -> tuple[torch.nn.Module, TensorDataset]:
    """The 1,797 scikit-learn digits and a nearest-class-mean linear classifier (about 90% right)."""
    from sklearn.datasets import load_digits

    x_np, y_np = load_digits(return_X_y=True)
    x, y = torch.tensor(x_np / 16.0, dtype=torch.float32), torch.tensor(y_np)
    means = torch.stack([x[y == c].mean(0) for c in range(10)])
    model = torch.nn.Linear(64, 10)
    with torch.no_grad():  # score = x.m - |m|^2/2, the largest for the nearest mean
        model.weight.copy_(means)
        model.bias.copy_(-0.5 * (means * means).sum(1))
    return model, TensorDataset(x, y)


def _reference(model: torch.nn.Module, data: TensorDataset) -> dict:
    """Single-process figures over the whole dataset in one batch, in float64."""
    x, y = data.tensors
    with torch.no_grad():
        out = model.double()(x.double())
        model.float()
    return {
        "loss": F.cross_entropy(out, y, reduction="sum").item() / len(y),
        "correct": int((out.argmax(1) == y).sum()),
        "count": len(y),
    }


def _check(got: dict, ref: dict) -> None:
    assert got["count"] == ref["count"]
    assert got["accuracy"] == ref["correct"] / ref["count"]  # exact, not approximately
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)


# --- single process ---------------------------------------------------------------------------


def test_sum_count_reduces_sums_not_means() -> None:
    meter = SumCount()
    meter.add(6.0, 3)
    meter.add(torch.tensor([1.0, 1.0]), 2)  # a tensor is summed and kept on its device
    assert meter.totals(SOLO) == (8.0, 5)
    assert meter.compute(SOLO) == pytest.approx(1.6)
    assert math.isnan(SumCount().compute(SOLO))
    with pytest.raises(ValueError, match="count must be >= 0"):
        meter.add(1.0, -1)


def test_evaluate_matches_reference_in_one_process() -> None:
    model, data = _digits()
    loader = make_loader(data, 128, world_size=1, rank=0, eval=True)
    _check(evaluate(model, loader, SOLO), _reference(model, data))
    assert accuracy(model, loader, SOLO) == _reference(model, data)["correct"] / len(data)
    assert accuracy(model, loader, SOLO) > 0.85  # the classifier is a real one, not chance


def test_loss_module_forward_hook_and_one_hot_targets() -> None:
    model, data = _tiny(9)
    x, y = data.tensors
    calls = []

    def forward(m: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        calls.append(len(inputs))
        return m(inputs)

    criterion = torch.nn.CrossEntropyLoss()
    got = evaluate(model, DataLoader(data, batch_size=4), SOLO, criterion, forward=forward)
    assert calls == [4, 4, 1] and criterion.reduction == "mean"  # the caller's module is untouched
    _check(got, _reference(model, data))
    one_hot = TensorDataset(x, F.one_hot(y, 3).float())
    assert accuracy(model, DataLoader(one_hot, batch_size=4), SOLO) == got["accuracy"]


def test_modes_are_restored_module_by_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    model.train()
    model[1].eval()  # a deliberately frozen submodule must stay frozen
    _, data = _tiny()
    first = accuracy(model, DataLoader(data, batch_size=2), SOLO)
    assert model.training and model[0].training and not model[1].training
    assert accuracy(model, DataLoader(data, batch_size=2), SOLO) == first  # dropout was off


def test_bad_loss_and_bad_batches_refused() -> None:
    model, data = _tiny()
    with pytest.raises(ConfigError, match="takes no `reduction` argument"):
        evaluate(model, DataLoader(data), SOLO, lambda out, y: F.cross_entropy(out, y))
    with pytest.raises(ConfigError, match=r"\(inputs, targets\) pairs"):
        accuracy(model, [data.tensors[0]], SOLO)
    assert model.training  # restored even after an error


def test_the_job_is_a_session_or_a_comm() -> None:
    import lockstep

    model, data = _tiny()
    session = lockstep.Session(quiet=True)
    assert accuracy(model, DataLoader(data), session) == accuracy(model, DataLoader(data), SOLO)
    session.close()
    with pytest.raises(ConfigError, match="metrics need the job's Session or Comm, got object"):
        accuracy(model, DataLoader(data), object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Session or Comm"):
        SumCount().compute(object())  # type: ignore[arg-type]


def test_empty_evaluation_is_nan_not_an_error() -> None:
    model, _ = _tiny()
    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    got = evaluate(model, make_loader(empty, 4, world_size=1, rank=0, eval=True), SOLO)
    assert got["count"] == 0 and math.isnan(got["loss"]) and math.isnan(got["accuracy"])


@pytest.mark.gpu
def test_evaluate_on_cuda_with_autocast() -> None:
    model, data = _digits()
    ref = _reference(model, data)
    loader = make_loader(data, 256, world_size=1, rank=0, eval=True)
    _check(evaluate(model.cuda(), loader, SOLO), ref)

    def bf16(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x)

    got = evaluate(model, loader, SOLO, forward=bf16)
    assert got["count"] == 1797 and abs(got["accuracy"] - ref["correct"] / 1797) < 0.02
    meter = SumCount()
    meter.add(torch.ones(3, device="cuda"), 3)
    assert meter.device is not None and meter.device.type == "cuda" and meter.compute(SOLO) == 1.0


# --- FAULTS 11 with real processes ------------------------------------------------------------


def _eval_on_ranks(kind: str, batch: int) -> dict:
    from lockstep.comm.group import init_comm

    comm = init_comm(timeout=30)
    model, data = _digits() if kind == "digits" else _tiny()
    loader = make_loader(data, batch, world_size=comm.world_size, rank=comm.rank, eval=True)
    out = {"plain": evaluate(model, loader, comm), "shard": len(loader.sampler)}
    if kind == "tiny":
        one = make_loader(TensorDataset(*data[:1]), batch, world_size=comm.world_size, rank=comm.rank, eval=True)
        out.update(_fsdp(comm, loader, one))
        out.update(_ddp_with_buffers(comm, loader, one))
        meter = SumCount()
        meter.add(float(comm.rank) * (comm.rank + 1), comm.rank + 1)  # rank r: r+1 samples of value r
        out["mean"] = meter.compute(comm)
    comm.shutdown()
    return out


def _fsdp(comm: Comm, loader: DataLoader, one: DataLoader) -> dict:
    """FSDP2 with sharded submodules: each forward all-gathers them, so 2 vs 1 batches (or 1 vs
    none) would leave a rank waiting unless the shorter shards run padding forwards."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    whole = {
        "ref": evaluate(mlp, DataLoader(loader.dataset, batch_size=5), SOLO),
        "ref_one": evaluate(mlp, DataLoader(one.dataset), SOLO),
    }
    fully_shard(mlp[0])
    fully_shard(mlp[2])
    fully_shard(mlp)
    return {"fsdp": evaluate(mlp, loader, comm), "fsdp_one": evaluate(mlp, one, comm), "fsdp_ref": whole}


class _Wrapper(torch.nn.Module):
    """Stands for an outer wrapper (autocast, compile) around the DDP module."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _ddp_with_buffers(comm: Comm, loader: DataLoader, one: DataLoader) -> dict:
    """A DDP model whose BatchNorm statistics differ per rank after a training forward."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3)))
    ddp(torch.randn(6, 4) * (comm.rank + 1)).sum().backward()  # rank-dependent running stats
    got = evaluate(ddp, loader, comm)
    local = evaluate(ddp.module, DataLoader(loader.dataset, batch_size=5), SOLO)  # whole set, this rank
    # Rank 1 has no sample: a buffer broadcast in rank 0's forward would meet no partner.
    wrapped = _Wrapper(ddp)
    wrapped(torch.randn(6, 4) * (comm.rank + 1)).sum().backward()
    got_one = evaluate(wrapped, one, comm)
    local_one = evaluate(ddp.module, DataLoader(one.dataset), SOLO)
    return {
        "ddp": got,
        "ddp_local": local,
        "running_mean": ddp.module[0].running_mean.tolist(),
        "ddp_one": got_one,
        "ddp_one_local": local_one,
        "sync_flag": ddp.require_forward_param_sync,
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_five_samples_on_two_ranks() -> None:
    model, data = _tiny()
    ref = _reference(model, data)
    results = run_distributed(_eval_on_ranks, 2, "tiny", 2, timeout=90)
    assert [r["shard"] for r in results] == [3, 2]  # no padding: 3 + 2 = 5
    for res in results:
        _check(res["plain"], ref)
        for key, ref_key in (("fsdp", "ref"), ("fsdp_one", "ref_one")):
            want = res["fsdp_ref"][ref_key]
            assert res[key]["count"] == want["count"] and res[key]["accuracy"] == want["accuracy"]
            assert res[key]["loss"] == pytest.approx(want["loss"], rel=1e-6)
        # DDP: every rank scored rank 0's statistics, so the distributed figure is that model's
        assert res["running_mean"] == results[0]["running_mean"]
        assert res["ddp"]["count"] == 5 and res["ddp"]["accuracy"] == res["ddp_local"]["accuracy"]
        assert res["ddp"]["loss"] == pytest.approx(res["ddp_local"]["loss"], rel=1e-6)
        assert res["ddp_one"]["count"] == 1 and res["ddp_one"]["loss"] == pytest.approx(
            results[0]["ddp_one_local"]["loss"], rel=1e-6
        )
        assert res["sync_flag"] is True  # DDP's own buffer sync is back on for training
        # (0*1 + 1*2) / (1 + 2) = 2/3, whereas the mean of the rank means would be 1/2
        assert res["mean"] == pytest.approx(2 / 3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_digits_on_three_ranks() -> None:
    model, data = _digits()
    ref = _reference(model, data)
    results = run_distributed(_eval_on_ranks, 3, "digits", 128, timeout=90)
    assert sum(r["shard"] for r in results) == 1797
    for res in results:
        _check(res["plain"], ref)


def test_a_regression_gets_a_loss_and_no_accuracy() -> None:
    from lockstep.metrics import NotAClassifierError

    torch.manual_seed(0)
    x = torch.randn(20, 8)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))  # the README's regression
    model = torch.nn.Linear(8, 1)
    got = evaluate(model, DataLoader(data, batch_size=6), SOLO, loss_fn=F.mse_loss)
    assert set(got) == {"loss", "count"} and got["count"] == 20
    want = F.mse_loss(model(x).double(), x.sum(1, keepdim=True).double()).item()
    # the same float32 outputs; each per-sample loss is a float32 subtraction and square (2 roundings, <= 2**-23
    # relative), summed in float64: the mean is within 2**-22 of the float64 reference
    assert abs(got["loss"] - want) <= 2**-22 * want
    with pytest.raises(NotAClassifierError, match="needs class scores"):
        accuracy(model, DataLoader(data, batch_size=6), SOLO)
