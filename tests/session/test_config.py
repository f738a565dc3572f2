"""One configuration, validated once: every entry point builds a ``SessionConfig`` and refuses alike.

A bad value given to ``lockstep.Session(...)``, to ``lockstep train``, ``bench`` or ``verify``
(their flags parsed and turned into their configs, no process started) is refused by exactly
one check, with the same message. A layout test reads the source: every ``ConfigError`` message
that refuses an option (names it first) lives in the one module :data:`lockstep.session.config.OWNERS`
gives it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.errors import ConfigError
from lockstep.session.config import OPTION_NAMES, OWNERS, SessionConfig

SRC = Path(lockstep.__file__).parent


# -- every entry point -------------------------------------------------------------------------------


def _parse(module: Any, argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.config_from_args(parser.parse_args(argv))


def _train(*argv: str) -> Any:
    from lockstep.cli import train

    return _parse(train, ["--nproc", "1", *argv])


def _bench(*argv: str) -> Any:
    from lockstep.cli import bench

    return _parse(bench, ["--nproc", "1,2", *argv])


def _verify(*argv: str) -> Any:
    from lockstep.cli import verify

    return _parse(verify, ["--model", "convnet", *argv])


def _session(**options: Any) -> Any:
    return lockstep.Session(quiet=True, **options)


class _Count:
    """Counts the ConfigErrors built while an entry point runs: one bad value, one refusal."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made = 0
        real = ConfigError.__init__

        def counting(error: ConfigError, *args: Any, **kwargs: Any) -> None:
            self.made += 1
            real(error, *args, **kwargs)

        monkeypatch.setattr(ConfigError, "__init__", counting)

    def refusal(self, build: Callable[[], Any]) -> str:
        self.made = 0
        with pytest.raises(ConfigError) as info:
            build()
        assert self.made == 1, f"{self.made} checks refused it"
        assert not torch.distributed.is_initialized()  # refused before any process group
        return str(info.value)


_BAD = {  # option: (the Session's keywords, then the same bad value as each app's flags; None: no such flag)
    "strategy": ({"strategy": "zero3"}, ["--strategy", "zero3"], ["--strategies", "zero3"], ["--strategy", "zero3"]),
    "precision": ({"precision": "fp8"}, ["--precision", "fp8"], ["--precision", "fp8"], ["--precision", "fp8"]),
    "grad_compression": (
        {"strategy": "ddp", "grad_compression": "int8"},
        ["--grad-compression", "int8"],
        ["--strategies", "ddp+int8"],
        ["--grad-compression", "int8"],
    ),
    "grad_compression outside ddp": (
        {"strategy": "fsdp", "grad_compression": "fp16"},
        ["--strategy", "fsdp", "--grad-compression", "fp16"],
        ["--strategies", "fsdp+fp16"],
        ["--strategy", "fsdp", "--grad-compression", "fp16"],
    ),
    "powersgd_rank": (
        {"strategy": "ddp", "grad_compression": "powersgd", "strategy_options": {"powersgd_rank": 0}},
        ["--grad-compression", "powersgd", "--powersgd-rank", "0"],
        None,
        ["--grad-compression", "powersgd", "--powersgd-rank", "0"],
    ),
    "sync_bn": ({"sync_bn": True}, ["--sync-bn"], None, ["--sync-bn"]),
    "accumulate": ({"accumulate": 0}, ["--accumulate", "0"], None, ["--accumulate", "0"]),
    "timeout": ({"timeout": -1.0}, ["--timeout", "-1"], None, ["--timeout", "-1"]),
    "nonfinite": ({"nonfinite": "maybe"}, None, ["--nonfinite", "maybe"], None),
}


