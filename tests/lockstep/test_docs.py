"""The documentation builds and its examples run as written.

A fenced code block is run when an HTML comment directly above it lists how (neither GitHub nor
the site shows the comment)::

    <!-- run: python; lockstep run --nproc 2 -->

    ```python title="train.py"
    ...
    ```

Every such block of ``README.md`` and ``docs/**/*.md`` is saved to a fresh folder and run with each
listed command (``python`` is this interpreter, ``lockstep run ...`` is ``python -m lockstep
run ...``); it must exit with code 0. A block that appears in several places runs once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- run: (?P<commands>.+?) -->\s*$")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    """One runnable code block: where it is, its title, how to run it, its code."""

    where: str
    title: str
    commands: tuple[str, ...]
    code: str


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks_of(path: Path, root: Path = ROOT) -> list[Block]:
    """The marked blocks of one file; a marker inside a fence (an example of one) is text."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    fence, marker, start = "", None, 0
    for number, line in enumerate(lines, 1):
        if fence:
            if line.strip() == fence:
                if marker is not None:
                    blocks.append(
                        Block(
                            f"{path.relative_to(root)}:{start}",
                            _title(lines[start - 1]),
                            marker,
                            "\n".join(lines[start : number - 1]) + "\n",
                        )
                    )
                fence, marker = "", None
            continue
        if found := FENCE.match(line):
            fence, start = found["fence"], number
            if marker is not None:
                assert found["info"].split()[:1] == ["python"], (
                    f"{path.name}:{number}: a run marker above a non-python block"
                )
            continue
        if found := MARKER.match(line):
            marker = tuple(command.strip() for command in found["commands"].split(";"))
        elif line.strip() and marker is not None:
            raise AssertionError(f"{path.name}:{number}: a run marker must be followed by a code block")
    return blocks


def _title(info_line: str) -> str:
    found = re.search(r'title="([^"]+)"', info_line)
    return found[1] if found else ""


def _runnable() -> list[Block]:
    seen: dict[str, Block] = {}
    for path in _doc_files():
        for block in _blocks_of(path):
            seen.setdefault(block.code, block)
    return list(seen.values())


def _argv(command: str, script: Path) -> list[str]:
    """The command as a reader types it, in a shell where the ``.venv`` of ``make install`` is activated."""
    words = shlex.split(command)
    if words != ["python"] and words[:2] != ["lockstep", "run"]:
        raise AssertionError(f"unknown command in a run marker: {command!r} (python, or lockstep run ...)")
    activate = Path(sys.prefix) / "bin" / "activate"
    if not activate.is_file():
        pytest.skip(f"the tests do not run from a virtual environment ({sys.prefix}), so there is none to activate")
    return ["bash", "-c", f"source {shlex.quote(str(activate))} && {command} {shlex.quote(script.name)}"]


def _unactivated_env() -> dict[str, str]:
    """This environment with the virtual environment's ``bin`` off ``PATH``: only ``activate`` puts it back."""
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return {**env, "PATH": path or os.defpath, "OMP_NUM_THREADS": "1"}


def _world(command: str) -> int:
    words = shlex.split(command)
    return int(words[words.index("--nproc") + 1]) if "--nproc" in words else 1


def _check_training(stdout: str, world: int) -> None:
    """The training script of the README and Getting started learns, at the world size asked for."""
    last = re.findall(r"epoch 2: mse ([0-9.]+) over 512 samples", stdout)
    assert last, stdout
    assert float(last[0]) < 1.0  # it learned: the target's variance is 8
    assert f"world {world}" in stdout


CHECKS = {"train.py": _check_training}
CASES = [
    pytest.param(block, command, id=f"{block.title or block.where}-{re.sub(r'[^A-Za-z0-9]+', '-', command).strip('-')}")
    for block in _runnable()
    for command in block.commands
]


def test_readme_has_the_setup_commands_first() -> None:
    text = (ROOT / "README.md").read_text()
    example = text.index("<!-- run: ")
    assert text.index("make demo") < example
    assert text.index("make test") < example
    assert "source .venv/bin/activate" in text and ".venv/bin/" in text
    # a reader who types the commands in order has installed and activated before the first one
    assert text.index("make install") < text.index("source .venv/bin/activate") < text.index("\npython ")
    assert text.index("source .venv/bin/activate") < text.index("\nlockstep ")
    assert len(text.splitlines()) <= 200


def test_the_examples_are_marked() -> None:
    readme = _blocks_of(ROOT / "README.md")
    assert [block.title for block in readme] == ["train.py"]
    assert readme[0].commands == ("python", "lockstep run --nproc 2")
    titles = {block.title for block in _runnable()}
    assert {"train.py", "resume.py"} <= titles, titles


def test_a_marker_inside_a_fence_is_text(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- run: python -->\n\n```python title="a.py"\nprint(1)\n```\n\n'
        "````\n<!-- run: python -->\n\n```python\nprint(2)\n```\n````\n"
    )
    blocks = [(block.title, block.code) for block in _blocks_of(page, root=tmp_path)]
    assert blocks == [("a.py", "print(1)\n")]


def test_readme_links_point_at_files() -> None:
    text = (ROOT / "README.md").read_text()
    targets = {link.split("#")[0] for link in re.findall(r"\]\(([^)]+)\)", text) if "://" not in link}
    assert "docs/index.md" in targets
    missing = sorted(target for target in targets if not (ROOT / target).exists())
    assert not missing, missing


def test_docstrings_read_as_markdown() -> None:
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("the docs extra is not installed (griffe): pip install -e '.[docs]'")
    spec = importlib.util.spec_from_file_location("rst_docstrings", ROOT / "docs" / "rst_docstrings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "See :class:`~lockstep.session.Session` and :func:`helper`.\n\nExample::\n\n    x = 1\n\nAfter."
    assert module.markdown(text).splitlines() == [
        'See <autoref identifier="lockstep.session.Session" optional><code>Session</code></autoref> and `helper`.',
        "",
        "Examples:",
        "    ```python",
        "    x = 1",
        "    ```",
        "",
        "After.",
    ]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("block", "command"), CASES)
def test_runnable_block(tmp_path: Path, block: Block, command: str) -> None:
    script = tmp_path / (block.title or "example.py")
    script.write_text(block.code)
    out = subprocess.run(
        _argv(command, script), capture_output=True, text=True, timeout=140, env=_unactivated_env(), cwd=tmp_path
    )
    assert out.returncode == 0, f"{block.where} under {command}:\n{out.stdout}{out.stderr}"
    if block.title in CHECKS:
        CHECKS[block.title](out.stdout, _world(command))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_docs_build_strict(tmp_path: Path) -> None:
    needed = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    missing = [
        name
        for name in needed
        if importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None
    ]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "session.html").exists()
