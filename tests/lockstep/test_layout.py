"""The package layout is the layering: no cycles, no upward import, small modules, one reader of
the environment. Read from the source with ``ast`` (no import of lockstep needed)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "lockstep"

# lowest first; a module may import its own package and any package of a lower layer.
# Packages on the same layer (the apps) never import each other.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("_cluster",),  # each engine's variables, read from a mapping
    ("env", "_imports"),
    ("comm",),
    ("strategies", "precision"),
    ("data",),
    ("metrics", "loggers"),
    ("checkpoint",),
    ("session",),
    ("launch",),
    ("lockstep",),  # the package's public facade (``import lockstep``)
    ("zoo",),  # models and datasets shared by the apps
    ("recipes", "bench", "verify", "doctor", "integrations"),
    ("cli",),
    ("__main__",),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
# same-layer imports that are allowed (precision and strategies do not know each other)
MAX_TOP_LEVEL_MODULES = 8
MAX_CODE_LINES = 400  # code lines only (STYLE.md): past this, look for a second responsibility


@functools.cache
def _source_stats() -> ModuleType:
    spec = importlib.util.spec_from_file_location("source_stats", SRC.parents[1] / "tools" / "source_stats.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def _code_lines(path: Path) -> int:
    return int(_source_stats().count(path.read_text()).code)


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every ``lockstep`` module ``name`` imports, TYPE_CHECKING blocks and function bodies included."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("lockstep"):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lockstep"))
    out.discard(name)
    return out


def _group(module: str) -> str:
    """The layer unit of a module: its first package under lockstep, or ``lockstep`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lockstep"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_every_package_has_a_layer(graph: dict[str, set[str]]) -> None:
    missing = sorted({_group(m) for m in graph} - set(LAYER_OF))
    assert not missing, f"packages without a layer in this test: {missing}"


def test_no_upward_or_sideways_import(graph: dict[str, set[str]]) -> None:
    bad = []
    for module, deps in graph.items():
        mine = _group(module)
        for dep in deps:
            theirs = _group(dep)
            if theirs == mine:
                continue
            if LAYER_OF[theirs] >= LAYER_OF[mine]:
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports that reach up or sideways:\n" + "\n".join(sorted(bad))


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    # a package's __init__ re-exporting its own modules is the package's face, not a cycle
    packages = {m for m, path in _modules().items() if path.name == "__init__.py"}
    edges = {
        m: {d for d in deps if d in graph and not (m in packages and d.startswith(m + "."))}
        for m, deps in graph.items()
    }
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in edges.get(node, ()):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_few_top_level_modules_and_none_large() -> None:
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    large = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := _code_lines(p)) > MAX_CODE_LINES}
    assert not large, f"modules over {MAX_CODE_LINES} code lines: {large}"


def test_every_package_says_its_job() -> None:
    for init in SRC.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(SRC)} has no docstring"


def test_environment_is_read_in_env_only() -> None:
    readers = []
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        if rel == "env.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "os.environ" in code or "os.getenv" in code:
                readers.append(f"{rel}:{number}: {line.strip()}")
    # the launcher writes the workers' environment (and the worker its own, before the script runs)
    allowed_writers = ("launch/elastic.py", "launch/spawn.py", "launch/spec.py")
    reads = [r for r in readers if not r.startswith(allowed_writers)]
    assert not reads, "the environment is read outside env.py:\n" + "\n".join(reads)
