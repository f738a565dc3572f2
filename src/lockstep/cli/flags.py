"""The launch flags of ``lockstep run``, declared once for every command that starts processes.

``run``, ``train``, ``bench``, ``verify`` and ``doctor`` take the same ``--nproc``, ``--nodes``,
``--node-rank``, ``--master``... with the same meaning, type and default; each command offers
only the flags it honours. ``--nproc`` defaults to one process per GPU, or 2 on a machine
without GPUs, in every command (``bench`` sweeps 1, 2, 4... up to that count): a data-parallel
command uses every device unless told otherwise, and runs parallel on a CPU machine too.

The Session's options that the apps take as flags (``--strategy``, ``--precision``,
``--accumulate``...) are declared once too, from :class:`~lockstep.SessionConfig`
(:func:`add_session_flags`): each app gives its own default and says what the option applies to
(``lockstep verify``: the parallel run), never its own spelling, type or help.

An old spelling of a flag stays accepted through :func:`add_deprecated`: hidden from the help,
it sets the same value and leaves one deprecation line (:func:`deprecation_notes`).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "describe_command",
    "add_launch_flags",
    "add_session_flags",
    "SESSION_FLAGS",
    "launch_options",
    "value_flags",
    "flag_strings",
    "split_at_target",
    "add_deprecated",
    "deprecation_notes",
    "DeprecatedFlag",
    "LAUNCH_FLAGS",
    "PLACEMENT_FLAGS",
    "NPROC_PER_GPU",
]

LAUNCH_FLAGS = (
    "nproc",
    "nodes",
    "node_rank",
    "master",
    "max_restarts",
    "join_timeout",
    "timeout",
    "grace",
    "secret_file",
    "rank0_only",
    "local_rank_arg",
    "log_dir",
    "verbose",
)
"""Every launch flag of ``lockstep run``, by its destination name."""
PLACEMENT_FLAGS = ("nproc", "nodes", "node_rank", "master")
"""Where the processes run: the flags of a command that starts a job over several nodes."""
NPROC_PER_GPU = "one per GPU, or 2 without GPUs"
"""The ``--nproc`` default of every command (:func:`lockstep.launch.relaunch.default_nproc`)."""

_NPROC = (
    "processes on this node: a number, one per GPU (gpu), one per CPU (cpu), or gpu if there are GPUs else cpu (auto)"
)
_NPROC_LIST = "comma-separated process counts, each a number or auto, gpu, cpu (see lockstep run --nproc)"

_DECLARATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "nodes": (
        "--nodes",
        dict(
            default=None,
            metavar="N|MIN:MAX",
            help="number of nodes (default 1{slurm}); MIN:MAX lets nodes leave and join "
            "while the job runs (needs --master and --secret-file)",
        ),
    ),
    "node_rank": (
        "--node-rank",
        dict(type=int, default=None, metavar="I", help="index of this node, 0 hosts the store"),
    ),
    "master": (
        "--master",
        dict(
            default=None,
            metavar="HOST:PORT",
            help="node 0's address and a free port, the same on every node (needed for "
            "--nodes > 1; on one node a free port is picked when omitted)",
        ),
    ),
    "max_restarts": (
        "--max-restarts",
        dict(
            type=int, default=0, metavar="K", help="restart the whole group up to K times after a failure (default 0)"
        ),
    ),
    "join_timeout": (
        "--join-timeout",
        dict(type=float, default=None, metavar="SECONDS", help="how long to wait for every node to join (default 900)"),
    ),
    "timeout": (
        "--timeout",
        dict(
            type=float,
            default=None,
            metavar="SECONDS",
            help="how long a collective may wait for a missing rank before the job fails "
            "naming it (sets LOCKSTEP_TIMEOUT; default 600)",
        ),
    ),
    "grace": (
        "--grace",
        dict(
            type=float,
            default=None,
            metavar="SECONDS",
            help="after SIGTERM/SIGUSR1, how long the workers may take to save and exit "
            "before they are killed (default 30)",
        ),
    ),
    "secret_file": (
        "--secret-file",
        dict(
            default=None,
            metavar="FILE",
            help="a file holding the job's secret, the same content on every node: "
            "it signs lockstep's values in the rendezvous store so that other "
            "hosts cannot forge them (default: a random secret per job on one "
            "node; unsigned across nodes)",
        ),
    ),
    "rank0_only": ("--rank0-only", dict(action="store_true", help="show only rank 0's output")),
    "local_rank_arg": (
        "--local-rank-arg",
        dict(
            action="store_true", help="pass --local_rank=N to the script (scripts written for torch.distributed.launch)"
        ),
    ),
    "log_dir": (
        "--log-dir",
        dict(default=None, metavar="DIR", help="keep every rank's stdout/stderr under this folder"),
    ),
    "verbose": ("--verbose", dict(action="store_true", help="show torch's own agent logging")),
}


SESSION_FLAGS: dict[str, dict[str, Any]] = {
    "strategy": dict(metavar="NAME", help="auto, single, dp, ddp, fsdp or horovod (make horovod installs it)"),
    "precision": dict(metavar="NAME", help="fp32, bf16-mixed, fp16-mixed, fp16-o2, bf16, fp16 or apex's O0-O3"),
    "grad_compression": dict(
        metavar="none|bf16|fp16|powersgd",
        help="ddp only: none, bf16, fp16 or powersgd (torch's DDP communication hooks; lossy)",
    ),
    "powersgd_rank": dict(type=int, metavar="R", help="rank of PowerSGD's gradient approximation"),
    "powersgd_start_iter": dict(type=int, metavar="STEPS", help="plain all-reduce steps before PowerSGD starts"),
    "compile": dict(
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile the model after the strategy wraps it: --compile alone uses inductor, "
        "--compile aot_eager another backend; if torch cannot compile, one warning and eager",
    ),
    "sync_bn": dict(action="store_true", help="synchronise BatchNorm statistics across processes (GPU only)"),
    "accumulate": dict(type=int, metavar="K", help="micro-batches per optimizer step (gradient accumulation)"),
    "seed": dict(type=int, metavar="SEED", help="seed of weights, data order and augmentation"),
    "order": dict(
        metavar="lockstep|torch",
        help="training data order: lockstep (every sample once per epoch, never padded) or torch "
        "(DistributedSampler's order and padding)",
    ),
    "nonfinite": dict(
        metavar="skip|stop|ignore", help="what a non-finite loss or gradient does: skip the step, stop, or ignore it"
    ),
}
"""The Session options the apps take as flags, by :class:`~lockstep.SessionConfig` field (PowerSGD's two
knobs: its ``strategy_options``), each declared once: type, metavar and help. The values are checked by
``SessionConfig`` itself, so a bad one is refused with the same line as ``lockstep.Session``'s."""


