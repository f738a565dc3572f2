"""Where this process is: the launch environment read into one frozen :class:`World`.

It reads the variables of ``lockstep run``, ``torchrun``, ``srun``, MPI and ``horovodrun`` (each names
rank and sizes its own way) and refuses a bad environment before any process group exists.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lockstep import _cluster
from lockstep.errors import WorldError

__all__ = [
    "World",
    "WorldView",
    "WorldError",
    "Settings",
    "detect_world",
    "read_settings",
    "withhold_secret",
    "environment",
    "export_environment",
    "first_slurm_host",
    "usable_cores",
    "process_alive",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (Slurm, taskset, containers), where the
    platform has one; else every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The one value kept outside os.environ: the job's secret, once a worker took it out of its environment
# (withhold_secret, before the script runs) so that the processes the script starts do not inherit it.
_WITHHELD: dict[str, str] = {}


@dataclass(frozen=True)
class World:
    """The position of this process in the job, as the launcher described it.

    Args:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank on this node, ``0 <= local_rank < local_world_size``.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, ``0 <= node_rank < num_nodes``.
        num_nodes: number of nodes in the job.
        master_addr: host of the rendezvous store (rank 0's node).
        master_port: port of the rendezvous store, or ``None`` when not set.
        source: which launcher described the job (``torchrun``, ``slurm``, ``openmpi``, ``single``, ...).
        extra: free-form extra values (not compared, not shown).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    source: str = "single"
    extra: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = f" (from {self.source} environment)"
        if self.world_size < 1:
            raise WorldError(f"world_size must be >= 1, got {self.world_size}{where}")
        if not 0 <= self.rank < self.world_size:
            raise WorldError(
                f"rank {self.rank} is out of range for world_size {self.world_size}: "
                f"ranks run from 0 to {self.world_size - 1}{where}. "
                "Check RANK / WORLD_SIZE (or SLURM_PROCID / SLURM_NTASKS)."
            )
        if self.local_world_size < 1 or self.local_world_size > self.world_size:
            raise WorldError(
                f"local_world_size {self.local_world_size} must be between 1 and world_size {self.world_size}{where}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise WorldError(
                f"local_rank {self.local_rank} is out of range for local_world_size "
                f"{self.local_world_size}{where}. Check LOCAL_RANK / LOCAL_WORLD_SIZE."
            )
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise WorldError(f"node_rank {self.node_rank} is out of range for num_nodes {self.num_nodes}{where}")
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise WorldError(f"master port {self.master_port} is not a valid port{where}")

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in the job."""
        return self.world_size > 1

    @property
    def device(self) -> Any:
        """The device this rank should use: ``cuda:local_rank`` (round-robin over fewer GPUs), else cpu."""
        import torch  # imported here: reading the environment must stay cheap

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")


class WorldView:
    """``rank``, ``local_rank``, ``world_size`` and ``is_main`` of an object's ``world``, defined once.

    The job's :class:`~lockstep.comm.Comm` and :class:`~lockstep.session.Session` inherit them.
    """

    @property
    def rank(self: _HasWorld) -> int:
        """Global rank of this process."""
        return self.world.rank

    @property
    def local_rank(self: _HasWorld) -> int:
        """Rank of this process on its node."""
        return self.world.local_rank

    @property
    def world_size(self: _HasWorld) -> int:
        """Number of processes in the job."""
        return self.world.world_size

    @property
    def is_main(self: _HasWorld) -> bool:
        """True on rank 0."""
        return self.world.is_main


class _HasWorld(Protocol):
    """What WorldView reads: a ``world``, as an attribute (Comm) or a property (Session)."""

    @property
    def world(self) -> World: ...


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a Slurm node list such as ``gpu[003-005,010],cpu01``.

    Args:
        nodelist: the value of ``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST``.

    Raises:
        WorldError: an empty or unreadable list.
    """
    if not nodelist.strip():
        raise WorldError("SLURM_JOB_NODELIST is empty")
    return _cluster.expand_hostlist(nodelist)[0]


def _from_torchrun(env: Mapping[str, str]) -> World:
    world_size = _cluster.read_int(env, "WORLD_SIZE", 1)
    rank = _cluster.read_int(env, "RANK")
    # without LOCAL_RANK/LOCAL_WORLD_SIZE (Kubeflow's PyTorchJob: one process per pod) each rank is a node
    local_world = _cluster.read_int(env, "LOCAL_WORLD_SIZE", world_size if "LOCAL_RANK" in env else 1)
    node_rank = _cluster.read_int(env, "GROUP_RANK", _cluster.read_int(env, "NODE_RANK", rank // max(1, local_world)))
    num_nodes = max(1, -(-world_size // max(1, local_world)))
    port = _cluster.read_int(env, "MASTER_PORT", -1)
    return World(
        rank=rank,
        local_rank=_cluster.read_int(env, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=None if port == -1 else port,
        source=env.get("LOCKSTEP_SOURCE", "torchrun"),
    )


@dataclass(frozen=True)
class Settings:
    """What the launcher and the user told this process besides its place in the job (:func:`read_settings`).

    The layers above take these values instead of reading the environment. Each is ``""`` when unset.

    Args:
        timeout: ``$LOCKSTEP_TIMEOUT`` as written (seconds; ``lockstep run --timeout``).
        grace: ``$LOCKSTEP_GRACE`` as written (seconds a stop signal may wait for agreement).
        init_method: ``$LOCKSTEP_INIT_METHOD``: the rendezvous URL ``lockstep run`` chose.
        restart_count: ``$TORCHELASTIC_RESTART_COUNT`` (``None`` outside the elastic agent).
        run_id: ``$TORCHELASTIC_RUN_ID``: the elastic run's id.
        error_file: ``$TORCHELASTIC_ERROR_FILE``: where a failing worker records its exception.
        agent_store: the elastic agent shares its store (``$MASTER_ADDR:$MASTER_PORT``) with the workers.
        master_addr: ``$MASTER_ADDR`` as written.
        master_port: ``$MASTER_PORT`` as written.
        secret: ``$LOCKSTEP_SECRET``: the job's secret that signs lockstep's values in the store (in a
            worker of ``lockstep run``, the value :func:`withhold_secret` took out of the environment).
        gloo_ifname: ``$GLOO_SOCKET_IFNAME``: the interface gloo uses.
        nccl_ifname: ``$NCCL_SOCKET_IFNAME``: the interface nccl uses.
        loglevel: ``$LOGLEVEL`` (torchrun's: show the elastic agent's own logging).
        launched: ``$RANK`` is set: this process is a worker, not a command that should start workers.
        launcher_pid: ``$LOCKSTEP_LAUNCHER_PID``: the ``lockstep run`` launcher's pid, or ``None``.
        horovod_rendezvous: the launcher serves Horovod's rendezvous for this very job.
        postmortem_dir: ``$LOCKSTEP_POSTMORTEM_DIR``: where each rank keeps its collective record.
        elastic_nodes: ``$LOCKSTEP_NODES``: ``MIN:MAX`` of ``lockstep run --nodes``.
        elastic_store: ``$LOCKSTEP_ELASTIC_STORE``: ``HOST:PORT`` of the membership store.
        node_id: ``$LOCKSTEP_NODE_ID``: the id of this worker's node (its launcher's).
        terminal: ``$LOCKSTEP_TERMINAL``: ``COLUMNSxLINES`` of the launcher's terminal, set when the
            launcher's stderr is one (a worker's stderr is a log file the launcher relays), else empty.
        cache: ``$LOCKSTEP_CACHE``: the folder of lockstep's local caches (sharded datasets' shards);
            empty: ``~/.cache/lockstep``.
    """

    timeout: str = ""
    grace: str = ""
    init_method: str = ""
    restart_count: int | None = None
    run_id: str = ""
    error_file: str = ""
    agent_store: bool = False
    master_addr: str = ""
    master_port: str = ""
    secret: str = field(default="", repr=False)
    gloo_ifname: str = ""
    nccl_ifname: str = ""
    loglevel: str = ""
    launched: bool = False
    launcher_pid: int | None = None
    horovod_rendezvous: bool = False
    postmortem_dir: str = ""
    elastic_nodes: str = ""
    elastic_store: str = ""
    node_id: str = ""
    terminal: str = ""
    cache: str = ""


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read :class:`Settings` from ``environ``.

    Args:
        environ: the variables to read; ``os.environ`` when omitted.
    """
    env = os.environ if environ is None else environ
    count = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    launcher = env.get("LOCKSTEP_LAUNCHER_PID", "").strip()
    return Settings(
        timeout=env.get("LOCKSTEP_TIMEOUT", "").strip(),
        grace=env.get("LOCKSTEP_GRACE", "").strip(),
        init_method=env.get("LOCKSTEP_INIT_METHOD", ""),
        restart_count=int(count) if count.isdigit() else None,
        run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        error_file=env.get("TORCHELASTIC_ERROR_FILE", ""),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        master_addr=env.get("MASTER_ADDR", ""),
        master_port=env.get("MASTER_PORT", ""),
        secret=env.get("LOCKSTEP_SECRET", _WITHHELD.get("LOCKSTEP_SECRET", "") if environ is None else ""),
        gloo_ifname=env.get("GLOO_SOCKET_IFNAME", ""),
        nccl_ifname=env.get("NCCL_SOCKET_IFNAME", ""),
        loglevel=env.get("LOGLEVEL", ""),
        launched="RANK" in env,
        launcher_pid=int(launcher) if launcher.isdigit() else None,
        # a launcher served Horovod's rendezvous for this very job (not inherited from an outer one)
        horovod_rendezvous="HOROVOD_GLOO_RENDEZVOUS_PORT" in env
        and "RANK" in env
        and (env.get("HOROVOD_RANK"), env.get("HOROVOD_SIZE")) == (env.get("RANK"), env.get("WORLD_SIZE")),
        postmortem_dir=env.get("LOCKSTEP_POSTMORTEM_DIR", ""),
        elastic_nodes=env.get("LOCKSTEP_NODES", "").strip(),
        elastic_store=env.get("LOCKSTEP_ELASTIC_STORE", "").strip(),
        node_id=env.get("LOCKSTEP_NODE_ID", "").strip(),
        terminal=env.get("LOCKSTEP_TERMINAL", "").strip(),
        cache=env.get("LOCKSTEP_CACHE", "").strip(),
    )


def withhold_secret() -> None:
    """Take ``$LOCKSTEP_SECRET`` out of this process's environment; :func:`read_settings` keeps returning it.

    Each worker of ``lockstep run`` calls it before the training script runs
    (:mod:`lockstep.launch.bootstrap`): the processes the script starts no longer inherit the job's
    secret, while every later process group of this process still signs with it. A secret set in the
    environment again afterwards is read (and used) instead.
    """
    value = os.environ.pop("LOCKSTEP_SECRET", None)
    if value is not None:
        _WITHHELD["LOCKSTEP_SECRET"] = value


def environment() -> Mapping[str, str]:
    """A read-only view of this process's environment, for readers that take a mapping."""
    from types import MappingProxyType

    return MappingProxyType(os.environ)


def export_environment(values: Mapping[str, str]) -> None:
    """Set variables in this process's environment, for a library that reads them itself (Horovod's ``hvd.init()``).

    Args:
        values: variable names and their values.
    """
    os.environ.update(values)


def detect_world(environ: Mapping[str, str] | None = None) -> World:
    """Read the launch environment into a validated :class:`World`.

    Precedence: ``RANK`` (torchrun, ``lockstep run``, ``spawn``, Kubeflow), a task of ``srun`` (a
    Slurm allocation outside ``srun`` is one process, with a warning), OpenMPI, MPICH / Intel MPI,
    horovodrun, then one process. Without a port from the engine, the ranks derive one from the job id.

    Args:
        environ: the variables to read; ``os.environ`` when omitted.

    Raises:
        WorldError: when values are missing, not integers or inconsistent.

    Example::

        >>> world = detect_world({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
        >>> world.rank, world.world_size, world.local_world_size, world.source
        (1, 2, 2, 'torchrun')
    """
    env = os.environ if environ is None else environ
    if "RANK" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and _cluster.read_int(env, "SLURM_NTASKS", 1) > 1:
        if _cluster.in_slurm_step(env):
            return World(**_cluster.from_slurm(env))
        warnings.warn(
            f"lockstep: running inside a Slurm allocation of {env['SLURM_NTASKS']} tasks but not started by "
            "srun: this is one process. Start the ranks with `srun python script.py` or "
            "`srun --ntasks-per-node=1 lockstep run --nproc N script.py`.",
            stacklevel=2,
        )
        return World()
    for marker, reader in (
        ("OMPI_COMM_WORLD_RANK", _cluster.from_openmpi),
        ("PMI_RANK", _cluster.from_pmi),
        ("HOROVOD_RANK", _cluster.from_horovod),
    ):
        if marker in env:
            return World(**reader(env))
    return World()
