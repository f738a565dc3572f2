"""Run the pods of a Kubeflow PyTorchJob as local processes, with the environment the Training
Operator gives each pod, and report how they ended.

    python tests/engines/scripts/pods.py examples/kubernetes/pytorchjob.yaml --workdir . \\
        --master-addr 127.0.0.1

Each replica of ``Master`` and ``Worker`` runs its container's ``command`` + ``args`` with the
container's ``env`` and the operator's variables (training-operator v1, ``pytorch/envvar.go`` and
``pytorch/master.go``): ``PYTHONUNBUFFERED``, ``MASTER_ADDR``/``PET_MASTER_ADDR`` (the Master's
service; ``--master-addr`` stands in for it here), ``MASTER_PORT``/``PET_MASTER_PORT`` (the
``pytorchjob-port``), ``WORLD_SIZE`` (replicas x nprocPerNode), ``RANK`` and ``PET_NODE_RANK``
(Master 0, Worker i + 1), ``PET_NPROC_PER_NODE``, ``PET_NNODES``. The container's
``workingDir`` is replaced by ``--workdir``; ``--nproc-per-node`` and ``--command`` run the same
pods with another process count and command (the engine tests run their reference job so). Output lines are prefixed
with the pod's name.
Exits with the first non-zero exit code of a pod (0 when all succeeded).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
from typing import Any

import yaml

DEFAULT_PORT = 23456  # the operator's default pytorchjob-port


def pods(
    job: dict[str, Any], master_addr: str, nproc_per_node: str | None = None, command: list[str] | None = None
) -> list[tuple[str, list[str], dict[str, str]]]:
    """Every pod of ``job`` as (name, command, environment additions), Master first; ``nproc_per_node``
    and ``command`` stand in for the job's ``nprocPerNode`` and every container's command."""
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    nproc = nproc_per_node or str(job["spec"].get("nprocPerNode", "1"))
    total = sum(int(spec.get("replicas", 1)) for spec in specs.values())
    master = specs["Master"]["template"]["spec"]["containers"][0]
    port = next(
        (p["containerPort"] for p in master.get("ports", []) if p.get("name") == "pytorchjob-port"), DEFAULT_PORT
    )
    world = total * (int(nproc) if nproc.isdigit() else 1)
    out = []
    for kind in ("Master", "Worker"):
        spec = specs.get(kind)
        for index in range(int(spec.get("replicas", 1)) if spec else 0):
            container = spec["template"]["spec"]["containers"][0]
            rank = index + (1 if kind == "Worker" else 0)
            env = {item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item}
            env.update(
                PYTHONUNBUFFERED="0",
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(port),
                PET_MASTER_ADDR=master_addr,
                PET_MASTER_PORT=str(port),
                WORLD_SIZE=str(world),
                RANK=str(rank),
                PET_NPROC_PER_NODE=nproc,
                PET_NODE_RANK=str(rank),
                PET_NNODES=str(total),
            )
            argv = command or list(container.get("command", [])) + list(container.get("args", []))
            out.append((f"{name}-{kind.lower()}-{index}", argv, env))
    return out


def relay(name: str, stream: Any) -> None:
    """Print ``stream``'s lines prefixed with the pod's name."""
    for line in stream:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def main() -> int:
    """Start every pod, wait for all of them, return the first failure's exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--workdir", default=".", help="stands in for the containers' workingDir")
    parser.add_argument("--master-addr", default=None, help="stands in for the Master pod's service name")
    parser.add_argument("--nproc-per-node", default=None, help="instead of the job's nprocPerNode")
    parser.add_argument("--command", default=None, help="instead of the containers' command (split like a shell)")
    args = parser.parse_args()
    with open(args.manifest, encoding="utf-8") as fp:
        job = yaml.safe_load(fp)
    if job.get("kind") != "PyTorchJob":
        print(f"pods: {args.manifest} is a {job.get('kind')}, not a PyTorchJob", file=sys.stderr)
        return 2
    master_addr = args.master_addr or f"{job['metadata']['name']}-master-0"
    started = []
    override = shlex.split(args.command) if args.command else None
    for name, command, env in pods(job, master_addr, args.nproc_per_node, override):
        print(
            f"pods: WORLD_SIZE={env['WORLD_SIZE']} {name}: PET_NNODES={env['PET_NNODES']} "
            f"PET_NODE_RANK={env['PET_NODE_RANK']} PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']} "
            f"PET_MASTER={env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']} $ {' '.join(command)}",
            flush=True,
        )
        proc = subprocess.Popen(
            command,
            cwd=args.workdir,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        thread = threading.Thread(target=relay, args=(name, proc.stdout), daemon=True)
        thread.start()
        started.append((name, proc, thread))
    codes = []
    for name, proc, thread in started:
        codes.append(proc.wait())
        thread.join()
        print(f"pods: {name} exited {codes[-1]}", flush=True)
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
