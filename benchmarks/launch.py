"""How long ``lockstep run`` takes to start a job, against ``torchrun --standalone``.

Two measurements, each the median of several runs, the two launchers interleaved (the order
alternates every run) so that background load falls on both alike:

* wall time of a no-op 2-rank job (the script is ``pass``): launcher start-up, worker start-up,
  rendezvous and teardown;
* time from launch to the first training step: a tiny script prints a timestamp as its first
  statement, then builds ``lockstep.Session(ddp)``, takes one optimizer step on a
  ``Linear(10, 10)`` and prints another; the figures are the latest rank's timestamps minus the
  moment the launcher was started (launch -> script starts, launch -> first step).

Target: lockstep <= torchrun. Run (the load average is printed with the figures)::

    python benchmarks/launch.py
    python benchmarks/launch.py --runs 9
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


def launcher_command(launcher: str, script: Path) -> list[str]:
    """The command line that starts ``script`` on 2 processes with ``launcher``."""
    if launcher == "lockstep":
        return [sys.executable, "-m", "lockstep", "run", "--nproc", "2", str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]


def run_once(launcher: str, script: Path) -> dict[str, float]:
    """Start one job; return its wall time and, when the script prints them, the times from
    launch to the last rank's start and to the last rank's first step."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
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


def measure(runs: int, folder: Path) -> dict[str, dict[str, list[float]]]:
    """Interleave both launchers ``runs`` times on the no-op and the first-step scripts."""
    noop, first = folder / "noop.py", folder / "first_step.py"
    noop.write_text(NOOP)
    first.write_text(FIRST_STEP)
    results: dict[str, dict[str, list[float]]] = {
        name: {"noop_wall": [], "started": [], "first_step": [], "first_wall": []} for name in ("lockstep", "torchrun")}
    for i in range(runs):
        order = ("lockstep", "torchrun") if i % 2 == 0 else ("torchrun", "lockstep")
        for launcher in order:
            results[launcher]["noop_wall"].append(run_once(launcher, noop)["wall"])
            times = run_once(launcher, first)
            results[launcher]["first_wall"].append(times["wall"])
            for key in ("started", "first_step"):
                if key in times:
                    results[launcher][key].append(times[key])
        print(f"  run {i + 1}/{runs} done", file=sys.stderr, flush=True)
    return results


def report(results: dict[str, dict[str, list[float]]]) -> str:
    """Median seconds per launcher and measurement, and lockstep/torchrun."""
    labels = {"noop_wall": "no-op job, wall", "started": "launch -> script starts", "first_step": "launch -> first step",
              "first_wall": "first-step job, wall"}
    lines = [f"{'':24s}{'lockstep run':>16s}{'torchrun':>16s}{'ratio':>8s}"]
    for key, label in labels.items():
        ls, tr = (statistics.median(results[n][key]) for n in ("lockstep", "torchrun"))
        spread = {n: f"{min(results[n][key]):.2f}-{max(results[n][key]):.2f}" for n in ("lockstep", "torchrun")}
        lines.append(f"{label:24s}{ls:14.2f} s{tr:14.2f} s{ls / tr:8.2f}   "
                     f"(ranges {spread['lockstep']} / {spread['torchrun']})")
    return "\n".join(lines)


def main() -> int:
    """Run the interleaved launches and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="launches per launcher and script (default 7)")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args.runs, Path(tmp))
    print(f"medians of {args.runs} interleaved runs, 2 ranks each (target: lockstep <= torchrun):")
    print(report(results))
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
