"""The ``horovod`` strategy: gradients averaged by Horovod's ``DistributedOptimizer`` (gloo or NCCL).

Horovod is optional (``make horovod`` builds it); without it this strategy is refused with the reason. A script
runs under ``horovodrun -np 2 --gloo python train.py`` and under ``lockstep run --nproc 2 train.py``.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep._cluster import horovod_variables
from lockstep.comm.group import Comm
from lockstep.env import export_environment, read_settings
from lockstep.errors import ConfigError
from lockstep.strategies.base import Strategy, broadcast_module_state, unwrap_module
from lockstep.strategies.torch_internals import queue_backward_callback

__all__ = [
    "HorovodStrategy",
    "loopback_rendezvous",
    "HorovodGradients",
    "HorovodUnavailableError",
    "horovod_unavailable",
    "import_horovod",
    "init_horovod",
    "apply_horovod_optimizer",
]

NOT_INSTALLED = "horovod not installed: make horovod"


class HorovodUnavailableError(ConfigError):
    """Horovod is not installed, or installed but does not load (built for another torch)."""


@functools.cache
def horovod_unavailable() -> str | None:
    """Why ``import horovod.torch`` fails here, or ``None`` when it works."""
    try:
        import horovod.torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "horovod":
            return f"horovod does not load (it needs the module {exc.name}): make horovod"
        return NOT_INSTALLED
    except Exception as exc:  # an extension built for another torch fails with ImportError or OSError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"horovod does not load ({first[:200]}): make horovod rebuilds it for this torch"
    return None


def import_horovod() -> Any:
    """``horovod.torch``, or a :class:`HorovodUnavailableError` that says how to get it."""
    reason = horovod_unavailable()
    if reason is not None:
        raise HorovodUnavailableError(f"strategy horovod: {reason}")
    import horovod.torch as hvd

    return hvd


def init_horovod(comm: Comm) -> Any:
    """Initialise Horovod for the job ``comm`` belongs to and check that both agree on the ranks."""
    hvd = import_horovod()
    world = comm.world
    if not hvd.is_initialized():
        if world.world_size > 1 and world.source != "horovodrun" and not read_settings().horovod_rendezvous:
            _init_with_own_rendezvous(hvd, comm)
        else:
            hvd.init()
    if (hvd.size(), hvd.rank()) != (world.world_size, world.rank):
        raise ConfigError(
            f"strategy horovod: Horovod sees rank {hvd.rank()} of {hvd.size()} but the launcher started rank "
            f"{world.rank} of {world.world_size}; start the job with `horovodrun -np {world.world_size} --gloo "
            "python train.py` or `lockstep run --nproc N train.py`, not both"
        )
    return hvd


def _init_with_own_rendezvous(hvd: Any, comm: Comm) -> None:
    """Start Horovod's rendezvous server on rank 0 and ``hvd.init()`` every rank against it."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    world = comm.world
    hosts = comm.all_gather_object(socket.gethostname())
    if len(set(hosts)) > 1:
        raise ConfigError(
            f"strategy horovod: this job spans {len(set(hosts))} hosts, and Horovod's gloo needs the network "
            f"interface that joins them, which horovodrun finds: start it with `horovodrun -np {world.world_size} "
            "-H host1:N,host2:N --gloo python train.py`"
        )
    plan = get_host_assignments([HostInfo(hosts[0], world.world_size)], world.world_size)
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(loopback_rendezvous(plan)) if world.is_main else 0
        port = comm.broadcast_object(port, 0)
        slot = plan[world.rank]
        # what horovodrun exports to each rank it starts (horovod.runner.gloo_run), for one host
        export_environment(
            {
                **horovod_variables(
                    port=port,
                    hostname=slot.hostname,
                    size=slot.size,
                    local_size=slot.local_size,
                    cross_size=slot.cross_size,
                ),
                "HOROVOD_RANK": str(slot.rank),
                "HOROVOD_LOCAL_RANK": str(slot.local_rank),
                "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            }
        )
        hvd.init()
        comm.barrier()  # the server is only needed until every rank has joined


@contextlib.contextmanager
def loopback_rendezvous(plan: list[Any]) -> Iterator[int]:
    """Serve Horovod's rendezvous on a free loopback port (Horovod's own listens on every interface); yield it."""
    import threading

    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer(("127.0.0.1", 0), RendezvousHandler, 0)
    server.init(plan)  # the scopes' sizes; Horovod clears them once every rank joined, ready for a restart
    thread = threading.Thread(target=server.serve_forever, name="horovod-rendezvous", daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# Horovod waits for its all-reduces inside optimizer.step(), but lockstep checks the gradients for non-finite
# values, unscales and clips them first, which must see the averaged gradients: the wait moves to the end of each
# backward outside no_sync (a callback on the autograd engine, as DDP does), and step runs inside
# skip_synchronize(), Horovod's documented pattern for clipping.
class HorovodGradients:
    """A ``hvd.DistributedOptimizer`` whose gradients are averaged when a step's last backward ends."""

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        self.optimizer, self.model = optimizer, model
        self.local = False  # inside no_sync: gradients stay local
        self.pending = False  # gradients were accumulated since they were last averaged
        self._queued = False
        self._class: Any = type(optimizer)  # the class Horovod derived from the user's optimizer class
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._accumulated)
        optimizer.step, optimizer.zero_grad = self._step, self._zero_grad

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (the accumulation's first micro-steps)."""
        self.local = True
        try:
            yield
        finally:
            self.local = False

    def synchronize(self) -> None:
        """Wait for the all-reduces (starting those Horovod held back) and put the averages in ``.grad``."""
        self.pending = False
        self.optimizer.synchronize()

    def _accumulated(self, param: torch.Tensor) -> None:
        self.pending = True
        if not self._queued:
            self._queued = True
            queue_backward_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._queued = False
        if not self.local:
            self.synchronize()

    def _step(self, closure: Any = None) -> Any:
        if self.pending:  # stepped inside no_sync: average now
            self.synchronize()
        with self.optimizer.skip_synchronize():
            return self._class.step(self.optimizer, closure)

    def _zero_grad(self, set_to_none: bool = True) -> None:
        if self.pending:
            raise ConfigError(
                "optimizer.zero_grad() was called between backward and step under strategy horovod, "
                "while gradients were only accumulated locally; call it after optimizer.step()"
            )
        self._class.__mro__[1].zero_grad(self.optimizer, set_to_none=set_to_none)  # the user's class's


# A fresh optimizer state is not broadcast: Horovod would create it with a step on zero gradients, and weight
# decay and Adam's step count would then differ from a run without Horovod.
def apply_horovod_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1
) -> HorovodGradients:
    """Turn ``optimizer`` into a ``hvd.DistributedOptimizer`` over ``model``'s named parameters."""
    hvd = import_horovod()
    had_state = any(len(s) > 0 for s in optimizer.state.values())
    wrapped = hvd.DistributedOptimizer(
        optimizer, named_parameters=unwrap_module(model).named_parameters(), backward_passes_per_step=accumulate
    )
    if had_state:
        wrapped.load_state_dict(optimizer.state_dict())
        hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    return HorovodGradients(wrapped, model)


class HorovodStrategy(Strategy):
    """Horovod's data parallelism: ``hvd.init()``, rank 0's weights, ``hvd.DistributedOptimizer``.

    Args:
        comm: the job's collectives.
        device: this rank's device (``cuda:<local rank>`` with GPUs, as Horovod wants it).
        **options: ``sync_bn`` (GPU only, as everywhere).

    Raises:
        HorovodUnavailableError: Horovod is missing or does not load.
        ConfigError: a job over several hosts not started by ``horovodrun``, or Horovod sees another world than
            the launcher described.
    """

    name: ClassVar[str] = "horovod"
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False}

    def __init__(self, comm: Comm, device: torch.device, **options: Any) -> None:
        super().__init__(comm, device, **options)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.hvd = init_horovod(comm)
        self._gradients: list[HorovodGradients] = []

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1
    ) -> torch.optim.Optimizer:
        if self.comm.world_size == 1:
            return optimizer  # nothing to average with one process
        gradients = apply_horovod_optimizer(optimizer, model, accumulate)
        self._gradients.append(gradients)
        wrapped: torch.optim.Optimizer = gradients.optimizer
        return wrapped

    def eval_context(self, model: nn.Module) -> AbstractContextManager[Any]:
        # Horovod averages gradients only, so BatchNorm statistics drift apart between ranks:
        # every rank evaluates with rank 0's (the ones a checkpoint keeps), as under ddp
        broadcast_module_state(self.comm, model, parameters=False)
        return contextlib.nullcontext()

    def no_backward_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        for gradients in self._gradients:
            if gradients.model is model:
                stack.enter_context(gradients.no_sync())
        return stack
