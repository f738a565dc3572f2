"""The inputs of ``lockstep run``, checked before anything starts: :class:`LaunchSpec` and helpers.

Everything here is cheap (no torch import unless ``--nproc auto|gpu|cpu`` asks for a device count),
so bad flags are refused at once with a :class:`~lockstep.errors.ConfigError`.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep.env import usable_cores
from lockstep.errors import DEFAULT_GRACE, ConfigError

__all__ = [
    "LaunchSpec",
    "parse_master",
    "parse_nodes",
    "exposure_warning",
    "oversubscription_warning",
    "resolve_nproc",
    "check_script",
    "slurm_defaults",
    "check_seconds",
    "import_torch_quietly",
    "read_secret",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_GRACE",
    "PREFIX",
    "OVERSUBSCRIBE_PER_CORE",
]

DEFAULT_JOIN_TIMEOUT = 900.0
PREFIX = "lockstep run: "
"""How every line of the launcher's own starts."""
OVERSUBSCRIBE_PER_CORE = 4
"""Processes per CPU core past which ``lockstep run`` warns on a machine without GPUs."""


@dataclass(frozen=True)
class LaunchSpec:
    """What to launch and how; validated at construction.

    Args:
        target: the script path, or a module name when ``module`` is true.
        args: the script's own arguments.
        module: run ``target`` like ``python -m target``.
        nproc: processes on this node.
        nodes: number of nodes in the job; with ``max_nodes``, the fewest it runs on.
        max_nodes: the most nodes of a job whose nodes may leave and join while it runs
            (``--nodes MIN:MAX``); ``None`` for a fixed number.
        node_rank: index of this node, 0 for the node that hosts the store.
        master: ``HOST:PORT`` of node 0's store; required for more than one node.
        max_restarts: how often the whole group is restarted after a failure.
        join_timeout: seconds to wait for every node to join.
        rank0_only: show only rank 0's output (every rank's output still goes to the log files).
        prefix: start each shown line with ``[rankN]: ``; without it (with ``rank0_only``) rank 0
            writes straight to this terminal, so progress bars draw as in a single process.
        local_rank_arg: pass ``--local_rank=N`` to the script (old ``torch.distributed.launch`` style).
        log_dir: keep every rank's stdout/stderr under this folder (a temporary one otherwise).
        verbose: keep torch's own agent logging.
        timeout: seconds a collective may wait for a missing rank (exported as
            ``LOCKSTEP_TIMEOUT``; the session's default is 10 minutes).
        grace: seconds the workers get to save and exit after a stop signal before SIGKILL.
        secret: the job's secret (the content of ``--secret-file``), which signs lockstep's values
            in the workers' store; a random one per job when empty. Every node must use the same.
        label: the command that starts each of the launcher's own lines (``lockstep train`` when
            that command launched its workers).
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int = 1
    nodes: int = 1
    max_nodes: int | None = None
    node_rank: int = 0
    master: str | None = None
    max_restarts: int = 0
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    rank0_only: bool = False
    prefix: bool = True
    local_rank_arg: bool = False
    log_dir: str | None = None
    verbose: bool = False
    timeout: float | None = None
    grace: float = DEFAULT_GRACE
    secret: str = field(default="", repr=False)
    label: str = "lockstep run"

    @property
    def says(self) -> str:
        """How each of the launcher's own lines starts: ``lockstep run: ``."""
        return f"{self.label}: "

    def __post_init__(self) -> None:
        check_nproc(self.nproc)
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1, got {self.nodes}")
        if self.max_nodes is not None:
            self._check_elastic()
        elif not 0 <= self.node_rank < self.nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nodes {self.nodes} (use 0 to {self.nodes - 1})"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        check_seconds("--join-timeout", self.join_timeout)
        if self.timeout is not None:
            check_seconds("--timeout", self.timeout)
        check_seconds("--grace", self.grace, zero_ok=True)
        if (self.nodes > 1 or self.max_nodes is not None) and self.master is None:
            raise ConfigError(
                f"--nodes {self.nodes} needs --master HOST:PORT (node 0's address and a "
                "free port, the same on every node)"
            )
        if self.master is not None and parse_master(self.master)[1] == 0:
            raise ConfigError(
                "--master needs a real port, the same on every node; on one node, leave "
                "out --master and a free port is picked"
            )
        check_script(self.target, self.module)

    def _check_elastic(self) -> None:
        if not 1 <= self.nodes <= int(self.max_nodes or 0):
            raise ConfigError(f"--nodes {self.nodes}:{self.max_nodes}: MIN must be at least 1 and at most MAX")
        if not self.secret:
            raise ConfigError(
                f"--nodes {self.nodes}:{self.max_nodes} needs --secret-file (the same content on "
                "every node): the nodes meet in a store on the network, whose values the secret signs"
            )

    @property
    def elastic(self) -> bool:
        """True when nodes may leave and join while the job runs (``--nodes MIN:MAX``)."""
        return self.max_nodes is not None

    @property
    def relayed(self) -> bool:
        """True when the ranks' output reaches this terminal through the relay, False when rank 0
        inherits the terminal (``rank0_only`` without prefixes)."""
        return self.prefix or not self.rank0_only


