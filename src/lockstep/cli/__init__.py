"""cli: the ``lockstep`` command. One module per sub-command (``run``, ``train``, ``bench``,
``verify``, ``doctor``) plus :mod:`~lockstep.cli.main`, which parses and dispatches.

May import: everything (it is the top of the house).

Example::

    lockstep train --nproc 2 --epochs 3
"""
