"""``spawn()``: run a function on N local processes, for notebooks and tests.

The seeds' ``mp.spawn`` pattern (``rank = node_rank * nprocs + local_rank``) with the launch
environment filled in: each worker sees ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` before ``fn`` is even
unpickled, so ``lockstep.Session()``, ``init_comm()`` or ``dist.init_process_group("gloo")``
inside ``fn`` join the job. Return values come back by rank; a failing rank raises
:class:`SpawnError` in the parent with that rank's exception and traceback. Scripts should prefer
``lockstep run``, which restarts, reports and handles signals.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

from lockstep.errors import ConfigError, LockstepError
from lockstep.launch.rendezvous import free_port
from lockstep.launch.report import signal_name

__all__ = ["spawn", "SpawnError"]


class SpawnError(LockstepError):
    """A rank of :func:`spawn` failed; ``rank`` names it and ``worker_traceback`` is its traceback.

    Args:
        message: what happened, naming the rank.
        rank: the failing global rank.
        worker_traceback: the traceback printed in the worker, or ``""``.
    """

    def __init__(self, message: str, rank: int | None = None, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback


def _worker(env: dict[str, str], payload: bytes, results: Any, stdio: None = None) -> None:
    """Entry of each spawned process: set the environment, then unpickle and run ``fn``."""
    forked = env.pop(_WHOLE_ENV, None)
    if forked:  # forked from a server started earlier: its environment is stale
        os.environ.clear()
    os.environ.update(env)  # before unpickling fn: its module may read the environment on import
    if forked and env.get("OMP_NUM_THREADS", "").isdigit():
        import torch  # OpenMP read the server's environment when torch was loaded there

        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    rank = int(env["RANK"])
    try:
        fn, args = pickle.loads(payload)
        # plain pickle copies tensors by value; the queue's own pickler would share them through a file
        # descriptor that dies with this process
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value, time.time()))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        text = f"{type(exc).__name__}: {exc}"
        results.put((rank, False, (text, traceback.format_exc()), time.time()))
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # exiting with a live group can abort the process


_WHOLE_ENV = "__lockstep_whole_env"  # marks an environment that replaces the child's own
START_METHODS = ("spawn", "forkserver")


class _Stdio:
    """This process's stdout and stderr, sent to a forked rank (a forkserver child has the server's)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out: Any, err: Any) -> None:
    for target, handle in ((1, out), (2, err)):
        fd = handle.detach()
        os.dup2(fd, target)
        os.close(fd)


