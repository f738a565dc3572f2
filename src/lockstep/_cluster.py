"""How each scheduler and MPI names a job's layout, read from a mapping of environment variables.

Pure functions (no process environment, no torch): :mod:`lockstep.env` builds its
:class:`~lockstep.env.World` from what they return; ``lockstep run`` takes its node layout from
:func:`launch_defaults`. The engines' variables, as they document them:

* Slurm (``srun``): ``SLURM_PROCID``/``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``; the step's
  ``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``), ``SLURM_STEP_NODELIST``
  (``node[1-3]-ib``); a batch script outside ``srun`` has no ``SLURM_STEP_ID`` (or the batch step's).
* OpenMPI: ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``; ``OMPI_COMM_WORLD_NODE_RANK`` is the rank
  on its node, not the node's index.
* MPICH / Intel MPI (hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
* horovodrun: ``HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``, ``HOROVOD_CROSS_RANK`` (the node's index).
* Kubeflow: ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR/PORT``.
* SkyPilot: ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS`` (head first), ``SKYPILOT_NUM_NODES``,
  ``SKYPILOT_NUM_GPUS_PER_NODE``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from typing import Any

from lockstep.errors import WorldError

__all__ = [
    "read_int",
    "expand_hostlist",
    "expand_tasks_per_node",
    "derived_port",
    "DEFAULT_PORT",
    "in_slurm_step",
    "from_slurm",
    "from_openmpi",
    "from_pmi",
    "from_horovod",
    "launch_defaults",
    "horovod_variables",
    "horovod_rank_variables",
]

DEFAULT_PORT = 29500
"""The port of the rendezvous store when the engine gives none and no job id exists (torchrun's)."""
_BATCH_STEP_IDS = {"4294967294", "batch"}  # SLURM_BATCH_SCRIPT: the batch script's own step


def read_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """The integer in ``env[name]``; ``default`` when unset (``None``: required); else :class:`WorldError`."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise WorldError(f"environment variable {name} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorldError(f"environment variable {name}={raw!r} is not an integer") from None


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, dash, hi = item.partition("-")
        if not dash:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise WorldError(f"cannot read the Slurm host range {item!r}")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a Slurm host list (``gpu[003-005,010],cpu01``, ``rack[0-1]_blade[0-1]``), in order."""
    hosts: list[str] = []
    for part in _split_top(hostlist):
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            if "[" in part or "]" in part:
                raise WorldError(f"cannot read the Slurm host list {hostlist!r}")
            hosts.append(part)
            continue
        head, tail = part[: match.start()], part[match.end() :]
        hosts += [h for value in _expand_range(match.group(1)) for h in expand_hostlist(head + value + tail)]
    if not hosts:
        raise WorldError("the Slurm node list is empty")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Tasks on each node from Slurm's compressed form: ``2(x3),1`` is ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise WorldError(f"cannot read Slurm's tasks per node {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def derived_port(job_id: str) -> int:
    """A port in 20000-39999 that every rank and node of the job derives alike from its job id."""
    value = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return 20000 + value % 20000


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside a task that ``srun`` started (not the batch script of ``sbatch``, not ``salloc``'s shell)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    return "SLURM_PROCID" in env and step != "" and step not in _BATCH_STEP_IDS


def _port(env: Mapping[str, str], job_id: str | None) -> int:
    if env.get("MASTER_PORT"):
        return read_int(env, "MASTER_PORT")
    return derived_port(job_id) if job_id else DEFAULT_PORT


def _master_addr(env: Mapping[str, str], default: str | None, num_nodes: int, how: str) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if default is not None:
        return default
    if num_nodes > 1:
        raise WorldError(
            f"this job spans {num_nodes} nodes but MASTER_ADDR is not set, so no rank knows "
            f"where rank 0's store is: {how}"
        )
    return "127.0.0.1"


def from_slurm(env: Mapping[str, str]) -> dict[str, Any]:
    """The World fields of a task started by ``srun`` (step-level layout first)."""
    world_size = read_int(env, "SLURM_STEP_NUM_TASKS", read_int(env, "SLURM_NTASKS"))
    num_nodes = read_int(
        env, "SLURM_STEP_NUM_NODES", read_int(env, "SLURM_JOB_NUM_NODES", read_int(env, "SLURM_NNODES", 1))
    )
    node_rank = read_int(env, "SLURM_NODEID", 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = expand_tasks_per_node(per_node)
        local_world = counts[node_rank] if node_rank < len(counts) else counts[-1]
    else:
        local_world = read_int(env, "SLURM_NTASKS_PER_NODE", -(-world_size // max(1, num_nodes)))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    first = expand_hostlist(nodelist)[0] if nodelist else None
    return dict(
        rank=read_int(env, "SLURM_PROCID"),
        local_rank=read_int(env, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=min(local_world, world_size),
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=_master_addr(env, first, num_nodes, "set SLURM_STEP_NODELIST or MASTER_ADDR"),
        master_port=_port(env, env.get("SLURM_JOB_ID")),
        source="slurm",
    )


def _mpi(
    env: Mapping[str, str],
    names: tuple[str, str, str, str],
    source: str,
    job_id: str | None,
    how: str,
    node_rank: int | None = None,
) -> dict[str, Any]:
    rank_key, size_key, local_rank_key, local_size_key = names
    world_size, rank = read_int(env, size_key), read_int(env, rank_key)
    local_world = read_int(env, local_size_key, world_size)
    num_nodes = max(1, -(-world_size // max(1, local_world)))
    # ranks are placed by slot (mpirun's default): node i holds ranks [i*local, (i+1)*local)
    node = rank // max(1, local_world) if node_rank is None else node_rank
    return dict(
        rank=rank,
        local_rank=read_int(env, local_rank_key, 0),
        world_size=world_size,
        local_world_size=local_world,
        node_rank=min(node, num_nodes - 1),
        num_nodes=num_nodes,
        master_addr=_master_addr(env, None, num_nodes, how),
        master_port=_port(env, job_id),
        source=source,
    )


def from_openmpi(env: Mapping[str, str]) -> dict[str, Any]:
    """The World fields of a rank that OpenMPI's ``mpirun`` started."""
    return _mpi(
        env,
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        "openmpi",
        env.get("OMPI_MCA_ess_base_jobid"),
        "start it with `mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<free port> ...`",
    )


def from_pmi(env: Mapping[str, str]) -> dict[str, Any]:
    """The World fields of a rank that MPICH's or Intel MPI's ``mpiexec`` (hydra) started."""
    return _mpi(
        env,
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        "mpich",
        None,
        "start it with `mpiexec -genv MASTER_ADDR <rank 0's host> -genv MASTER_PORT <free port> ...`",
    )


def from_horovod(env: Mapping[str, str]) -> dict[str, Any]:
    """The World fields of a rank that ``horovodrun`` started."""
    return _mpi(
        env,
        ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
        "horovodrun",
        None,
        "export MASTER_ADDR=<rank 0's host> before horovodrun (it is passed on to every rank)",
        node_rank=read_int(env, "HOROVOD_CROSS_RANK", -1) if env.get("HOROVOD_CROSS_RANK") else None,
    )


def horovod_variables(
    *,
    port: int,
    hostname: str,
    size: int,
    local_size: int,
    cross_size: int = 1,
    addr: str = "127.0.0.1",
    iface: str = "lo",
) -> dict[str, str]:
    """What ``horovodrun --gloo`` exports to every rank it starts (``horovod.runner.gloo_run``), but the rank's own."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_HOSTNAME": hostname,
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_SIZE": str(cross_size),
    }


def horovod_rank_variables(env: Mapping[str, str]) -> dict[str, str]:
    """A worker's ``HOROVOD_RANK/LOCAL_RANK/CROSS_RANK`` (from torchrun's) when its launcher serves Horovod."""
    if "HOROVOD_GLOO_RENDEZVOUS_PORT" not in env or "RANK" not in env:
        return {}
    return {
        "HOROVOD_RANK": env["RANK"],
        "HOROVOD_LOCAL_RANK": env.get("LOCAL_RANK", "0"),
        "HOROVOD_CROSS_RANK": env.get("GROUP_RANK", "0"),
    }


def launch_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """``lockstep run``'s node layout (one launcher per node) from Kubeflow, SkyPilot or Slurm, else ``{}``.

    Keys: ``nodes``, ``node_rank``, ``master`` (``HOST:PORT``) and, where the engine says it, ``nproc``.
    """
    if env.get("PET_NNODES"):
        found: dict[str, Any] = {"nodes": read_int(env, "PET_NNODES"), "node_rank": read_int(env, "PET_NODE_RANK", 0)}
        if env.get("PET_MASTER_ADDR"):
            found["master"] = f"{env['PET_MASTER_ADDR']}:{read_int(env, 'PET_MASTER_PORT', DEFAULT_PORT)}"
        if env.get("PET_NPROC_PER_NODE", "").isdigit():
            found["nproc"] = int(env["PET_NPROC_PER_NODE"])
        return found if found["nodes"] > 1 else {k: v for k, v in found.items() if k == "nproc"}
    if env.get("SKYPILOT_NODE_IPS"):
        ips = [line.strip() for line in env["SKYPILOT_NODE_IPS"].splitlines() if line.strip()]
        nodes = read_int(env, "SKYPILOT_NUM_NODES", len(ips))
        found = {
            "nodes": nodes,
            "node_rank": read_int(env, "SKYPILOT_NODE_RANK", 0),
            "master": f"{ips[0]}:{_port(env, env.get('SKYPILOT_TASK_ID'))}",
        }
        if env.get("SKYPILOT_NUM_GPUS_PER_NODE", "").isdigit() and int(env["SKYPILOT_NUM_GPUS_PER_NODE"]) > 0:
            found["nproc"] = int(env["SKYPILOT_NUM_GPUS_PER_NODE"])
        return found if nodes > 1 else {k: v for k, v in found.items() if k == "nproc"}
    nodes = read_int(env, "SLURM_STEP_NUM_NODES", 0)
    if nodes < 2 or read_int(env, "SLURM_STEP_NUM_TASKS", 0) != nodes:
        return {}  # not one launcher per node (e.g. one task per GPU): the ranks read Slurm themselves
    host = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")[0]
    return {
        "nodes": nodes,
        "node_rank": read_int(env, "SLURM_NODEID"),
        "master": f"{host}:{_port(env, env.get('SLURM_JOB_ID'))}",
    }
