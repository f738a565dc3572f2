"""Every example in a docstring runs: an ``Example::`` block holds doctest lines, and they pass."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "lockstep"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


WITH_EXAMPLES = sorted(_module_name(p) for p in SRC.rglob("*.py") if ">>> " in p.read_text())


def test_every_example_block_is_a_doctest() -> None:
    loose = []
    for path in SRC.rglob("*.py"):
        if "describe_command(parser, __doc__)" in path.read_text():
            continue  # a command's docstring is its --help text: shell lines, run by the docs' tests
        for match in re.finditer(r"Example[^\n]*::\n\n((?:[ \t]+.*\n|\n)+)", path.read_text()):
            if ">>> " not in match.group(1):
                loose.append(f"{path.relative_to(SRC)}: {match.group(1).strip().splitlines()[0]}")
    assert not loose, "examples that no test runs (write them as doctests):\n" + "\n".join(loose)
    assert WITH_EXAMPLES, "no docstring examples found"


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_pass(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
