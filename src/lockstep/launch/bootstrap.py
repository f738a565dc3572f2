"""The first code each worker of ``lockstep run`` executes; it then runs the user's script.

The elastic agent starts every worker as::

    python -u -m lockstep.launch.bootstrap script.py [args...]       # or: ... -m package.module [args...]

This module runs the script exactly as ``python script.py args`` would (``sys.argv`` set, the
script's folder first on ``sys.path``, ``__name__ == "__main__"``). When the script raises, the
exception and its traceback are written to ``$TORCHELASTIC_ERROR_FILE`` in the format of
``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``, with a ``lockstep`` section that
adds a sub-second timestamp (to tell the first failure from the ranks that merely lost their peer)
and the host. The launcher prints that traceback once, in its failure summary, so the worker does
not print it too. It imports nothing heavy: the script pays for its own imports.

A worker dies with its launcher. The elastic agent runs inside the launcher process and starts
every worker itself (in a session of its own, so a signal to the launcher's process group does
not reach it), so the worker's parent is the launcher. Before the script runs, the worker asks
the kernel for SIGKILL when that parent ends (``prctl(PR_SET_PDEATHSIG)``, Linux), then checks
that its parent is still the launcher that started it (``$LOCKSTEP_LAUNCHER_PID``): a launcher
killed with ``kill -9``, or one that failed to start the rest of the group, leaves no worker
training on its own.

A stop signal (SIGTERM, SIGHUP) that reaches a worker running a plain script is noted at once, from
C, in ``rank<N>.signal`` beside its post-mortem record (:func:`note_stop_signals`; the signal then
ends the worker as before): the launcher can tell a rank signalled from outside the job, before
anything failed, from the ranks it stopped itself afterwards, and names that rank first.

The job's secret (``$LOCKSTEP_SECRET``, which signs lockstep's values in the store) is taken out
of the worker's environment before the script runs (:func:`lockstep.env.withhold_secret`): lockstep
in the worker still uses it, the processes the script starts do not inherit it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import runpy
import signal
import sys

from lockstep._cluster import horovod_rank_variables
from lockstep.env import environment, export_environment, read_settings, withhold_secret
from lockstep.errors import EXIT_PREEMPTED

__all__ = ["main", "run_target", "record_failure", "die_with_launcher", "note_stop_signals", "signal_record"]

_SKIP_FRAMES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
EXIT_ORPHANED = 128 + signal.SIGKILL
"""What a worker whose launcher was already gone exits with (as if the parent-death signal hit it)."""


def die_with_launcher(launcher_pid: int | None) -> bool:
    """Have the kernel SIGKILL this process when its parent, the launcher, ends (Linux only).

    The parent-death signal fires when the thread that started this process ends; the elastic
    agent starts its workers from the thread that runs the launch and waits for them, so that
    is the launcher's lifetime. A launcher that died before the signal was set is caught by
    comparing the parent with ``launcher_pid`` right after setting it.

    Args:
        launcher_pid: the pid of the launcher that started this worker; ``None`` (not started by
            ``lockstep run``) does nothing.

    Returns:
        False when the launcher is already gone (the caller must exit), True otherwise
        (including platforms without ``prctl``, where nothing is done).
    """
    if launcher_pid is None or not sys.platform.startswith("linux"):
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return True  # refused (a sandbox): the worker simply keeps the old behaviour
    except (OSError, AttributeError):
        return True
    return os.getppid() == launcher_pid


_NOTED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def signal_record(folder: str, rank: int) -> str:
    """The file a worker of ``rank`` notes a stop signal in (:func:`note_stop_signals`)."""
    return os.path.join(folder, f"rank{rank}.signal")


def note_stop_signals(folder: str, rank: int) -> object | None:
    """Have a stop signal write this process's stacks to :func:`signal_record` before it acts as before.

    Written from C (``faulthandler``), so a rank blocked in a collective notes it at once; the file's
    time is when the signal came. A script (or ``Session``) that installs its own handler replaces
    this one; a forked child does not inherit it. Returns the open file (``faulthandler`` holds it too),
    or ``None``.

    Args:
        folder: the job's post-mortem folder (``$LOCKSTEP_POSTMORTEM_DIR``); empty: nothing noted.
        rank: this worker's global rank.
    """
    if not folder or not _NOTED_SIGNALS:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        record = open(signal_record(folder, rank), "w")  # noqa: SIM115 - written by the signal handler
    except OSError:
        return None
    for signum in _NOTED_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_DFL:
            faulthandler.register(signum, file=record, all_threads=True, chain=True)
    os.register_at_fork(after_in_child=_forget_stop_signals)
    return record


def _forget_stop_signals() -> None:
    """In a forked child: the parent's record is not the child's (a handler set from Python stays)."""
    for signum in _NOTED_SIGNALS:
        if signal.getsignal(signum) is None:  # still faulthandler's (a C handler)
            faulthandler.unregister(signum)


def run_target(target: str, args: list[str], module: bool) -> None:
    """Run ``target`` (a script path, or a module name when ``module``) as ``__main__``.

    Args:
        target: path of the script, or the dotted module name.
        args: the script's own arguments (``sys.argv[1:]`` inside it).
        module: run ``target`` like ``python -m target``.
    """
    if module:
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()  # like `python -m`: the working directory comes first
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    path = os.path.abspath(target)
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(path)  # like `python script.py`: the script's folder comes first
    runpy.run_path(path, run_name="__main__")


def record_failure(exc: BaseException, exit_code: int, path: str) -> None:
    """Write ``exc`` to the elastic error file ``path``, with the user's frames only.

    Args:
        exc: the exception the script raised.
        exit_code: the exit code this worker is about to use.
        path: the error file (``Settings.error_file``).
    """
    from lockstep.comm import failure  # only a failing worker pays for its imports (json, socket, traceback)

    failure.record_failure(exc, exit_code, path, failure.user_traceback(exc, _SKIP_FRAMES))


def _exit_code(code: object) -> int:
    """What the interpreter would exit with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    """Run the target named in ``argv`` and return the worker's exit code.

    Args:
        argv: ``[-m] TARGET [ARGS...]`` as the launcher passes it.
    """
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        print("lockstep.launch.bootstrap: no script given", file=sys.stderr)
        return 2
    settings = read_settings()
    withhold_secret()  # lockstep keeps it in this process; what the script starts does not inherit it
    if not die_with_launcher(settings.launcher_pid):
        print(
            f"lockstep.launch.bootstrap: the launcher (pid {settings.launcher_pid}) is gone; not starting",
            file=sys.stderr,
        )
        return EXIT_ORPHANED
    faulthandler.enable(all_threads=True)  # a crash in native code still leaves a Python stack
    export_environment(horovod_rank_variables(environment()))  # this rank's place in the launcher's Horovod job
    error_file = settings.error_file
    if settings.timeout:  # lockstep run --timeout: also for a group the script forms itself
        from lockstep.comm.group import default_timeout_for_scripts
        from lockstep.comm.store import resolve_timeout

        default_timeout_for_scripts(resolve_timeout())
    rank = environment().get("RANK", "")
    if rank.isdigit():
        note_stop_signals(settings.postmortem_dir, int(rank))
    code = 0
    try:
        run_target(argv[0], argv[1:], module)
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if code not in (0, EXIT_PREEMPTED) and error_file:
            record_failure(exc, code, error_file)
    except KeyboardInterrupt:
        return 130  # interrupted, like any Python program: not a failure worth a traceback
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the launcher
        from lockstep.comm import failure

        exc = failure.explain(exc)  # a backend timeout names the rank that never came
        if not error_file:
            raise exc
        record_failure(exc, 1, error_file)
        code = 1
    # out of the except blocks, so that the failure's traceback no longer holds the script's frames
    _release_group()
    gc.collect()  # a Session or DDP module in a reference cycle holds its gloo group: freed now, not at exit
    return code


def _release_group() -> None:
    """Destroy a process group the script left behind (no barrier: after a failure the peers may be gone).

    gloo aborts the interpreter's exit (SIGABRT) in about one failed run in four when the group
    is still alive, and the launcher would then list this rank as killed by a signal; a finished
    script's group still held by a module in a reference cycle did so too, once in about ten runs.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out of a failed run
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
