"""``lockstep run``: start a script on N processes per node with torch's elastic agent.

The processes are started, watched, restarted and stopped by torch's own agent
(``torch.distributed.launcher.api.elastic_launch``, the engine of ``torchrun``); this module only
chooses its configuration and explains the outcome. How it launches:

* one node, no ``--master``: a c10d rendezvous on ``127.0.0.1:0`` hosted by the agent, so the
  operating system picks the port and two jobs on one machine never collide. The workers' store
  does not share the rendezvous store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), because a
  shared store keeps stale keys and a restarted gloo group would never form again.
* ``--master HOST:PORT`` (required with ``--nodes N > 1``): a static rendezvous; node 0 hosts the
  agents' store on PORT, every node waits up to ``--join-timeout`` for the others, at the start and
  at every restart, and each round's workers get a new store (:mod:`lockstep.launch.rendezvous`): a
  restart forms a new group or fails within the timeout naming the node it waited for.
* every worker runs :mod:`lockstep.launch.bootstrap`, which records its exception in the elastic error
  file; when a rank fails, :mod:`lockstep.launch.report` prints one summary blaming the first
  real failure, not the ranks that were merely stopped or lost their peer.
* ``--nodes MIN:MAX`` (with ``--master`` and ``--secret-file``): every node starts its own workers,
  which meet in a signed membership store hosted by the node that owns the ``--master`` address and
  rebuild their process group in place when a node leaves or joins (:mod:`lockstep.launch.membership`,
  :mod:`lockstep.comm.elastic`).
* SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 to the launcher are forwarded to every worker,
  which then has ``--grace`` seconds to save (see :mod:`lockstep.session.preempt`) before SIGKILL. A job
  whose ranks stop with exit code 75 ends as preempted (exit 75) and uses up no restart.
* where Horovod is installed, an unmodified Horovod script gets what ``horovodrun --gloo`` gives
  it (:mod:`lockstep.launch.horovod`): one job of N ranks, not N jobs of one.
* ``--timeout`` is exported as ``LOCKSTEP_TIMEOUT``: the default timeout of the workers'
  collectives, past which the rank that did not arrive is named (:mod:`lockstep.comm.watchdog`).
* the workers die with the launcher: the agent runs in this process and starts them itself, and
  each worker's bootstrap asks for SIGKILL when its parent, this process
  (``LOCKSTEP_LAUNCHER_PID``), ends, however it ends (``kill -9`` included).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from lockstep.env import process_alive
from lockstep.errors import EXIT_USAGE, LockstepError
from lockstep.launch.horovod import check_horovod_hosts, horovod_rendezvous
from lockstep.launch.membership import membership_environment, membership_store, new_node_id
from lockstep.launch.rendezvous import BACKEND as LOCAL_BACKEND
from lockstep.launch.rendezvous import NODES_BACKEND, RoundError
from lockstep.launch.rendezvous import register as register_local_rendezvous
from lockstep.launch.report import say
from lockstep.launch.reporter import JobReporter
from lockstep.launch.spec import (
    DEFAULT_GRACE,
    DEFAULT_JOIN_TIMEOUT,
    LaunchSpec,
    exposure_warning,
    import_torch_quietly,
    oversubscription_warning,
    parse_master,
    resolve_nproc,
    slurm_defaults,
)
from lockstep.launch.torch_agent import quiet_torch, reporting_agent

__all__ = [
    "LaunchSpec",
    "LaunchError",
    "PortInUseError",
    "launch",
    "resolve_nproc",
    "parse_master",
    "exposure_warning",
    "slurm_defaults",
    "remove_stale_run_folders",
    "import_torch_quietly",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_GRACE",
]

# Forwarded to every worker; SIGUSR1 is what Slurm sends ahead of the end (`--signal=USR1@90`).
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
# How often the agent looks at its workers. torch's 0.1 s adds up to 0.1 s (0.05 on average) to
# every job's end and every restart; a look is a poll() per worker, so 50 a second cost nothing.
MONITOR_INTERVAL_S = 0.02


class LaunchError(LockstepError):
    """The job could not start (busy port, nodes that never joined, unreachable master)."""


class PortInUseError(LaunchError):
    """The ``--master`` port is taken: refused before any worker started, like bad flags (exit 2)."""

    exit_code = EXIT_USAGE


def _worker_args(spec: LaunchSpec) -> list[str]:
    # -u: unbuffered, so each rank's lines reach the console as they are printed.
    args = ["-u", "-m", "lockstep.launch.bootstrap"] + (["-m"] if spec.module else []) + [spec.target]
    if spec.local_rank_arg:
        args.append("--local_rank=${local_rank}")  # filled in per worker by the agent
    return args + list(spec.args)


def _say_log_folder(log_dir: str, run_id: str, prefix: str) -> None:
    """Name the folder torch's agent made under ``--log-dir`` for this job (``RUNID_xxxx``, a random suffix)."""
    made = (
        sorted(
            (os.path.join(log_dir, d) for d in os.listdir(log_dir) if d.startswith(run_id + "_")), key=os.path.getmtime
        )
        if os.path.isdir(log_dir)
        else []
    )
    if made:
        say(
            f"{prefix}every rank's output is under {os.path.abspath(made[-1])} "
            "(attempt_N/LOCAL_RANK/stdout.log and stderr.log)"
        )


