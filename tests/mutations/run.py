"""Plant each bug in tests/mutations/*.patch in a copy of the tree and check its tests catch it.

    make test-mutations                                   # every mutation, one after another
    python tests/mutations/run.py own_share_no_copy       # some of them, by name
    python tests/mutations/run.py --check                 # only: does every patch still apply?
    python tests/mutations/run.py --baseline NAME         # also run its tests unpatched (must pass)

Each patch is a small unified diff against ``src/`` with a header naming the guarantee it breaks
and the tests that must catch it::

    Guarantee: a non-blocking save writes the state as it was at the save
    Bug: own_share keeps the live CPU tensors instead of copies
    Tests: tests/checkpoint/test_background.py::test_...[ddp]

For each one the tracked and untracked (not ignored) files of the repository are copied to a
temporary folder, the patch is applied there (``git apply``), and the named tests run in that
copy (``PYTHONPATH`` = the copy's ``src``). A mutation is *caught* when pytest reports a failed
test, *missed* when every named test passed, and an *error* when the patch no longer applies,
the tests were skipped or not collected, or pytest could not run. Prints one line per mutation
and the total; exits 1 unless every mutation was caught.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TIMEOUT = 900  # seconds for one mutation's tests


@dataclass(frozen=True)
class Mutation:
    """One planted bug: its file, the guarantee it breaks, the bug, the tests that must catch it."""

    name: str
    path: Path
    guarantee: str
    bug: str
    tests: tuple[str, ...]


def load(path: Path) -> Mutation:
    """Read a patch's header (``Guarantee:``, ``Bug:``, ``Tests:`` lines before the diff)."""
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("diff --git"):
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Guarantee", "Bug", "Tests"):
            fields[key] = value.strip()
    missing = [k for k in ("Guarantee", "Bug", "Tests") if not fields.get(k)]
    if missing:
        raise ValueError(f"{path.name}: the header lacks {', '.join(missing)}")
    return Mutation(path.stem, path, fields["Guarantee"], fields["Bug"], tuple(fields["Tests"].split()))


def mutations(names: list[str] | None = None) -> list[Mutation]:
    """The mutations in this folder (those named, in that order, when ``names`` is given)."""
    found = {p.stem: p for p in sorted(HERE.glob("*.patch"))}
    unknown = [n for n in names or [] if n not in found]
    if unknown:
        raise SystemExit(f"no such mutation: {', '.join(unknown)} (have: {', '.join(found)})")
    return [load(found[n]) for n in (names or list(found))]


def applies(mutation: Mutation, tree: Path = ROOT) -> str:
    """'' when the patch applies cleanly to ``tree``; else git's complaint."""
    proc = subprocess.run(["git", "apply", "--check", str(mutation.path)], cwd=tree, capture_output=True, text=True)
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"git apply exited {proc.returncode}")


def copy_tree(dest: Path) -> None:
    """The repository's tracked and untracked (not ignored) files, as they are now, into ``dest``."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[str, str]:
    """Run ``tests`` in ``tree``; ('caught' | 'missed' | 'error', what failed or why)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", *tests]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return "error", f"the tests ran past {TIMEOUT} s"
    out = proc.stdout + proc.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)
    if proc.returncode == 1 and failed:
        return "caught", " ".join(t.split("::", 1)[-1] for t in failed)
    if proc.returncode == 0:
        if re.search(r"\b\d+ passed\b", out):
            return "missed", "every named test passed"
        return "error", "the named tests were skipped: " + (out.strip().splitlines() or ["?"])[-1]
    return "error", f"pytest exited {proc.returncode}: " + (out.strip().splitlines() or ["?"])[-1]


def try_one(mutation: Mutation, baseline: bool) -> tuple[str, str]:
    """Copy the tree, (optionally check the tests pass unpatched,) plant the bug, run its tests."""
    with tempfile.TemporaryDirectory(prefix=f"lockstep-mutation-{mutation.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        if baseline:
            outcome, why = run_tests(tree, mutation.tests)
            if outcome != "missed":
                return "error", f"unpatched: {outcome}: {why}"
        problem = applies(mutation, tree)
        if problem:
            return "error", f"the patch no longer applies: {problem.splitlines()[0]}"
        subprocess.run(["git", "apply", str(mutation.path)], cwd=tree, check=True, capture_output=True)
        return run_tests(tree, mutation.tests)


def main(argv: list[str] | None = None) -> int:
    """Run the mutations named on the command line (all by default); 0 when every one was caught."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (file names without .patch)")
    parser.add_argument("--check", action="store_true", help="only check that every patch applies")
    parser.add_argument("--baseline", action="store_true", help="first run the tests without the patch")
    args = parser.parse_args(argv)
    chosen = mutations(args.names)
    if args.check:
        bad = [(m.name, p) for m in chosen if (p := applies(m))]
        for name, problem in bad:
            print(f"{name}: does not apply: {problem.splitlines()[0]}")
        print(f"{len(chosen) - len(bad)} of {len(chosen)} mutations apply")
        return 1 if bad else 0
    counts: dict[str, int] = {"caught": 0, "missed": 0, "error": 0}
    start = time.monotonic()
    for mutation in chosen:
        began = time.monotonic()
        outcome, why = try_one(mutation, args.baseline)
        counts[outcome] += 1
        print(f"{outcome.upper():7} {mutation.name:28} {time.monotonic() - began:5.0f} s  {why}", flush=True)
    print(
        f"{len(chosen)} mutations: {counts['caught']} caught, {counts['missed']} missed, "
        f"{counts['error']} errors ({time.monotonic() - start:.0f} s)"
    )
    return 0 if counts["caught"] == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
