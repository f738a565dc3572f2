"""How long ``lockstep run`` takes to start a job, against ``torchrun --standalone``.

Two measurements, each the median of several runs, the two launchers interleaved (the order
alternates every run) so that background load falls on both alike:

* wall time of a no-op 2-rank job (the script is ``pass``): launcher start-up, worker start-up,
  rendezvous and teardown;
* time from launch to the first training step: a tiny script prints a timestamp as its first
  statement, then builds ``lockstep.Session(ddp)``, takes one optimizer step on a
  ``Linear(10, 10)`` and prints another; the figures are the latest rank's timestamps minus the
  moment the launcher was started (launch -> script starts, launch -> first step).

Target: lockstep <= torchrun. On a shared machine the spread is wide; compare only launchers
timed in the same interleaved run. ``--baseline-src`` times a second lockstep source tree in the
same rotation (its ``src`` folder on ``PYTHONPATH``, for the launcher and its workers alike): a
change to the launcher is then measured against the code before it under the same load.
Run (the load average is printed with the figures)::

    python benchmarks/launch.py
    python benchmarks/launch.py --runs 9 --no-first-step
    git worktree add ../before HEAD~1 && python benchmarks/launch.py --baseline-src ../before/src
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

NOOP = "pass\n"
FIRST_STEP = textwrap.dedent("""\
    import os
    import time

    print(f"STARTED {os.environ.get('RANK')} {time.time():.6f}", flush=True)

    import torch
    from torch import nn

    import lockstep

    session = lockstep.Session(strategy="ddp", quiet=True)
    model, optimizer = session.setup(nn.Linear(10, 10), lambda p: torch.optim.SGD(p, lr=0.1))
    loss = model(torch.randn(4, 10, device=session.device)).square().mean()
    session.backward(loss)
    session.step(optimizer)
    print(f"FIRST_STEP {session.rank} {time.time():.6f}", flush=True)
    session.close()
""")
_STAMP = re.compile(r"FIRST_STEP (\d+) ([0-9.]+)")
_STARTED = re.compile(r"STARTED (\d+) ([0-9.]+)")


BASELINE = "lockstep (baseline)"


def launcher_command(launcher: str, script: Path) -> list[str]:
    """The command line that starts ``script`` on 2 processes with ``launcher``."""
    if launcher.startswith("lockstep"):
        return [sys.executable, "-m", "lockstep", "run", "--nproc", "2", str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]


def run_once(launcher: str, script: Path, baseline_src: str | None = None) -> dict[str, float]:
    """Start one job; return its wall time and, when the script prints them, the times from
    launch to the last rank's start and to the last rank's first step."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if launcher == BASELINE and baseline_src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline_src, env.get("PYTHONPATH")]))
    began = time.time()
    done = subprocess.run(launcher_command(launcher, script), env=env, capture_output=True, text=True, timeout=300)
    times = {"wall": time.time() - began}
    if done.returncode != 0:
        raise RuntimeError(f"{launcher} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    for key, pattern in (("started", _STARTED), ("first_step", _STAMP)):
        stamps = [float(ts) for _, ts in pattern.findall(done.stdout + done.stderr)]
        if len(stamps) == 2:
            times[key] = max(stamps) - began
    return times


def measure(
    runs: int, folder: Path, first_step: bool = True, baseline_src: str | None = None
) -> dict[str, dict[str, list[float]]]:
    """Rotate the launchers ``runs`` times over the no-op (and the first-step) script."""
    noop, first = folder / "noop.py", folder / "first_step.py"
    noop.write_text(NOOP)
    first.write_text(FIRST_STEP)
    launchers = ["lockstep", "torchrun"] + ([BASELINE] if baseline_src else [])
    results: dict[str, dict[str, list[float]]] = {
        name: {"noop_wall": [], "started": [], "first_step": [], "first_wall": []} for name in launchers
    }
    for i in range(runs):
        # each launcher goes first as often as the others: a load burst falls on all alike
        order = launchers[i % len(launchers) :] + launchers[: i % len(launchers)]
        for launcher in order:
            results[launcher]["noop_wall"].append(run_once(launcher, noop, baseline_src)["wall"])
            if not first_step:
                continue
            times = run_once(launcher, first, baseline_src)
            results[launcher]["first_wall"].append(times["wall"])
            for key in ("started", "first_step"):
                if key in times:
                    results[launcher][key].append(times[key])
        print(f"  run {i + 1}/{runs} done", file=sys.stderr, flush=True)
    return results


def report(results: dict[str, dict[str, list[float]]]) -> str:
    """Median seconds per launcher and measurement, each launcher's ratio to torchrun, the ranges."""
    labels = {
        "noop_wall": "no-op job, wall",
        "started": "launch -> script starts",
        "first_step": "launch -> first step",
        "first_wall": "first-step job, wall",
    }
    names = list(results)
    lines = [f"{'':24s}" + "".join(f"{n:>22s}" for n in names) + "   ratio to torchrun"]
    for key, label in labels.items():
        if not all(results[n][key] for n in names):
            continue
        medians = {n: statistics.median(results[n][key]) for n in names}
        ratios = " / ".join(f"{medians[n] / medians['torchrun']:.2f}" for n in names if n != "torchrun")
        lines.append(f"{label:24s}" + "".join(f"{medians[n]:20.2f} s" for n in names) + f"   {ratios}")
        lines.append(
            f"{'  range':24s}" + "".join(f"{min(results[n][key]):>13.2f}-{max(results[n][key]):.2f} s" for n in names)
        )
    return "\n".join(lines)


def main() -> int:
    """Run the interleaved launches and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="launches per launcher and script (default 7)")
    parser.add_argument("--no-first-step", action="store_true", help="time the no-op job only")
    parser.add_argument(
        "--baseline-src",
        metavar="DIR",
        default=None,
        help="also time lockstep run from this source folder (another checkout's src), interleaved",
    )
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, load average {os.getloadavg()}", flush=True)
    baseline = str(Path(args.baseline_src).resolve()) if args.baseline_src else None
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args.runs, Path(tmp), first_step=not args.no_first_step, baseline_src=baseline)
    print(f"medians of {args.runs} interleaved runs, 2 ranks each (target: lockstep <= torchrun):")
    print(report(results))
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