@pytest.mark.parametrize("option", list(_BAD))
def test_each_bad_value_is_refused_once_with_one_message(option: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # sync_bn's refusal is for CPU ranks
    monkeypatch.delenv("LOCKSTEP_TIMEOUT", raising=False)
    count = _Count(monkeypatch)
    keywords, train, bench, verify = _BAD[option]
    message = count.refusal(lambda: SessionConfig(**keywords))
    assert count.refusal(lambda: _session(**keywords)) == message
    for build, argv in ((_train, train), (_bench, bench), (_verify, verify)):
        if argv is not None:
            assert count.refusal(lambda: build(*argv)) == message, (build.__name__, argv)  # noqa: B023 (called at once)


def test_every_entry_point_builds_the_same_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKSTEP_TIMEOUT", raising=False)
    flags = [
        "--strategy",
        "DDP",
        "--precision",
        "O1",
        "--accumulate",
        "2",
        "--seed",
        "3",
        "--timeout",
        "30",
        "--grad-compression",
        "PowerSGD",
        "--powersgd-rank",
        "2",
        "--compile",
        "aot_eager",
    ]
    expected = SessionConfig(
        strategy="ddp",
        precision="fp16-mixed",
        accumulate=2,
        seed=3,
        timeout=30,
        grad_compression="powersgd",
        quiet=True,
        compile={"backend": "aot_eager"},
        strategy_options={"powersgd_rank": 2, "powersgd_start_iter": 10},
    )
    assert _train(*flags).session_config().resolved == expected.resolved
    assert (
        _verify(*flags).session_config().resolved
        == SessionConfig(
            **{**vars_of(expected), "strategy_options": {"powersgd_rank": 2, "powersgd_start_iter": 2}}
        ).resolved
    )
    bench = _bench("--strategies", "ddp+powersgd,fsdp", "--precision", "O1,bf16-mixed", "--compile", "none,aot_eager")
    cells = bench.cell_configs()
    assert len(cells) == 8  # every strategy x precision x compile, each a SessionConfig checked up front
    cell = cells[("ddp+powersgd", "fp16-mixed", "aot_eager")]
    assert (cell.strategy, cell.grad_compression, cell.compile) == ("ddp", "powersgd", {"backend": "aot_eager"})
    assert cell.strategy_options == {"powersgd_rank": 1, "powersgd_start_iter": 2}  # PowerSGD from step 2


def vars_of(config: SessionConfig) -> dict[str, Any]:
    """The fields of ``config`` as keywords that build it again."""
    return {name: getattr(config, name) for name in OPTION_NAMES}


def test_session_construction_runs_each_check_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import lockstep.comm.group
    import lockstep.comm.store
    import lockstep.precision
    import lockstep.strategies
    import lockstep.strategies.comm_hooks
    import lockstep.strategies.compile

    calls: dict[str, int] = {}
    for module, name in (
        (lockstep.comm.group, "pick_backend"),
        (lockstep.comm.store, "resolve_timeout"),
        (lockstep.precision, "check_precision"),
        (lockstep.precision, "get_precision"),
        (lockstep.strategies, "check_strategy"),
        (lockstep.strategies.comm_hooks, "check_grad_compression"),
        (lockstep.strategies.compile, "check_compile"),
    ):
        real = getattr(module, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    session = lockstep.Session(
        strategy="ddp",
        precision="bf16-mixed",
        grad_compression="fp16",
        timeout=30,
        compile={"backend": "eager"},
        quiet=True,
    )
    session.close()
    assert calls == {
        "pick_backend": 1,
        "resolve_timeout": 1,
        "check_precision": 1,
        "check_strategy": 1,
        "check_grad_compression": 1,
        "check_compile": 1,
    }  # get_precision: the plugin built once


def test_session_takes_a_config_or_keywords_never_both() -> None:
    config = SessionConfig(strategy="single", accumulate=2, quiet=True)
    for session in (lockstep.Session(config=config), lockstep.Session.from_config(config)):
        assert session.config is config and session.accumulate == 2 and session.strategy.name == "single"
        session.close()
    with pytest.raises(ConfigError, match="accumulate were given too"):
        lockstep.Session(config=config, accumulate=3)


def test_values_are_kept_in_their_canonical_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_TIMEOUT", "45")
    given = SessionConfig(strategy=" FSDP", precision="o2", compile=True)
    assert (given.strategy, given.precision, given.compile) == (" FSDP", "o2", True)  # the user's values, untouched
    config = given.resolved
    assert (config.strategy, config.precision, config.grad_compression) == ("fsdp", "fp16-o2", "none")
    assert config.timeout == timedelta(seconds=45) and config.backend in ("gloo", "nccl") and config.compile == {}
    assert dataclasses.replace(given, seed=1).resolved.strategy == "fsdp"  # a copy resolves its own values
    for frozen in (given, config):
        with pytest.raises(dataclasses_frozen()):
            frozen.strategy = "ddp"  # type: ignore[misc]


def dataclasses_frozen() -> type[Exception]:
    """The error assigning a field of a frozen dataclass raises."""
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "keywords, text",
    [
        ({"clip_grad_norm": 0.0}, "clip_grad_norm=0.0 must be a positive, finite number"),
        ({"clip_grad_norm": float("inf")}, "clip_grad_norm=inf must be a positive, finite number"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm=nan must be a positive, finite number"),
        ({"clip_grad_norm": True}, "clip_grad_norm=True must be a positive, finite number"),
        ({"accumulate": 1.5}, "accumulate=1.5 (--accumulate) must be an integer >= 1"),
        ({"seed": "7"}, "seed='7' (--seed) must be an integer"),
        ({"sync_bn": 1}, "sync_bn=1 (--sync-bn) must be True or False"),
        ({"quiet": "yes"}, "quiet='yes' must be True or False"),
        ({"preempt_check_seconds": float("inf")}, "preempt_check_seconds=inf must be a positive, finite number"),
        ({"init_method": "localhost:29500"}, "init_method='localhost:29500' must be a URL"),
        ({"strategy_options": [1]}, "strategy_options=[1] must be a dict"),
        ({"backend": "mpich"}, "unknown backend 'mpich'"),
        ({"timeout": float("nan")}, "timeout=nan (--timeout) must be a positive number of seconds"),
        ({"compile": "yes"}, "compile must be True, False or a dict"),
        ({"strategy": "dp", "sync_bn": True}, "sync_bn=True (--sync-bn) needs strategy 'ddp' or 'fsdp'"),
    ],
)
def test_session_config_refusals_name_the_option(
    keywords: dict[str, Any], text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # sync_bn's own CPU refusal aside
    with pytest.raises(ConfigError, match=re.escape(text)):
        SessionConfig(**keywords)


def test_dp_with_several_processes_is_refused_by_the_processes_check() -> None:
    SessionConfig(strategy="dp").resolved.check_processes(1)
    with pytest.raises(ConfigError, match=re.escape("strategy='dp' (--strategy) drives every GPU from one process")):
        SessionConfig(strategy="dp").resolved.check_processes(2)


# -- the layout: one module refuses each option ------------------------------------------------------


def _patterns(option: str) -> list[str]:
    """How a message names an option: ``name=value``, ``--flag``, ``unknown name``, ``name must``;
    a name with an underscore is distinctive enough to count anywhere."""
    flag = "--" + option.replace("_", "-")
    found = [
        rf"(?<![\w-]){option}=",
        rf"(?<![\w-]){re.escape(flag)}(?![\w-])",
        rf"\bunknown {option}\b",
        rf"(?<![\w-]){option} must\b",
    ]
    return found + ([rf"(?<![\w-]){option}(?![\w-])"] if "_" in option else [])


def _error_names(trees: dict[str, ast.Module]) -> set[str]:
    """ConfigError and every class the sources derive from it (HorovodUnavailableError...)."""
    names = {"ConfigError"}
    grew = True
    while grew:
        grew = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ClassDef)
                    and node.name not in names
                    and any(isinstance(b, ast.Name) and b.id in names for b in node.bases)
                ):
                    names.add(node.name)
                    grew = True
    return names


def _text(node: ast.AST, strings: dict[str, list[str]]) -> str:
    """The literal text of a message: constants as written, ``_given('x', ...)`` as ``x=``, a local
    string variable as the strings assigned to it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(part, strings) for part in node.values)
    if isinstance(node, ast.FormattedValue):
        value = node.value
        if (
            isinstance(value, ast.Call)
            and value.args
            and isinstance(value.args[0], ast.Constant)
            and isinstance(value.args[0].value, str)
        ):
            return f"{value.args[0].value}="
        if isinstance(value, ast.Name):
            return " | ".join(strings.get(value.id, ["{}"]))
        return "{}"
    if isinstance(node, ast.BinOp):
        return _text(node.left, strings) + _text(node.right, strings)
    return ""


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a module or function, without those of the functions defined inside it."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _own_nodes(child)


def _messages(tree: ast.Module, errors: set[str]) -> Iterator[str]:
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        strings: dict[str, list[str]] = {}
        for node in _own_nodes(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                text = _text(node.value, {})
                if text:
                    strings.setdefault(node.targets[0].id, []).append(text)
        for node in _own_nodes(scope):
            if (
                isinstance(node, ast.Call)
                and node.args
                and (
                    isinstance(node.func, ast.Name)
                    and node.func.id in errors
                    or isinstance(node.func, ast.Attribute)
                    and node.func.attr in errors
                )
            ):
                yield _text(node.args[0], strings)


def _refusals() -> dict[str, set[str]]:
    """Option -> the modules with a ConfigError message that refuses it."""
    trees = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        trees[module] = ast.parse(path.read_text(), str(path))
    errors = _error_names(trees)
    found: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for message in _messages(tree, errors):
            option = _subject(message)
            if option is not None:
                found.setdefault(option, set()).add(module)
    return found


def _subject(message: str) -> str | None:
    """The option a message refuses: the first it names (others it names are the fix, as in
    "grad_compression='powersgd' on gloo needs one bucket; drop bucket_cap_mb")."""
    first = {}
    for option in OWNERS:
        starts = [m.start() for p in _patterns(option) for m in re.finditer(p, message)]
        if starts:
            first[option] = min(starts)
    return min(first, key=lambda o: (first[o], -len(o))) if first else None


# A rule about the state an option meets at run time, not about its value: the option's owner
# cannot know it, so the module that meets the state refuses it.
_RUNTIME_RULES = {
    ("shard_optimizer", "lockstep.strategies.zero"): "the optimizer already holds state at setup",
    # verify's own --global-batch (the batch both of its runs train on), not the Session's
    ("global_batch", "lockstep.verify.config"): "verify splits its batch evenly over the processes",
    ("global_batch", "lockstep.verify.inputs"): "the dataset holds fewer samples than verify's batch",
    # bench --project's own inputs: the ways of training it models and PowerSGD's rank in its cost
    # model; no Session is built from them
    ("strategy", "lockstep.bench.project"): "--project models ddp+bf16, ddp+powersgd..., not Session strategies",
    ("powersgd_rank", "lockstep.cli.bench"): "--project's PowerSGD rank is a cost-model input",
}


def test_no_option_is_refused_in_two_modules() -> None:
    found = _refusals()
    assert {
        "strategy",
        "precision",
        "sync_bn",
        "accumulate",
        "clip_grad_norm",
        "grad_compression",
        "timeout",
        "nonfinite",
        "preemption",
        "max_norm",
    } <= set(found)  # the scan sees the checks it is about
    stray = {
        option: sorted(m for m in modules if m != OWNERS[option] and (option, m) not in _RUNTIME_RULES)
        for option, modules in found.items()
    }
    assert {option: modules for option, modules in stray.items() if modules} == {}


def test_the_scan_would_see_a_second_check() -> None:
    tree = ast.parse('def f(x):\n    raise ConfigError(f"grad_compression={x!r} is unknown")\n')
    assert list(_messages(tree, {"ConfigError"})) == ["grad_compression={} is unknown"]
    tree = ast.parse('def f(x):\n    source = "timeout (--timeout)"\n    raise ConfigError(f"{source} must be > 0")\n')
    [message] = _messages(tree, {"ConfigError"})
    assert _subject(message) == "timeout"
    assert _subject("grad_compression='powersgd' needs one bucket; drop bucket_cap_mb") == "grad_compression"
    assert _subject("unknown strategy 'x'") == "strategy" and _subject("--sync-bn needs GPUs") == "sync_bn"
    assert _subject("strategy 'fsdp' has no option 'x'") is None  # the strategy's options, not the option itself


def test_grad_compression_has_one_spelling() -> None:
    with pytest.raises(ConfigError, match=r"pass it as grad_compression=\.\.\., and keep PowerSGD's knobs"):
        SessionConfig("ddp", strategy_options={"grad_compression": "powersgd"})
    options = SessionConfig("ddp", grad_compression="PowerSGD", strategy_options={"powersgd_rank": 2}).resolved
    assert options.strategy_kwargs(2) == {"powersgd_rank": 2, "grad_compression": "powersgd"}
