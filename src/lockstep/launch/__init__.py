"""launch: start the ranks. ``lockstep run`` over torch's elastic agent, and ``spawn()``.

* :mod:`~lockstep.launch.spec`: what to launch (nodes, processes, master), validated up front;
* :mod:`~lockstep.launch.elastic`: drive torch's elastic agent (what ``torchrun`` runs);
* :mod:`~lockstep.launch.torch_agent`: the only overrides of torch's private agent API;
* :mod:`~lockstep.launch.rendezvous`: the in-memory rendezvous of a one-node job (nothing listens);
* :mod:`~lockstep.launch.report`: one failure summary naming the rank, host and cause, and the
  launcher's own lines (restarts, verdict);
* :mod:`~lockstep.launch.output`: relay each rank's output, prefixed with its rank;
* :mod:`~lockstep.launch.horovod`: what ``horovodrun --gloo`` gives a Horovod script's workers;
* :mod:`~lockstep.launch.bootstrap`: the first code every worker runs;
* :mod:`~lockstep.launch.fast_exit`: the launcher's exit without freeing torch, once the job is over;
* :mod:`~lockstep.launch.py_atexit`: the only CPython-private calls (running ``atexit`` handlers early);
* :mod:`~lockstep.launch.relaunch`: start this command again on N processes (train, doctor, verify);
* :mod:`~lockstep.launch.spawn`: ``spawn(fn, nprocs)`` for notebooks and tests.

May import: ``lockstep.errors``, ``lockstep.env``, ``lockstep.comm``.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``lockstep.launch.spawn(fn, nprocs, args=...)`` after a bare ``import lockstep``: loaded on first use."""
    if name == "spawn":
        import importlib

        return importlib.import_module("lockstep.launch.spawn")
    raise AttributeError(f"module 'lockstep.launch' has no attribute {name!r}")
