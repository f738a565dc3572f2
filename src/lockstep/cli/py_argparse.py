"""The one private argparse name the CLI layer reads: a parser's list of actions.

argparse offers no public way to list the flags a parser was given; ``parser._actions`` is where
every argparse version keeps them (``format_help`` only prints them). The flag table
(:mod:`lockstep.cli.reference`) reads them through :func:`parser_actions`, so a Python that changes
it breaks this module and its version test (``tests/lockstep/test_shims.py``). Checked on CPython 3.11.
"""

from __future__ import annotations

import argparse

__all__ = ["parser_actions"]


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action (flag or positional) ``parser`` was given, in order, ``-h/--help`` included.

    Args:
        parser: an ``argparse.ArgumentParser``.
    """
    return list(parser._actions)