def _environments(nprocs: int, nodes: int, node_rank: int, host: str, port: int) -> list[dict[str, str]]:
    world = nodes * nprocs
    envs = []
    for local_rank in range(nprocs):
        envs.append(
            {
                "RANK": str(node_rank * nprocs + local_rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(nprocs),
                "GROUP_RANK": str(node_rank),
                "MASTER_ADDR": host,
                "MASTER_PORT": str(port),
                "LOCKSTEP_SOURCE": "spawn",
            }
        )
        if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
            envs[-1]["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not oversubscribe the CPU
    return envs


def _check(fn: Callable[..., Any], nprocs: int, nodes: int, node_rank: int, master: str | None) -> tuple[str, int]:
    if nprocs < 1 or nodes < 1 or not 0 <= node_rank < nodes:
        raise ConfigError(
            f"spawn needs nprocs >= 1, nodes >= 1 and 0 <= node_rank < nodes; got "
            f"nprocs={nprocs}, nodes={nodes}, node_rank={node_rank}"
        )
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ConfigError(
            f"spawn cannot send {getattr(fn, '__name__', fn)!r} to new processes: it is defined "
            "in a notebook cell. Put it in a .py file and import it from there."
        )
    host, _, port_text = (master or "127.0.0.1:0").rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"master {master!r} must look like HOST:PORT") from None
    if port == 0 and nodes > 1:
        raise ConfigError("spawn with nodes > 1 needs master='HOST:PORT' with a real port, the same on every node")
    return host, (port or free_port(host))


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    nodes: int = 1,
    node_rank: int = 0,
    master: str | None = None,
    timeout: float | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` new processes of this node and return their results.

    Args:
        fn: a picklable function (defined at module level in an importable file).
        nprocs: processes on this node.
        args: positional arguments for ``fn``; they must be picklable.
        nodes: number of nodes; run ``spawn`` on each with its own ``node_rank``.
        node_rank: this node's index; its ranks are ``node_rank * nprocs + local_rank``.
        master: ``HOST:PORT`` of rank 0's store; on one node ``None`` (or port 0) picks a free port.
        timeout: seconds to wait for all ranks; ``None`` waits as long as they run.
        start_method: ``"spawn"`` (a fresh interpreter per rank) or ``"forkserver"`` (ranks
            forked from a server process that imported torch and lockstep once: much faster to
            start when many short jobs run one after another, as in a test suite). Either way
            each rank sees this process's environment as it is at the call.

    Returns:
        ``fn``'s return values of this node's ranks, in rank order.

    Raises:
        SpawnError: a rank raised, died or the timeout passed; the message names the rank and
            carries its traceback. The other ranks are stopped.
    """
    import multiprocessing as mp

    host, port = _check(fn, nprocs, nodes, node_rank, master)
    if start_method not in START_METHODS:
        raise ConfigError(f"spawn's start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    ctx: Any = mp.get_context(start_method)  # SpawnContext or ForkServerContext
    envs = _environments(nprocs, nodes, node_rank, host, port)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "lockstep"])
        envs = [{**os.environ, **env, _WHOLE_ENV: "1"} for env in envs]
    results = ctx.Queue()
    payload = pickle.dumps((fn, tuple(args)))
    stdio = (_Stdio(),) if start_method == "forkserver" else ()
    procs = [ctx.Process(target=_worker, args=(env, payload, results, *stdio), daemon=False) for env in envs]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, node_rank * nprocs, timeout)
    finally:
        _stop(procs)


def _collect(procs: list[Any], results: Any, first_rank: int, timeout: float | None) -> list[Any]:
    """Wait for every rank's result; raise on the first failure (the root cause)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    values: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    while len(values) < len(procs):
        try:
            rank, ok, value, _ = results.get(timeout=0.1)
        except queue.Empty:
            _check_dead(procs, values, first_rank, dead_since)
            if deadline is not None and time.monotonic() > deadline:
                waiting = [first_rank + i for i in range(len(procs)) if first_rank + i not in values]
                raise SpawnError(f"spawn timed out after {timeout:g} s; ranks still running: {waiting}") from None
            continue
        if not ok:
            text, tb = value
            raise SpawnError(f"rank {rank} failed: {text}\n{tb}", rank=rank, worker_traceback=tb)
        try:
            values[rank] = pickle.loads(value)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be read names its rank
            raise SpawnError(f"rank {rank} returned a value that cannot be unpickled here: {exc}", rank=rank) from None
    return [values[first_rank + i] for i in range(len(procs))]


def _check_dead(procs: list[Any], values: dict[int, Any], first_rank: int, dead_since: dict[int, float]) -> None:
    """Raise for a rank whose process ended without a result (killed, or ``os._exit``)."""
    now = time.monotonic()
    for local_rank, proc in enumerate(procs):
        rank = first_rank + local_rank
        if rank in values or proc.exitcode is None:
            continue
        # A result sent just before exiting may still be in the pipe: give it a second.
        if now - dead_since.setdefault(rank, now) < 1.0:
            continue
        code = proc.exitcode
        if code < 0:
            raise SpawnError(f"rank {rank} was killed by {signal_name(-code)} (pid {proc.pid})", rank=rank)
        raise SpawnError(f"rank {rank} exited with code {code} without returning (pid {proc.pid})", rank=rank)


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


class _CallableModule(types.ModuleType):
    """``lockstep.launch.spawn(fn, nprocs, args=...)`` is :func:`spawn`, as the reference page names it."""

    def __call__(self, fn: Callable[..., Any], nprocs: int, *args: Any, **kwargs: Any) -> list[Any]:
        return spawn(fn, nprocs, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