def add_session_flags(
    parser: argparse.ArgumentParser | Any,
    names: Sequence[str],
    defaults: Mapping[str, Any],
    applies: Mapping[str, str] | None = None,
) -> None:
    """Declare the Session options ``names`` as flags, from :data:`SESSION_FLAGS`.

    Args:
        parser: the subcommand's parser (or an argument group).
        names: options of :data:`SESSION_FLAGS`, in the order the help lists them.
        defaults: each flag's default in this app (its config's field).
        applies: a few words per option on what it applies to in this app (``"the parallel run only"``),
            added to the help.

    Example::

        >>> parser = argparse.ArgumentParser()
        >>> add_session_flags(parser, ["strategy", "accumulate"], {"strategy": "ddp", "accumulate": 1})
        >>> vars(parser.parse_args(["--accumulate", "2"]))
        {'strategy': 'ddp', 'accumulate': 2}
    """
    for name in names:
        options = dict(SESSION_FLAGS[name])
        default = defaults[name]
        note = (applies or {}).get(name)
        text = options.pop("help") + (f"; {note}" if note else "")
        if options.get("action") != "store_true":
            options["default"] = default
            if default is not None:
                text += f" (default {default})"
        parser.add_argument("--" + name.replace("_", "-"), help=text, **options)


def describe_command(parser: argparse.ArgumentParser, doc: str | None) -> None:
    """Show a subcommand's module docstring, but its first line, after its flags in ``--help``.

    Args:
        parser: the subcommand's parser.
        doc: the subcommand module's ``__doc__`` (its reST ``::`` and ````code```` marks are dropped).
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    body = doc.split("\n", 2)[2] if doc and doc.count("\n") >= 2 else None
    parser.epilog = body.replace("::", ":").replace("``", "") if body else None


def add_launch_flags(
    parser: argparse.ArgumentParser,
    names: Sequence[str] = LAUNCH_FLAGS,
    *,
    nproc_default: str | None = "1",
    nproc_default_text: str | None = None,
    nproc_list: bool = False,
    slurm: bool = False,
) -> None:
    """Declare the launch flags ``names`` (destination names, in :data:`LAUNCH_FLAGS`) on ``parser``.

    Args:
        parser: the command's parser.
        names: the flags the command honours.
        nproc_default: ``--nproc``'s default as typed; the commands give ``None``: resolved by the
            command to one per GPU or 2 (:func:`lockstep.launch.relaunch.default_nproc`).
        nproc_default_text: how the help describes that default (default: ``nproc_default``).
        nproc_list: ``--nproc`` takes a comma-separated list of counts (``lockstep bench``).
        slurm: the help says that ``--nodes`` defaults to a Slurm step's (``lockstep run``; see
            :func:`launch_options`).
    """
    unknown = sorted(set(names) - set(LAUNCH_FLAGS))
    if unknown:
        raise ValueError(f"not launch flags: {unknown}")
    for name in LAUNCH_FLAGS:  # run's order, whatever the order of names
        if name not in names:
            continue
        if name == "nproc":
            text = f"{_NPROC_LIST if nproc_list else _NPROC}; default {nproc_default_text or nproc_default}"
            parser.add_argument(
                "--nproc", default=nproc_default, metavar="LIST" if nproc_list else "N|auto|gpu|cpu", help=text
            )
            continue
        flag, options = _DECLARATIONS[name]
        if name == "nodes":
            options = {**options, "help": options["help"].replace("{slurm}", ", or Slurm's" if slurm else "")}
        parser.add_argument(flag, **options)


def value_flags(names: Sequence[str] = LAUNCH_FLAGS) -> frozenset[str]:
    """The option strings of the launch flags ``names`` that take a value (``--nproc 2``, not ``--verbose``).

    Args:
        names: destination names, in :data:`LAUNCH_FLAGS`.
    """
    flags = {flag for name, (flag, options) in _DECLARATIONS.items() if name in names and "action" not in options}
    return frozenset(flags | ({"--nproc"} if "nproc" in names else set()))


def flag_strings(names: Sequence[str] = LAUNCH_FLAGS) -> frozenset[str]:
    """The option strings of the launch flags ``names``, with or without a value.

    Args:
        names: destination names, in :data:`LAUNCH_FLAGS`.
    """
    flags = {flag for name, (flag, _) in _DECLARATIONS.items() if name in names}
    return frozenset(flags | ({"--nproc"} if "nproc" in names else set()))


def split_at_target(argv: Sequence[str], takes_value: Collection[str]) -> tuple[list[str], list[str]]:
    """Split a command line at its target (a script or module): the command's own arguments up to
    and including the target, and the target's arguments, verbatim.

    The target is the first argument that is neither an option nor an option's value, or the one
    right after a ``--``. Everything after it belongs to the target, even what looks like one of
    the command's flags (``train.py --nproc 3``) or a ``--``: the command's parser never sees it, so
    it can neither take nor guess at it (argparse would expand ``--n`` to ``--nproc``).

    Args:
        argv: the arguments after the command's name.
        takes_value: the command's options written as a separate ``--flag VALUE`` pair; every
            other option is one argument (``--verbose``, ``-m``, ``--nproc=2``).
    """
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":  # the end of the command's options: the next argument is the target
            return list(argv[: index + 2]), list(argv[index + 2 :])
        if arg == "-" or not arg.startswith("-"):
            return list(argv[: index + 1]), list(argv[index + 1 :])
        index += 2 if arg in takes_value else 1
    return list(argv), []


def launch_options(
    args: argparse.Namespace, slurm: Mapping[str, Any] | None = None, elastic: bool = False
) -> dict[str, Any]:
    """The :class:`~lockstep.launch.spec.LaunchSpec` fields of the launch flags ``args`` holds.

    Flags left unset take ``lockstep run``'s defaults; ``--nproc`` is resolved to a number
    (``None`` stays ``None``: the command's own default).

    Args:
        args: the parsed flags of a parser given :func:`add_launch_flags`.
        slurm: ``nodes``, ``node_rank`` and ``master`` of a Slurm step
            (:func:`~lockstep.launch.spec.slurm_defaults`), used where neither ``--nodes`` nor
            ``--master`` was given.
        elastic: accept ``--nodes MIN:MAX`` (``lockstep run`` only: its script drives the membership).
    """
    from lockstep.errors import DEFAULT_GRACE, ConfigError
    from lockstep.launch.spec import DEFAULT_JOIN_TIMEOUT, parse_nodes, read_secret, resolve_nproc

    values = {name: getattr(args, name) for name in LAUNCH_FLAGS if hasattr(args, name)}
    if "secret_file" in values:
        path = values.pop("secret_file")
        values["secret"] = read_secret(path) if path else ""
    if slurm and values.get("nodes") is None and values.get("master") is None:
        values.update({key: value for key, value in slurm.items() if key in values and values[key] is None})
    defaults = {"nodes": 1, "node_rank": 0, "join_timeout": DEFAULT_JOIN_TIMEOUT, "grace": DEFAULT_GRACE}
    for key, default in defaults.items():
        if key in values and values[key] is None:
            values[key] = default
    if values.get("nproc") is not None:
        values["nproc"] = resolve_nproc(values["nproc"])
    if isinstance(values.get("nodes"), str):
        values["nodes"], max_nodes = parse_nodes(values["nodes"])
        if max_nodes is not None and not elastic:
            raise ConfigError(
                f"--nodes {args.nodes}: a range of nodes is for `lockstep run` with a script (a Session "
                "loop, or one driving lockstep.comm.elastic.ElasticGroup); give a number here"
            )
        if max_nodes is not None:
            values["max_nodes"] = max_nodes
    return values


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: sets the canonical flag's value and records one deprecation note.

    Declared with :func:`add_deprecated`; hidden from the help. The note is kept on the namespace
    (:func:`deprecation_notes`) rather than printed, so that parsing stays silent and the command
    line prints it once.

    Args:
        option_strings: the old spelling.
        dest: the canonical flag's destination.
        canonical: the canonical spelling, named in the note.
        const: the value to set when the old spelling takes no value (``--no-progress``: ``off``).
        **options: ``type``, ``metavar``... of a flag that takes a value.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, canonical: str, const: Any = None, **options: Any
    ) -> None:
        self.canonical = canonical
        options.pop("default", None)
        options.pop("help", None)
        super().__init__(
            option_strings,
            dest,
            nargs=0 if const is not None else None,
            const=const,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            **options,
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        shown = f"{self.canonical} {self.const}" if self.nargs == 0 else self.canonical
        note = f"{option_string} is deprecated; write {shown} (same meaning)"
        notes = [*getattr(namespace, _NOTES, []), note]
        setattr(namespace, _NOTES, list(dict.fromkeys(notes)))


_NOTES = "deprecated_flags"  # the namespace attribute holding the notes (lockstep.cli.main leaves it out of `given`)


def add_deprecated(
    parser: argparse.ArgumentParser, old: str, canonical: str, *, dest: str, const: Any = None, **options: Any
) -> None:
    """Keep ``old`` working as a hidden alias of ``canonical``, with one deprecation note when used.

    Args:
        parser: the command's parser (``canonical`` already declared on it).
        old: the old spelling (``--strategies``).
        canonical: the spelling to use instead (``--strategy``).
        dest: ``canonical``'s destination.
        const: the value ``old`` stands for when it takes none (``--no-progress``: ``off``).
        **options: ``type`` of an alias that takes a value.
    """
    parser.add_argument(old, action=DeprecatedFlag, dest=dest, canonical=canonical, const=const, **options)


def deprecation_notes(args: argparse.Namespace) -> list[str]:
    """The deprecation notes the old spellings used on this command line left (one per spelling).

    Args:
        args: a parsed namespace.
    """
    return list(getattr(args, _NOTES, []))
