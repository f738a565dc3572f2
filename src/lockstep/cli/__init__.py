"""cli: the ``lockstep`` command.

* :mod:`~lockstep.cli.main`: parses ``lockstep [--version] COMMAND ...`` and dispatches;
* :mod:`~lockstep.cli.flags`: the launch flags of ``lockstep run`` (``--nproc``, ``--nodes``,
  ``--node-rank``, ``--master``...), declared once for every command that starts processes;
* one module per sub-command, each with ``add_arguments(parser)`` and ``main(args)``:
  :mod:`~lockstep.cli.run`, :mod:`~lockstep.cli.train`, :mod:`~lockstep.cli.bench`,
  :mod:`~lockstep.cli.verify`, :mod:`~lockstep.cli.doctor`.

May import: everything (it is the top of the house).
"""
