"""The session's side of ``--nodes`` in one process: a dropped step goes back to the committed position, the
loader restarts there with the new world's share, accumulation is re-planned; a node let in at an epoch's
last step trains the next epoch with the new shares; a loop that fetches ahead is refused at its first step
(a stand-in group plays the membership). Options that cannot follow
the membership are refused before any group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from lockstep.data.loader import make_loader
from lockstep.data.steps import plan_batches, rank_batches
from lockstep.session.elastic import ElasticTraining
from lockstep.session.loop import Accumulator
from lockstep.session.state import TrainState

pytestmark = pytest.mark.timeout(60)
N, G, CAP = 40, 8, 4


class _Group:
    """The membership: ``admit`` and ``recover`` move this worker to the world the test sets next."""

    def __init__(self, comm: _Comm, handover: Any) -> None:
        self.comm, self.handover, self.step, self.joined = comm, handover, 0, False
        self.waiting: tuple[int, int] | None = None  # (world, rank) a node joining would give

    def start(self) -> None:
        self.joined = True
        if self.comm.handed is not None:  # a running job's committed position, as a member hands it over
            self.handover.position.load_state_dict(self.comm.handed)
            self.step = self.comm.handed["step"]

    def admit(self) -> bool:
        if self.waiting is None:
            return False
        self.comm.world_size, self.comm.rank = self.waiting
        self.waiting = None
        return True

    def recover(self, lost: float) -> None:
        self.comm.world_size, self.comm.rank = 2, 1  # a peer died: this worker is rank 1 of 2 now

    def commit(self) -> None:
        self.step += 1


class _Comm:
    def __init__(self) -> None:
        self.world_size, self.rank = 1, 0
        self.group: _Group | None = None
        self.handed: dict[str, Any] | None = None  # what the members hand over at the join (None: a fresh job)

    @property
    def joined(self) -> bool:
        return self.group is not None and self.group.joined

    def join(self, handover: Any) -> None:
        self.group = _Group(self, handover)
        self.group.start()


def _training(workers: int = 0, comm: _Comm | None = None) -> tuple[ElasticTraining, TrainState, Accumulator, Any]:
    comm, accum = comm or _Comm(), Accumulator(1)
    joins: list[ElasticTraining] = []
    state = TrainState(comm, on_pass=lambda: joins[0].before_pass())  # type: ignore[arg-type]
    elastic = ElasticTraining(comm, accum, state)  # type: ignore[arg-type]
    joins.append(elastic)
    loader = make_loader(TensorDataset(torch.arange(N)), CAP, world_size=1, rank=0, global_batch=G, num_workers=workers)
    train = state.loaders.wrap(loader, torch.device("cpu"), train=True, accum=accum)
    return elastic, state, accum, train


def _run_step(elastic: ElasticTraining, batches: Any, accum: Accumulator, fail: bool = False) -> list[int]:
    """One step's micro-batches; the step commits, or fails in its all-reduce."""
    seen: list[int] = []
    while True:
        (index,) = next(batches)
        seen += index.tolist()
        accum.after_backward()
        if accum.ready:
            break

    def step(optimizer: Any, model: Any, counted: bool) -> bool:
        if fail:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer")
        elastic.state.loaders.trained(accum.window)  # as TrainStep.step: the window's batches are trained
        accum.after_step()
        elastic.state.count_step()
        return True

    try:  # as Session.step runs TrainStep.step
        took = step(None, None, True)
    except RuntimeError as exc:
        elastic.step_failed(exc)
    else:
        elastic.step_done(took, None)  # type: ignore[arg-type]
    return seen