_MAX_SECONDS = 7 * 24 * 3600.0  # a week: longer is a typo, and torch's timers overflow far beyond


def check_seconds(flag: str, value: float, zero_ok: bool = False) -> None:
    """Refuse NaN, infinity, negative (or zero) and absurdly long durations, naming the flag.

    Args:
        flag: the flag, for the message (``"--timeout"``).
        value: the duration in seconds.
        zero_ok: accept 0.

    Raises:
        ConfigError: one line naming the flag and the accepted range.
    """
    low_ok = value >= 0 if zero_ok else value > 0
    if not (low_ok and math.isfinite(value) and value <= _MAX_SECONDS):
        least = "0 or more" if zero_ok else "a positive number of seconds"
        raise ConfigError(f"{flag} must be {least}, at most {_MAX_SECONDS:g} (a week), got {value:g}")


def read_secret(path: str) -> str:
    """The job's secret from ``--secret-file`` (surrounding whitespace dropped).

    Args:
        path: the file; every node of the job must read the same content.

    Raises:
        ConfigError: the file cannot be read or holds nothing.
    """
    try:
        with open(path, encoding="utf-8") as fp:
            secret = fp.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--secret-file {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    if not secret:
        raise ConfigError(f"--secret-file {path} is empty; put a random string in it, e.g. `openssl rand -hex 32`")
    return secret


def parse_nodes(text: str) -> tuple[int, int | None]:
    """Read ``--nodes``: ``N`` (a fixed number) or ``MIN:MAX`` (torchrun's ``--nnodes`` syntax).

    Args:
        text: the flag's value.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if match is None:
        raise ConfigError(f"--nodes {text!r} must be a number N or a range MIN:MAX, for example 1:3")
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


def parse_master(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[IPv6]:PORT`` for IPv6) into host and port.

    Args:
        text: the ``--master`` value.
    """
    match = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
    if match is None:
        raise ConfigError(f"--master {text!r} must look like HOST:PORT, for example 10.0.0.1:29400")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ConfigError(f"--master port {port} is not a valid port (0 to 65535)")
    return host, port


def exposure_warning(host: str, prefix: str = PREFIX) -> str | None:
    """Return a warning when the store would be reachable from everywhere, else ``None``.

    The rendezvous store has no authentication: anyone who reaches it can join or disturb the job.

    Args:
        host: the ``--master`` host.
        prefix: how the line starts (:attr:`LaunchSpec.says`).
    """
    if host in ("0.0.0.0", "::", "*", ""):
        what = f"the wildcard address {host!r}"
    else:
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            try:
                addr = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
            except (OSError, ValueError, IndexError):
                return None  # unresolvable: the launch itself will say so
        if not addr.is_global:  # private, loopback, link-local, carrier-grade NAT (100.64/10)...
            return None
        what = f"the public address {host}"
    return (
        f"{prefix}warning: --master names {what}; the rendezvous store listens there and anyone who "
        "reaches it can disturb the job (lockstep's own values are signed with the job's secret, "
        "torch's are not). Use a private interface."
    )


def oversubscription_warning(
    nproc: int, cpus: int | None = None, gpus: int | None = None, prefix: str = PREFIX
) -> str | None:
    """A warning when ``nproc`` processes are far more than this machine can run side by side.

    With GPUs, more processes than GPUs share them (and nccl refuses two ranks on one GPU); without,
    more than :data:`OVERSUBSCRIBE_PER_CORE` processes per CPU core mostly wait for each other.

    Args:
        nproc: processes per node.
        cpus: CPU cores (default: those this process may use).
        gpus: visible GPUs (default: ``torch.cuda.device_count()``, 0 without CUDA).
        prefix: how the line starts (:attr:`LaunchSpec.says`).
    """
    if cpus is None:
        cpus = usable_cores()
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 0 and nproc > gpus:
        return (
            f"{prefix}warning: {nproc} processes on this node but {gpus} GPU{'s' if gpus > 1 else ''}: "
            "ranks will share GPUs (nccl refuses two ranks on one GPU); use --nproc gpu for one per GPU"
        )
    if gpus == 0 and nproc > OVERSUBSCRIBE_PER_CORE * cpus:
        return (
            f"{prefix}warning: {nproc} processes on {cpus} CPU core{'s' if cpus > 1 else ''}: they will mostly "
            "wait for each other (and each needs its own memory); use --nproc cpu for one per core"
        )
    return None


def check_script(target: str, module: bool) -> None:
    """Refuse a script that is not there (a module is found by the workers' own import).

    Args:
        target: the script's path, or the module's name with ``module``.
        module: ``target`` is run with ``-m``.

    Raises:
        ConfigError: no such file.
    """
    if not module and not os.path.isfile(target):
        raise ConfigError(f"script {target!r} does not exist (use -m to run a module)")


def check_nproc(count: int) -> int:
    """``count`` as a number of processes per node; refused when it is under 1."""
    if count < 1:
        raise ConfigError(f"--nproc must be at least 1, got {count}")
    return count


def resolve_nproc(value: str | int) -> int:
    """Turn ``--nproc`` (``N``, ``auto``, ``gpu`` or ``cpu``, as torchrun means them) into a count.

    Args:
        value: the flag's value.
    """
    text = str(value).strip()
    if text.isdigit():
        return check_nproc(int(text))  # refused here, before torch is imported for a device count
    if text not in ("auto", "gpu", "cpu"):
        raise ConfigError(f"--nproc {text!r} is not a number or one of auto, gpu, cpu")
    import_torch_quietly()
    from torch.distributed.run import determine_local_world_size  # torch only when asked

    try:
        return int(determine_local_world_size(text))
    except ValueError as exc:
        raise ConfigError(f"--nproc {text}: {exc} Use --nproc cpu or a number.") from None


def slurm_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """``nodes``, ``node_rank``, ``master`` (and ``nproc`` where the engine says it) of a job whose
    engine starts one ``lockstep run`` per node: Slurm (``srun --ntasks-per-node=1``; the port is
    ``$MASTER_PORT`` or derived from the job id, the same on every node), Kubeflow (``PET_*``),
    SkyPilot (``SKYPILOT_*``). See :func:`lockstep._cluster.launch_defaults`.

    Args:
        env: the environment to read (:func:`lockstep.env.environment`).
    """
    from lockstep._cluster import launch_defaults

    try:
        return launch_defaults(env)
    except ConfigError:
        return {}  # a malformed layout: the flags (or their defaults) decide


def import_torch_quietly(verbose: bool = False) -> None:
    """Import torch in the launcher with its C++ logging limited to fatal errors.

    torch's C++ side prints store connection retries with native stack traces; the launcher
    explains those failures itself. The setting is read once, when torch loads, and is removed from
    the environment again so that the workers keep their normal C++ logging.

    Args:
        verbose: keep torch's C++ logging as configured.
    """
    if verbose or "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