def _launch_config(spec: LaunchSpec, log_dir: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    timeout = max(1, round(spec.join_timeout))
    if not spec.relayed:
        # rank 0 inherits this terminal; the other ranks write only to their log files
        logs = DefaultLogsSpecs(
            log_dir=log_dir, redirects={r: Std.ALL for r in range(spec.nproc) if spec.node_rank != 0 or r != 0}
        )
    else:
        # every rank writes to its log files; the agent's relay shows them (see launch_output)
        logs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL)
    common: dict[str, Any] = dict(
        min_nodes=1 if spec.elastic else spec.nodes,
        max_nodes=1 if spec.elastic else spec.nodes,
        nproc_per_node=spec.nproc,
        max_restarts=spec.max_restarts,
        logs_specs=logs,
        monitor_interval=MONITOR_INTERVAL_S,
        # a stop signal is forwarded to the workers, which get `grace` seconds to save before SIGKILL
        signals_to_handle=",".join(n for n in _SIGNALS if hasattr(signal, n)),
        shutdown_timeout=max(0, round(spec.grace)),
    )
    if spec.master is None or spec.elastic:
        # --nodes MIN:MAX: each node starts its own workers; they meet in the membership store
        register_local_rendezvous()  # in memory: nothing listens, nothing is unpickled
        return LaunchConfig(
            run_id=uuid.uuid4().hex,
            rdzv_backend=LOCAL_BACKEND,
            rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"timeout": timeout, "join_timeout": timeout},
            local_addr="127.0.0.1",
            **common,
        )
    register_local_rendezvous()
    return LaunchConfig(
        run_id="lockstep",
        rdzv_backend=NODES_BACKEND,
        rdzv_endpoint=spec.master,
        rdzv_configs={"rank": spec.node_rank, "timeout": timeout},
        **common,
    )


@contextmanager
def _launch_environment(
    spec: LaunchSpec, postmortem_dir: str = "", extra: dict[str, str] | None = None
) -> Iterator[None]:
    """The workers' environment (see `_environment`), with the membership store under ``--nodes MIN:MAX``."""
    with ExitStack() as stack:
        extra = dict(extra or {})
        if spec.elastic:
            stack.enter_context(membership_store(spec))
            extra.update(membership_environment(spec, new_node_id()))
        stack.enter_context(_environment(spec, postmortem_dir, extra))
        yield