@pytest.mark.parametrize("workers", [0, 2])  # with workers, the loader's iterator is made again from the cursor
def test_a_dropped_step_is_trained_again_from_the_committed_cursor_with_the_new_share(workers: int) -> None:
    elastic, state, accum, train = _training(workers)
    assert elastic.start(0) == 0 and elastic.group.joined
    state.start_epoch(0)
    batches = iter(train)
    first = _run_step(elastic, batches, accum) + _run_step(elastic, batches, accum)
    assert accum.k == 2 and state.global_step == 2 and len(first) == 2 * G
    _run_step(elastic, batches, accum, fail=True)  # its batches were handed out; the step is dropped
    assert state.global_step == 2 and train.sampler.cursor == 2 * G  # back to the committed position
    assert (train.sampler.world_size, train.sampler.rank, accum.k) == (2, 1, 1)  # re-planned: 4 x 2 x 1
    rest = [i for (index,) in batches for i in index.tolist()]
    plan = plan_batches(G, 2, CAP)
    expected = rank_batches({"seed": 0, "epoch": 0, "cursor": 2 * G}, N, plan, rank=1)
    assert rest == [i for b in expected for i in b]
    assert state.loaders.epoch_done


def test_a_node_let_in_at_an_epochs_last_step_trains_the_next_epoch_with_the_new_shares() -> None:
    elastic, state, accum, train = _training()
    elastic.start(0)
    steps = N // G
    for epoch in range(2):
        state.start_epoch(epoch)
        batches = iter(train)
        handed = []
        for step in range(steps):
            if epoch == 0 and step == steps - 1:
                elastic.group.waiting = (2, 0)  # let in after epoch 0's last step
            handed += _run_step(elastic, batches, accum)
        assert next(batches, None) is None  # the epoch ran out (a new pass after the change has nothing left)
        if epoch == 0:
            assert sorted(handed) == list(range(N)) and elastic.changes == 2  # the join, then the admission
            assert state.loaders.finished and train.sampler.world_size == 2
        else:
            plan = plan_batches(G, 2, CAP)
            expected = rank_batches({"seed": 0, "epoch": 1, "cursor": 0}, N, plan, 0)
            assert handed == [i for b in expected[: len(handed) // CAP] for i in b] and len(handed) == N // 2
            assert state.epoch == 1 and elastic.changes == 2


def test_a_node_let_in_at_an_epochs_last_step_saves_that_epoch_then_trains_the_next_with_the_members() -> None:
    """The newcomer's side of the last test: handed the position after epoch 0's last batch, its pass of epoch
    0 has nothing left (the members' loops go on to that epoch's save, so must it), then epoch 1 is its share."""
    member, state, accum, train = _training()
    member.start(0)
    state.start_epoch(0)
    batches = iter(train)
    for _ in range(N // G):
        _run_step(member, batches, accum)
    comm = _Comm()
    comm.handed, comm.world_size, comm.rank = member.position.state_dict(), 2, 1
    assert comm.handed["samplers"][0]["cursor"] == N and not comm.handed["epoch_done"]  # not run out there yet
    joiner, state, accum, train = _training(comm=comm)
    epoch = joiner.start(0)
    assert (epoch, state.global_step, train.sampler.world_size) == (0, N // G, 2)
    state.start_epoch(epoch)
    assert list(train) == [] and state.loaders.finished  # epoch 0 is over here as it is on the members
    state.start_epoch(1)
    handed = [i for (index,) in train for i in index.tolist()]
    expected = rank_batches({"seed": 0, "epoch": 1, "cursor": 0}, N, plan_batches(G, 2, CAP), rank=1)
    assert handed == [i for b in expected for i in b] and len(handed) == N // 2


def test_a_loop_that_fetches_its_next_batch_before_the_step_is_refused_at_its_first_step() -> None:
    from lockstep.session.usage import SessionUsageError

    elastic, state, accum, train = _training()
    elastic.start(0)
    state.start_epoch(0)
    batches = iter(train)
    for _ in range(accum.window):  # the step's micro-batches
        next(batches)
        accum.after_backward()
    next(batches)  # the next step's first batch, fetched before this step
    state.loaders.trained(accum.window)
    with pytest.raises(SessionUsageError, match="fetch the next batch after session.step"):
        elastic.step_done(True, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options, named",
    [
        ({"strategy": "fsdp", "global_batch": 24}, "strategy='fsdp'"),
        ({"order": "torch"}, "order='torch'"),
        ({"global_batch": 24, "grad_compression": "fp16"}, "grad_compression='fp16'"),
        ({"global_batch": 24, "shard_optimizer": True}, "shard_optimizer=True"),
        ({}, "global_batch=None"),
    ],
)
def test_what_cannot_follow_the_membership_is_refused_in_one_line_before_any_group(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], named: str
) -> None:
    import lockstep
    from lockstep.errors import ConfigError

    monkeypatch.setenv("LOCKSTEP_NODES", "1:3")
    monkeypatch.setenv("LOCKSTEP_ELASTIC_STORE", "127.0.0.1:9")  # never reached: refused first
    with pytest.raises(ConfigError, match="--nodes 1:3") as info:
        lockstep.Session(**options)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_under_nodes_preemption_and_timings_are_off() -> None:
    from lockstep.session.config import SessionConfig
    from lockstep.session.elastic import options_under_nodes

    assert options_under_nodes(SessionConfig(global_batch=24), "") == SessionConfig(global_batch=24)  # fixed nodes
    config = options_under_nodes(SessionConfig(global_batch=24), "1:3")
    assert (config.preemption, config.timings_every, config.global_batch) == ("off", 0, 24)


def _elastic_ddp_step(sync_buffers: bool) -> tuple[list[str], list[float], list[float], str]:
    from datetime import timedelta

    from lockstep.comm.group import init_comm
    from lockstep.session.options import summary_line
    from lockstep.strategies.elastic import ElasticDDPStrategy

    comm = init_comm(timeout=30)
    strategy = ElasticDDPStrategy(comm, torch.device("cpu"), sync_buffers=sync_buffers, bucket_cap_mb=50)
    torch.manual_seed(0)
    model = strategy.setup_module(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    torch.manual_seed(1 + comm.rank)  # each rank its own batch: its own gradients and batch statistics
    model(torch.randn(8, 3)).sum().backward()
    strategy.sync_gradients(model)
    line = summary_line(
        world_size=2, strategy=strategy, precision="fp32", backend="gloo", timeout=timedelta(seconds=30), loaders=[]
    )
    out = (strategy.ignored, model[0].weight.grad.flatten().tolist(), model[1].running_mean.tolist(), line)
    comm.shutdown()
    return out


@pytest.mark.parametrize("sync_buffers", [True, False])
@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_elastic_ddp_averages_gradients_and_shares_buffers_as_ddp_does(sync_buffers: bool) -> None:
    from support.dist import run_distributed

    (ignored, grad0, mean0, line), (_, grad1, mean1, _) = run_distributed(_elastic_ddp_step, 2, sync_buffers)
    assert grad0 == grad1  # averaged over both ranks
    assert (mean0 == mean1) is sync_buffers  # rank 0's running statistics, as DDP broadcasts them
    # a wrapper's tuning has nothing to tune: accepted, left unused, and said so once
    assert ignored == ["bucket_cap_mb"] and "bucket_cap_mb unused under --nodes" in line


def test_the_session_side_is_the_groups_handover_and_a_join_by_a_collective_first_is_refused() -> None:
    from lockstep.comm.elastic import Objects

    elastic, _, _, _ = _training()
    model = torch.nn.Linear(2, 1)
    elastic.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.Identity())
    elastic.start(0)
    assert elastic.group.handover is elastic  # passed to the join, read at every change
    assert list(elastic.objects()) == ["position", "model", "optimizer", "precision"]
    assert elastic.plan(2) == "micro-batch 4 × accumulation 1"  # G 8 over 2 ranks, at most 4 a micro-batch
    assert elastic.restore() is None  # no session.load yet: no checkpoint is read
    comm = _Comm()
    comm.join(Objects())  # a collective on the comm joined first, handing nothing over
    late = ElasticTraining(comm, Accumulator(1), TrainState(comm))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="before the session joined the job"):
        late.start(0)
