"""Subcommands of the ``lockstep`` CLI; each module has ``add_arguments`` and ``main``."""
