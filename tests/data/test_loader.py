"""data + samplers: exact eval shards, epoch/resume order (FAULTS 12, 20), loaders, uneven inputs (FAULTS 10)."""

from __future__ import annotations

import collections
import gc
import os
import random

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from lockstep.data.loader import (
    EvalSampler,
    TensorRows,
    TrainSampler,
    default_num_workers,
    epoch_order,
    make_loader,
    move_to_device,
    seed_worker,
)
from lockstep.data.steps import StepSampler
from lockstep.errors import ConfigError
from support.dist import run_distributed


def _ranks(n: int, world_size: int, epoch: int = 0, **kw: object) -> list[list[int]]:
    out = []
    for r in range(world_size):
        s = TrainSampler(n, world_size, r, **kw)  # type: ignore[arg-type]
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def _interleave(per_rank: list[list[int]]) -> list[int]:
    """Global order as the ranks consume it: position i*W + r is rank r's i-th sample."""
    return [idx for step in zip(*per_rank) for idx in step]


# --- EvalSampler -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 7, 1797])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_cover_range_exactly_once(n: int, world_size: int) -> None:
    shards = [list(EvalSampler(n, world_size, r)) for r in range(world_size)]
    assert [i for shard in shards for i in shard] == list(range(n))  # contiguous, in rank order
    sizes = [len(EvalSampler(n, world_size, r)) for r in range(world_size)]
    assert sizes == [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_eval_sampler_refuses_bad_rank() -> None:
    with pytest.raises(ConfigError, match="rank 2 is out of range for world_size 2"):
        EvalSampler(10, 2, 2)


# --- TrainSampler: order ---------------------------------------------------------------------


def test_epochs_differ_and_are_permutations() -> None:
    orders = [_interleave(_ranks(100, 2, epoch=e, seed=3)) for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(100))
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # seed and epoch are mixed, not added: (seed 0, epoch 1) differs from (seed 1, epoch 0)
    assert epoch_order(100, seed=0, epoch=1) != epoch_order(100, seed=1, epoch=0)


def test_same_seed_and_epoch_give_the_same_order_on_every_rank() -> None:
    a, b = _ranks(37, 3, epoch=5, seed=11), _ranks(37, 3, epoch=5, seed=11)
    assert a == b
    assert _interleave(a)[:37] == epoch_order(37, seed=11, epoch=5)
    assert _ranks(37, 3, epoch=5, seed=12) != a


def test_no_shuffle_reads_in_order() -> None:
    assert _interleave(_ranks(6, 2, shuffle=False)) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("n", [1, 5, 7, 10, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equal_lengths_on_all_ranks(n: int, world_size: int) -> None:
    padded = _ranks(n, world_size, seed=1)
    assert len({len(p) for p in padded}) == 1 and len(padded[0]) == -(-n // world_size)
    assert set(_interleave(padded)) == set(range(n))  # padding only repeats, never loses
    cut = _ranks(n, world_size, seed=1, drop_last=True)
    flat = _interleave(cut)
    assert len({len(p) for p in cut}) == 1 and len(flat) == (n // world_size) * world_size
    assert len(set(flat)) == len(flat)  # drop_last never duplicates
    assert flat == epoch_order(n, seed=1, epoch=0)[: len(flat)]
    for r in range(world_size):
        assert len(TrainSampler(n, world_size, r, drop_last=True)) == len(cut[r])


# --- TrainSampler: resume ----------------------------------------------------------------------


@pytest.mark.parametrize("n,world_size,batch,steps", [(100, 1, 8, 3), (101, 2, 4, 5), (47, 3, 5, 2), (9, 2, 1, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_mid_epoch_same_world_size(n: int, world_size: int, batch: int, steps: int, drop_last: bool) -> None:
    """FAULTS 12: a resumed run sees exactly what the uninterrupted run would have seen."""
    full = _ranks(n, world_size, epoch=2, seed=7, drop_last=drop_last)
    first = TrainSampler(n, world_size, 0, seed=7, drop_last=drop_last)
    first.set_epoch(2)
    for _ in range(steps):
        first.advance(batch * world_size)
    state = first.state_dict()
    assert state["seen"] == steps * batch * world_size and state["epoch"] == 2
    for r in range(world_size):
        resumed = TrainSampler(n, world_size, r, seed=0, drop_last=drop_last)  # saved seed wins
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # what an epoch loop does on resume: keeps the loaded position
        rest = list(resumed)
        assert rest == full[r][steps * batch :]
        assert len(resumed) == len(rest)


@pytest.mark.parametrize("new_world_size", [1, 3, 4])
def test_resume_on_another_world_size_covers_the_rest(new_world_size: int) -> None:
    """FAULTS 20: the position is in global samples, so another world size continues correctly."""
    n, seen = 53, 2 * 3 * 2  # 3 steps of batch 2 on 2 ranks
    s = TrainSampler(n, 2, 1, seed=4)
    s.set_epoch(1)
    s.advance(seen)
    state = s.state_dict()
    order = epoch_order(n, seed=4, epoch=1)
    per_rank = []
    for r in range(new_world_size):
        t = TrainSampler(n, new_world_size, r, seed=4)
        t.load_state_dict(state)
        per_rank.append(list(t))
    assert len({len(p) for p in per_rank}) == 1
    flat = _interleave(per_rank)
    assert flat[: n - seen] == order[seen:]  # the exact global order from `seen` on
    assert set(flat[n - seen :]) <= set(order[:seen])  # padding reuses already-seen samples only


def test_set_epoch_resets_position_and_end_of_epoch_is_empty() -> None:
    s = TrainSampler(10, 2, 0)
    s.advance(100)
    assert s.seen == 10 and len(s) == 0 and list(s) == []
    s.set_epoch(1)
    assert s.seen == 0 and len(s) == 5
    s.load_state_dict({"epoch": 1, "seen": 4})
    list(s)  # iteration started: a later set_epoch of the same epoch starts over
    s.set_epoch(1)
    assert s.seen == 0


def test_bad_sampler_state_refused() -> None:
    s = TrainSampler(10, 2, 0)
    with pytest.raises(ConfigError, match="saved for a dataset of 12 samples but this dataset has 10"):
        s.load_state_dict({"epoch": 0, "seen": 2, "dataset_len": 12})
    with pytest.raises(ConfigError, match="out of range"):
        TrainSampler(10, 2, 5)
    with pytest.raises(ValueError):
        s.advance(-1)


# --- make_loader -------------------------------------------------------------------------------


def _tensors(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def test_make_loader_errors() -> None:
    with pytest.raises(ConfigError, match="batch size must be >= 1"):
        make_loader(_tensors(10), 0, world_size=1, rank=0)
    with pytest.raises(ConfigError, match=r"10 samples over world size 3 .* batch size 4 per device"):
        make_loader(_tensors(10), 4, world_size=3, rank=0, drop_last=True)
    with pytest.raises(ConfigError, match="empty"):
        make_loader(_tensors(0), 4, world_size=1, rank=0)
    with pytest.raises(ConfigError, match="drop_last=True would leave samples out"):
        make_loader(_tensors(10), 4, world_size=1, rank=0, eval=True, drop_last=True)

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(3))

    with pytest.raises(ConfigError, match="map-style dataset"):
        make_loader(Stream(), 2, world_size=1, rank=0)
    # 10 samples, 3 ranks, batch 3: 3 per rank with drop_last is exactly one batch, accepted
    assert len(make_loader(_tensors(10), 3, world_size=3, rank=2, drop_last=True)) == 1


def test_make_loader_defaults_and_samplers() -> None:
    train = make_loader(_tensors(10), 4, world_size=2, rank=1, order="torch")
    assert isinstance(train.sampler, TrainSampler) and train.batch_size == 4
    default = make_loader(_tensors(10), 4, world_size=2, rank=1)  # one global cursor, no padding
    assert isinstance(default.sampler, StepSampler) and default.sampler.plan.micro == 4
    assert [b[1].tolist() for b in default] == [[epoch_order(10, 0, 0)[i] for i in r] for r in ([4, 5, 6, 7], [9])]
    assert train.num_workers == 0 and train.pin_memory is (torch.cuda.is_available())
    ev = make_loader(_tensors(5), 2, world_size=2, rank=1, eval=True)
    assert isinstance(ev.sampler, EvalSampler)
    assert [b[1].tolist() for b in ev] == [[3, 4]]
    assert len(train) == 2  # 5 samples on this rank in batches of 4


def _collated_by_torch(loader: torch.utils.data.DataLoader, dataset: Dataset) -> list:
    """The loader's batches as DataLoader's fetcher makes them: each sample read, then ``default_collate``."""
    order = loader.sampler if loader.batch_sampler is None else loader.batch_sampler
    return [default_collate([dataset[i] for i in indices]) for indices in list(order)]


@pytest.mark.parametrize("kind", ["lockstep", "torch", "eval"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_tensor_dataset_is_read_a_batch_at_a_time_as_default_collate_reads_it(kind: str, num_workers: int) -> None:
    """Values, dtypes, shapes and strides, also from tensors that are not contiguous and hold several dtypes."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(3, 23, generator=gen).t(),  # a transposed view: rows are strided
        torch.randint(100, (23, 2, 2), generator=gen, dtype=torch.int32),
        torch.arange(23),
        torch.rand(23, generator=gen, dtype=torch.float64) > 0.5,
    )
    options = {"eval": True} if kind == "eval" else {"order": kind}
    loader = make_loader(data, 4, world_size=2, rank=1, seed=3, num_workers=num_workers, **options)
    if num_workers == 0:
        assert loader.pin_memory or isinstance(loader._read, TensorRows)  # read here, not by DataLoader's iterator
    expected = _collated_by_torch(loader, data)
    got = list(loader)
    assert len(got) == len(expected) > 2
    for batch, want in zip(got, expected):
        assert isinstance(batch, list) and len(batch) == len(want) == 4
        for tensor, reference in zip(batch, want):
            assert tensor.dtype == reference.dtype and tensor.shape == reference.shape
            assert tensor.stride() == reference.stride() and torch.equal(tensor, reference)


def test_a_dataset_that_is_not_a_plain_tensor_dataset_keeps_its_own_reading() -> None:
    """A subclass may read its items its own way, and a collate_fn of the user's is used as given."""

    class Doubled(TensorDataset):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
            return tuple(2 * t[i] for t in self.tensors)

    doubled = make_loader(Doubled(torch.arange(8.0)), 4, world_size=1, rank=0, shuffle=False, seed_samples=False)
    assert [b[0].tolist() for b in doubled] == [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0]]
    summed = make_loader(
        _tensors(8), 4, world_size=1, rank=0, shuffle=False, collate_fn=lambda rows: sum(r[1] for r in rows)
    )
    assert [int(b) for b in summed] == [6, 22]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_follows_the_sampler_position(num_workers: int) -> None:
    """Also with persistent workers, whose iterator is reset rather than rebuilt each epoch."""
    loader = make_loader(_tensors(20), 3, world_size=2, rank=0, seed=5, num_workers=num_workers)
    assert loader.persistent_workers is (num_workers > 0)
    loader.sampler.set_epoch(1)
    full = [b[1].tolist() for b in loader]
    loader.sampler.load_state_dict({"epoch": 1, "seen": 2 * 3 * 2, "seed": 5, "shuffle": True})
    loader.sampler.set_epoch(1)
    assert len(loader) == len(full) - 2
    assert [b[1].tolist() for b in loader] == full[2:]


class _Collecting(Dataset):
    """Runs the worker's garbage collector on every item, as a worker's own allocations eventually do."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        gc.collect()
        return torch.tensor([float(i)]), i


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_workers_survive_a_dropped_store_left_in_garbage() -> None:
    """A TCPStore (it owns a server thread) dropped inside a reference cycle before the workers fork:
    collected in a worker, its destructor would join a thread that process does not have and abort it."""
    import torch.distributed as dist

    class Holder:
        pass

    def drop() -> None:
        holder = Holder()
        holder.me = holder  # type: ignore[attr-defined]  # a cycle: only the collector frees it
        holder.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]

    enabled = gc.isenabled()
    gc.disable()  # the cycle stays until something collects it
    try:
        drop()
        loader = make_loader(_Collecting(), 3, world_size=1, rank=0, seed=1, num_workers=2, seed_samples=False)
        assert sorted(i for b in loader for i in b[1].tolist()) == list(range(12))
    finally:
        if enabled:
            gc.enable()
        gc.collect()  # the store it left in garbage stops listening here, not at some later test's collection


class _Noisy(Dataset):
    """Each item draws from torch, numpy and random, like a random augmentation would."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy as np

        return torch.tensor([torch.rand(1).item(), float(np.random.rand()), random.random()])


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_worker_seeds_are_reproducible_and_differ_by_rank_and_epoch(persistent: bool) -> None:
    def draw(rank: int, epoch: int) -> torch.Tensor:
        loader = make_loader(
            _Noisy(), 4, world_size=2, rank=rank, num_workers=2, seed=9, shuffle=False, persistent_workers=persistent
        )
        if epoch:
            list(loader)  # persistent workers live on from the epoch before
        loader.sampler.set_epoch(epoch)
        return torch.cat(list(loader))

    a = draw(0, 0)
    assert torch.equal(a, draw(0, 0))
    assert not torch.equal(a, draw(1, 0))
    assert not torch.equal(a, draw(0, 1))
    assert len(set(a[:, 1].tolist())) == len(a)  # numpy is seeded per worker: no repeats


def test_seed_worker_seeds_python_and_numpy() -> None:
    import numpy as np

    torch.manual_seed(1234)
    seed_worker(0)
    first = (random.random(), float(np.random.rand()))
    torch.manual_seed(1234)
    seed_worker(0)
    assert (random.random(), float(np.random.rand())) == first


def test_default_num_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_num_workers(torch.device("cuda", 0), 1) == 4
    assert default_num_workers(torch.device("cuda", 0), 8) == 1
    assert default_num_workers(torch.device("cpu"), 1) == 2
    assert default_num_workers(torch.device("cpu"), 2) == 2
    assert default_num_workers(torch.device("cpu"), 8) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_num_workers(torch.device("cuda", 0), 2) == 0


def test_move_to_device_recurses_and_keeps_types() -> None:
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), "tag")], "c": Pair(torch.ones(1), 3)}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["a"].device.type == "meta" and moved["b"][0].device.type == "meta"
    assert isinstance(moved["b"][1], tuple) and moved["b"][1][1] == "tag"
    assert isinstance(moved["c"], Pair) and moved["c"].x.device.type == "meta" and moved["c"].y == 3
    od = collections.OrderedDict(k=torch.ones(1))
    assert isinstance(move_to_device(od, torch.device("meta")), collections.OrderedDict)


@pytest.mark.gpu
def test_pinned_loader_and_non_blocking_copy_on_cuda() -> None:
    loader = make_loader(_tensors(8), 4, world_size=1, rank=0, eval=True)
    assert loader.pin_memory
    batch = next(iter(loader))
    assert all(t.is_pinned() for t in batch)  # a TensorDataset's batch is pinned where it is read
    x, y = move_to_device(batch, torch.device("cuda", 0))
    assert x.is_cuda and y.is_cuda and y.tolist() == [0, 1, 2, 3]


# --- FAULTS 10: uneven inputs with a real DDP model ----------------------------------------------


def _train_uneven(n: int, batch: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lockstep.comm.group import init_comm

    comm = init_comm(timeout=20)  # a rank left waiting would fail in 20 s, not hang the test
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(n, 2, generator=torch.Generator().manual_seed(1)), torch.randn(n, 1))
    loader = make_loader(data, batch, world_size=comm.world_size, rank=comm.rank, seed=3, order="torch")
    steps = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        count = 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loader.sampler.advance(batch * comm.world_size)
            count += 1
        steps.append(count)
    left = len(loader)
    loader.sampler.set_epoch(0)
    epoch0 = list(loader.sampler)
    weights = model.module.weight.detach().tolist()  # plain values: tensors do not outlive the process
    comm.shutdown()
    return {"steps": steps, "left": left, "epoch0": epoch0, "weights": weights}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,n", [(2, 13), (3, 22)])
def test_uneven_dataset_trains_with_equal_step_counts(world_size: int, n: int) -> None:
    """FAULTS 10: n does not divide by the world size (a plain split of 13 samples in batches of 2
    would give one rank 3 batches and the other 4, and DDP would wait forever in the extra
    backward). The sampler pads, so every rank runs the same number of steps and finishes."""
    batch = 2
    results = run_distributed(_train_uneven, world_size, n, batch, timeout=90)
    per_rank = -(-n // world_size)  # the sampler pads to a multiple of the world size
    expected = -(-per_rank // batch)
    for res in results:
        assert res["steps"] == [expected, expected]
        assert res["left"] == 0  # the position reached the end of the epoch on every rank
        assert res["weights"] == results[0]["weights"]  # DDP kept replicas equal
    # The ranks computed the same epoch order in separate processes: together they cover range(n).
    flat = _interleave([res["epoch0"] for res in results])
    assert flat[:n] == epoch_order(n, seed=3, epoch=0, order="torch")


def test_one_process_with_a_batch_larger_than_its_data_gets_one_smaller_batch_as_a_dataloader_does() -> None:
    data = TensorDataset(torch.arange(10))
    loader = make_loader(data, 32, world_size=1, rank=0, seed=0)
    (batch,) = list(loader)
    assert sorted(batch[0].tolist()) == list(range(10))  # every sample, once
    with pytest.raises(ConfigError, match=r"\(16 per device x 2 processes\) is more than the 10 samples"):
        make_loader(data, 16, world_size=2, rank=0)  # each process's share would be less than one batch
    with pytest.raises(ConfigError, match="a global batch of 32 samples is more than the 10 samples"):
        make_loader(data, 32, world_size=1, rank=0, global_batch=32)  # a global batch asked for is held
