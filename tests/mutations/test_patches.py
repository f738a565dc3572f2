"""The planted bugs of ``make test-mutations`` (tests/mutations/*.patch) still apply to the source
and name tests that exist, so they cannot rot unnoticed. Running them is ``make test-mutations``'s
job (minutes); this only checks them (``git apply --check``, a second)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_runner", HERE / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patches")
def test_every_mutation_applies_and_names_existing_tests() -> None:
    run = _runner()
    found = run.mutations()
    assert len(found) >= 15
    for mutation in found:
        assert run.applies(mutation) == "", f"{mutation.name}.patch no longer applies: re-base it on the source"
        assert "+++ b/src/" in mutation.path.read_text(), f"{mutation.name}: a mutation changes src/ only"
        for test in mutation.tests:
            file, _, name = test.partition("::")
            assert (run.ROOT / file).is_file(), f"{mutation.name}: no test file {file}"
            assert f"def {name.split('[')[0]}(" in (run.ROOT / file).read_text(), f"{mutation.name}: no test {test}"