@contextmanager
def _environment(spec: LaunchSpec, postmortem_dir: str, extra: dict[str, str]) -> Iterator[None]:
    """Set the variables the agent and workers need (and ``extra``); give back the caller's environment
    and signal handlers afterwards (the agent installs its own and leaves them in place)."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}  # workers inherit it; see the module docstring
    if spec.timeout is not None:
        env["LOCKSTEP_TIMEOUT"] = f"{spec.timeout:g}"  # the default of Session / init_comm
    env["LOCKSTEP_GRACE"] = f"{spec.grace:g}"  # after it, a worker obeys a stop signal unsaved
    env["LOCKSTEP_LAUNCHER_PID"] = str(os.getpid())  # the workers' parent: they die with it (bootstrap)
    env["LOCKSTEP_POSTMORTEM_DIR"] = postmortem_dir  # each rank's collective record (lockstep.comm.record)
    # signs lockstep's values in the workers' store (see lockstep.comm.signed); a random secret per job
    # on one node, the --secret-file content across nodes (the nodes' launchers share nothing else)
    env["LOCKSTEP_SECRET"] = spec.secret or (secrets.token_hex(16) if spec.nodes == 1 else "")
    if sys.stderr.isatty():  # a worker's stderr is a log file the relay copies: its progress bar still draws
        size = shutil.get_terminal_size()
        env["LOCKSTEP_TERMINAL"] = f"{size.columns}x{size.lines}"
    if spec.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not oversubscribe the CPU
    # launch_agent also sets TORCHELASTIC_SIGNALS_TO_HANDLE for good; give back the caller's value.
    saved_env = {key: os.environ.get(key) for key in [*env, "TORCHELASTIC_SIGNALS_TO_HANDLE"]}
    in_main = threading.current_thread() is threading.main_thread()
    signums = [getattr(signal, n) for n in _SIGNALS if hasattr(signal, n)]
    saved_handlers = {s: signal.getsignal(s) for s in signums} if in_main else {}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for signum, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(signum, handler)


def _start_error(exc: Exception, spec: LaunchSpec) -> LaunchError:
    """Explain a failure of the rendezvous (before any worker ran) in the user's terms."""
    text = f"{type(exc).__name__}: {exc}"
    host, port = parse_master(spec.master) if spec.master else ("127.0.0.1", 0)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return PortInUseError(
            f"cannot host the rendezvous store on {host}:{port}: port {port} is already in "
            "use. Choose another --master port (or leave out --master on one node)."
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ENOMEM):
        # fork refused part-way: the workers already started die with this process (bootstrap)
        return LaunchError(
            f"could not start {spec.nproc} processes: the system refused a new process ({text}); "
            "a process limit (ulimit -u) or memory ran out. Start fewer with --nproc."
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    reach = (
        f"node 0's address on port {port} (--master names the wildcard {host}, which the other nodes "
        "cannot connect to: give node 0's real address)"
        if host in ("0.0.0.0", "::", "*")
        else f"{host}:{port}"
    )
    if joined:
        return LaunchError(
            f"expected {spec.nodes} nodes, {joined.group(1)} joined within "
            f"{spec.join_timeout:g} s. Start `lockstep run --nodes {spec.nodes} --node-rank I "
            f"--master {spec.master}` on every node, and check that they reach {reach}."
        )
    if spec.node_rank > 0 and ("connect" in text.lower() or "timed out" in text.lower()):
        return LaunchError(
            f"node {spec.node_rank} could not reach node 0's store at {host}:{port} within "
            f"{spec.join_timeout:g} s: is node 0 started, and is the address reachable from here? "
            f"({text})"
        )
    return LaunchError(f"the job could not start: {text}")


RUN_FOLDER_PREFIX = "lockstep-run-"
"""The temporary log folder of a launch without ``--log-dir``: ``lockstep-run-<launcher pid>-<random>``."""


def remove_stale_run_folders(parent: str | None = None) -> list[str]:
    """Remove the temporary log folders of launchers that are gone (killed before their clean-up).

    Only folders of this user, named after a process that no longer exists, are removed.

    Args:
        parent: where they are (default: the temporary directory).

    Returns:
        The folders removed.
    """
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(RUN_FOLDER_PREFIX):
            continue
        pid_text = name[len(RUN_FOLDER_PREFIX) :].partition("-")[0]
        path = os.path.join(parent, name)
        try:
            if not pid_text.isdigit() or os.stat(path).st_uid != os.getuid() or process_alive(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def launch(spec: LaunchSpec) -> int:
    """Run the job described by ``spec`` on this node and return the exit code for the launcher.

    0 on success; :data:`~lockstep.errors.EXIT_PREEMPTED` when every failed rank stopped for
    preemption; ``128 + signal`` when the launcher itself was stopped by a signal; 1 when a rank failed
    (after printing one summary that names it).

    Args:
        spec: what to run.

    Raises:
        PortInUseError: the ``--master`` port is taken (exit code 2).
        ConfigError: a script that imports Horovod, on several nodes (exit code 2).
        LaunchError: the rendezvous failed (nodes that never joined), or not every worker could start.
        RoundError: a restart of a several-node job waited in vain for a node.
    """
    check_horovod_hosts(spec)
    import_torch_quietly(spec.verbose)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    warnings = [oversubscription_warning(spec.nproc, prefix=spec.says)]
    if spec.master is not None and not spec.elastic:
        warnings.append(exposure_warning(parse_master(spec.master)[0], prefix=spec.says))
    for warning in warnings:
        if warning:
            say(warning)
    remove_stale_run_folders()  # those of launchers killed with SIGKILL, which cleaned up nothing
    log_dir = spec.log_dir or tempfile.mkdtemp(prefix=f"{RUN_FOLDER_PREFIX}{os.getpid()}-")
    report = JobReporter(spec, postmortem_dir=os.path.join(log_dir, "postmortem"))
    config: Any = None
    try:
        with (
            horovod_rendezvous(spec) as horovod,
            _launch_environment(spec, report.postmortem_dir, horovod),
            quiet_torch(spec.verbose),
            reporting_agent(report),
        ):
            config = _launch_config(spec, log_dir)
            elastic_launch(config, sys.executable)(*_worker_args(spec))
        return 0
    except ChildFailedError as exc:
        return report.failed(exc.failures)
    except SignalException as exc:
        return report.signalled(int(exc.sigval))
    except RoundError:
        raise  # says itself which node a restart waited for
    except Exception as exc:  # noqa: BLE001 - anything else failed before a worker could run
        raise _start_error(exc, spec) from None
    finally:
        sys.stdout.flush()
        if spec.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif config is not None:
            _say_log_folder(log_dir, config.run_id, spec.says)
