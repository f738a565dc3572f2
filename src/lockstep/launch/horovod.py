"""Horovod scripts under ``lockstep run``: every worker gets what ``horovodrun --gloo`` gives it.

An unmodified Horovod script (``hvd.init()``, ``hvd.DistributedOptimizer``) reads its job from
the environment. Where Horovod is installed, ``lockstep run`` on one node starts Horovod's own
rendezvous server (Horovod's ``RendezvousHTTPServer``, as ``horovod.runner.gloo_run`` does, but on
loopback) for the job's one host when the script imports Horovod, and exports what ``horovodrun`` exports:
the rendezvous address and port, ``HOROVOD_CONTROLLER=gloo``, ``HOROVOD_CPU_OPERATIONS=gloo``,
the interface, host name and sizes; each worker's bootstrap adds its own ``HOROVOD_RANK``,
``HOROVOD_LOCAL_RANK`` and ``HOROVOD_CROSS_RANK`` (:func:`lockstep._cluster.horovod_rank_variables`).
``Session(strategy="horovod")`` joins it where the launcher serves one, else rank 0 serves its own
(:func:`lockstep.strategies.horovod.init_horovod`). A script that imports Horovod is
refused on several nodes, in one line naming ``horovodrun`` (Horovod's gloo needs the interface
that joins the hosts, which ``horovodrun`` discovers).
"""

from __future__ import annotations

import importlib.util
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lockstep._cluster import horovod_variables
from lockstep.errors import ConfigError
from lockstep.launch.spec import LaunchSpec

__all__ = ["horovod_rendezvous", "imports_horovod", "check_horovod_hosts"]

_IMPORT = re.compile(r"^\s*(?:import|from)\s+horovod\b", re.MULTILINE)


def imports_horovod(spec: LaunchSpec) -> bool:
    """Whether the script imports Horovod itself (a module target is not read: False).

    Args:
        spec: what ``lockstep run`` starts.
    """
    if spec.module:
        return False
    try:
        return bool(_IMPORT.search(Path(spec.target).read_text(encoding="utf-8", errors="replace")))
    except OSError:
        return False


def check_horovod_hosts(spec: LaunchSpec) -> None:
    """Refuse, before anything starts, a script that imports Horovod on several nodes.

    Args:
        spec: what ``lockstep run`` starts.

    Raises:
        ConfigError: one line naming ``horovodrun``.
    """
    if spec.nodes > 1 and imports_horovod(spec):
        raise ConfigError(
            f"{spec.target} imports Horovod, whose gloo needs the network interface that joins the "
            f"{spec.nodes} hosts, which horovodrun discovers: start it with `horovodrun -np "
            f"{spec.nodes * spec.nproc} -H host1:{spec.nproc},... --gloo python {spec.target}`"
        )


@contextmanager
def horovod_rendezvous(spec: LaunchSpec) -> Iterator[dict[str, str]]:
    """Serve Horovod's rendezvous for the job while it runs; yield the variables every worker needs.

    Nothing (an empty dict) where Horovod is not installed, where the script does not import it
    (``Session(strategy="horovod")`` serves its own), or on several nodes (:func:`check_horovod_hosts`).
    On one node the server listens on loopback while the job runs.

    Args:
        spec: what ``lockstep run`` starts.
    """
    if spec.nodes > 1 or importlib.util.find_spec("horovod") is None or not imports_horovod(spec):
        yield {}
        return
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    from lockstep.strategies.horovod import loopback_rendezvous  # loads torch: only for a Horovod script

    hostname = socket.gethostname()
    plan = get_host_assignments([HostInfo(hostname, spec.nproc)], spec.nproc)
    with loopback_rendezvous(plan) as port:
        yield horovod_variables(port=port, hostname=hostname, size=spec.nproc, local_size=spec.nproc)
