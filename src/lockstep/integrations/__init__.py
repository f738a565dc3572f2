"""Bridges between lockstep and frameworks that start and manage the training processes.

Each bridge is a module that imports its framework only when one of its functions is called, so
``import lockstep`` (and ``import lockstep.integrations``) never needs the framework installed:

* :mod:`lockstep.integrations.ray`: a :class:`~lockstep.Session` inside a Ray Train worker
  (``TorchTrainer``'s ``train_loop_per_worker``), adopting the process group and device Ray set
  up, with lockstep checkpoints reported to Ray and resumed from Ray's latest one
  (``pip install 'lockstep[ray]'``).
"""

from __future__ import annotations

__all__: list[str] = []
