"""No private torch or CPython API outside the shim modules (read from the source with ``ast``).

A private API is a name starting with ``_`` (not a dunder) that lockstep does not define: an
attribute of an imported module (``torch._amp_foreach...``, ``sys._current_frames``), an import
from a private module (``torch._dynamo``) or of a private name, a ``getattr`` of one by string,
and, in a class built on a class lockstep does not own, ``super()._x``, an override of a private
method or a private attribute the base class sets. Each shim module holds such uses for one layer
and has its version test in ``tests/lockstep/test_shims.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src" / "lockstep"

SHIMS = {
    "launch/torch_agent.py",  # torch's elastic agent
    "launch/py_atexit.py",  # atexit._run_exitfuncs, atexit._ncallbacks
    "comm/py_frames.py",  # sys._current_frames
    "precision/torch_amp.py",  # the fused unscale-and-check kernel, Tensor._version, BatchNorm classes
    "strategies/torch_internals.py",  # DDP's reducer, PowerSGD's rule, torch.compile, autograd engine
    "checkpoint/torch_dcp.py",  # torch.distributed.checkpoint._traverse
    "cli/py_argparse.py",  # ArgumentParser._actions
}
# documented public names that start with "_": os._exit, and namedtuple's methods
PUBLIC = {("os", "_exit"), ("*", "_fields"), ("*", "_asdict"), ("*", "_replace"), ("*", "_make")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(SRC)): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def _own_names(trees: dict[str, ast.Module]) -> tuple[set[str], set[str]]:
    """Private names lockstep defines anywhere (defs, assignments), and lockstep's class names."""
    names, classes = set(), set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    classes.add(node.name)
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                targets = [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        names.add(sub.id)
    return {n for n in names if _private(n)}, classes


def _bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted path, for every import of something outside lockstep."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lockstep":
                    continue
                if alias.asname:
                    out[alias.asname] = alias.name  # import torch.nn as nn
                else:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]  # import torch.nn binds torch
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] != "lockstep":
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(node: ast.expr) -> tuple[str, list[str]] | None:
    """``a.b.c`` as ("a", ["b", "c"]); None for anything but names and attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    return (node.id, attrs) if isinstance(node, ast.Name) else None


def _resolve(base: ast.expr, bindings: dict[str, str]) -> Any:
    """The class a base expression names, imported; None when it cannot be told from the source."""
    if isinstance(base, ast.Subscript):  # Sampler[int]
        base = base.value
    dotted = _dotted(base)
    if dotted is None or dotted[0] not in bindings:
        return None
    parts = bindings[dotted[0]].split(".") + dotted[1]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _base_has(bases: list[Any], name: str) -> bool:
    """Whether a foreign base class defines ``name`` (as a class attribute or as ``self.name`` in its source)."""
    for base in bases:
        for cls in inspect.getmro(base):
            if cls is object or cls.__module__.split(".")[0] == "lockstep":
                continue
            if name in vars(cls):
                return True
            try:
                if f"self.{name}" in inspect.getsource(cls):
                    return True
            except (OSError, TypeError):
                continue
    return False


def _class_findings(node: ast.ClassDef, bindings: dict[str, str], classes: set[str]) -> list[tuple[int, str]]:
    """Private uses of a foreign base class inside ``node``: super() calls, overrides, attributes."""
    foreign = [b for b in node.bases if not ((d := _dotted(b)) and (d[1] or [d[0]])[-1] in classes)]
    foreign = [b for b in foreign if not (isinstance(b, ast.Name) and b.id in ("object", "Generic", "Protocol"))]
    if not foreign:
        return []
    resolved = [_resolve(b, bindings) for b in foreign]
    unknown = any(r is None or not inspect.isclass(r) for r in resolved)
    bases = [r for r in resolved if inspect.isclass(r)]
    found = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
            if unknown or _base_has(bases, item.name):
                found.append((item.lineno, f"overrides {item.name}"))
    for sub in ast.walk(node):
        if not (isinstance(sub, ast.Attribute) and _private(sub.attr)):
            continue
        value = sub.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            found.append((sub.lineno, f"super().{sub.attr}"))
        elif isinstance(value, ast.Name) and value.id == "self" and (unknown or _base_has(bases, sub.attr)):
            found.append((sub.lineno, f"self.{sub.attr} of the base class"))
    return found


def _findings(tree: ast.Module, own: set[str], classes: set[str]) -> list[tuple[int, str]]:
    bindings = _bindings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (isinstance(node, ast.ImportFrom) and node.level):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names]
            paths = ([module] if module else []) + ([] if module else names)
            if any(p.split(".")[0] == "lockstep" for p in paths):
                continue
            if any(_private(part) for p in paths for part in p.split(".")) or (module and any(map(_private, names))):
                found.append((node.lineno, f"import of {module or ''} {names}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node)
            root = bindings.get(dotted[0], "").split(".")[0] if dotted else ""
            if (root, node.attr) in PUBLIC or ("*", node.attr) in PUBLIC:
                continue
            if root or node.attr not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
            and ("*", node.args[1].value) not in PUBLIC
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ClassDef):
            found += _class_findings(node, bindings, classes)
    return found


def test_no_private_torch_or_python_api_outside_the_shims() -> None:
    trees = _trees()
    own, classes = _own_names(trees)
    bad = [
        f"{path}:{line}: {what}"
        for path, tree in trees.items()
        if path not in SHIMS
        for line, what in _findings(tree, own, classes)
    ]
    assert not bad, (
        "private torch/CPython API used outside the shim modules; move it behind a function of "
        "the layer's shim (" + ", ".join(sorted(SHIMS)) + ") with a version test in "
        "tests/lockstep/test_shims.py:\n  " + "\n  ".join(bad)
    )


def test_the_check_sees_private_uses() -> None:
    """The scanner finds each kind of private use (so an empty result above means something)."""
    source = """
import sys, atexit, torch
from torch._dynamo.utils import counters
from torch.nn.modules.batchnorm import _BatchNorm
from torch.amp import GradScaler
class S(GradScaler):
    def _unscale_grads_(self, *a):
        return super()._unscale_grads_(*a)
    def scale_now(self):
        return self._scale
sys._current_frames()
torch.autograd.Variable._execution_engine
getattr(atexit, "_run_exitfuncs")
model._orig_mod
"""
    found = " | ".join(what for _, what in _findings(ast.parse(source), {"_own"}, set()))
    for expected in (
        "torch._dynamo.utils",
        "_BatchNorm",
        "overrides _unscale_grads_",
        "super()._unscale_grads_",
        "self._scale of the base class",
        "sys._current_frames",
        "_execution_engine",
        "_run_exitfuncs",
        "model._orig_mod",
    ):
        assert expected in found, (expected, found)
    harmless = "import os\nos._exit(0)\nclass A:\n    def _x(self):\n        return self._own\nt._fields\n"
    assert _findings(ast.parse(harmless), {"_own", "_x"}, {"A"}) == []


def test_every_shim_exists_and_has_a_version_test() -> None:
    tests = ast.parse((Path(__file__).parent / "test_shims.py").read_text())
    imported = {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tests)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    used = {node.id for node in ast.walk(tests) if isinstance(node, ast.Name)}
    for shim in SHIMS:
        assert (SRC / shim).is_file(), shim
        module = "lockstep." + shim[:-3].replace("/", ".")
        assert module in imported and module.rsplit(".", 1)[1] in used, (
            f"{module} has no version test in tests/lockstep/test_shims.py"
        )
