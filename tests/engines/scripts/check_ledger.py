"""Check what ``elastic_train.py`` recorded: exactly once per epoch, the global batch in every step,
the final weights of a one-process run.

    python check_ledger.py LEDGER_DIR --samples 960 --global-batch 24 --epochs 2

Prints one line per membership event (round, world size, seconds) and exits 1 with the first
broken rule.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections import Counter, defaultdict
from typing import Any

# Both runs train in fp64 and differ only in the order each step's per-sample gradients are summed
# (a share per rank, then the all_reduce, at world sizes that change). One step's sum of n = 24 terms
# changes by at most n * u * sum|g| under reordering (u = 2**-53 = 1.1e-16, sum|g| below 10 here):
# 2.7e-14 per step; 80 steps, even amplified a hundredfold by momentum and the network, stay under
# 2.2e-10. A real fault moves the weights by far more: one sample lost or seen twice changes a step
# by lr * |g_i| / 24, about 1e-3. The bound sits between the two, orders of magnitude from each
# (in fp32, u = 6e-8, the same rounding reached 1.13e-6, and no fixed bound could tell it apart).
TOLERANCE = 1e-9


def committed_steps(folder: str) -> dict[int, list[dict[str, Any]]]:
    """Each step's records from the last round that ran it (an earlier try was not committed), one per rank."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in glob.glob(os.path.join(folder, "ledger-*.jsonl")):
        with open(path) as fp:
            for line in fp:
                if line.strip():
                    rec = json.loads(line)
                    by_step[rec["step"]][rec["round"]].append(rec)
    return {step: _by_rank(rounds[max(rounds)]) for step, rounds in by_step.items()}


def _by_rank(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per rank: a rank that trains a step in several micro-batches writes one record for each."""
    merged: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec["rank"] in merged:
            merged[rec["rank"]]["indices"] += rec["indices"]
        else:
            merged[rec["rank"]] = {**rec, "indices": list(rec["indices"])}
    return list(merged.values())


def check(folder: str, samples: int, global_batch: int, epochs: int, tolerance: float = TOLERANCE) -> list[str]:
    """The broken rules (empty when all hold)."""
    import torch

    problems = []
    steps = committed_steps(folder)
    per_epoch = math.ceil(samples / global_batch)
    if sorted(steps) != list(range(per_epoch * epochs)):
        problems.append(f"steps recorded: {sorted(steps)[:5]}... ({len(steps)}), expected 0..{per_epoch * epochs - 1}")
    for epoch in range(epochs):
        seen: Counter[int] = Counter()
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            recs = steps.get(step, [])
            ranks = sorted(r["rank"] for r in recs)
            if recs and ranks != list(range(recs[0]["world"])):
                problems.append(f"step {step}: ranks {ranks} of world {recs[0]['world']} recorded")
            indices = [i for r in recs for i in r["indices"]]
            want = min(global_batch, samples - (step - epoch * per_epoch) * global_batch)
            if len(indices) != want:
                problems.append(f"step {step}: {len(indices)} samples, expected {want}")
            seen.update(indices)
        twice = [i for i, n in seen.items() if n > 1]
        missing = sorted(set(range(samples)) - set(seen))
        if twice or missing:
            problems.append(f"epoch {epoch}: {len(twice)} indices seen twice, {len(missing)} never")
    final, reference = (os.path.join(folder, n) for n in ("final.pt", "reference.pt"))
    if os.path.exists(final) and os.path.exists(reference):
        a, b = torch.load(final), torch.load(reference)
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        print(f"final weights: largest difference from one process {worst:.2e}")
        if worst > tolerance:
            problems.append(f"final weights differ from the one-process run by {worst:.2e} > {tolerance:g}")
    else:
        problems.append("final.pt or reference.pt missing")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--samples", type=int, default=960)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    events_path = os.path.join(args.folder, "events.json")
    if os.path.exists(events_path):
        for e in json.load(open(events_path)):
            print(
                f"event round {e['round']}: world {e['world_size']}, resumed at step {e['step']}, left "
                f"{e['left']}, joined {e['joined']}: step lost {e['step lost']:.2f} s, rendezvous "
                f"{e['rendezvous']:.2f} s, state {e['state']:.2f} s"
            )
    problems = check(args.folder, args.samples, args.global_batch, args.epochs)
    for p in problems:
        print(f"ledger: {p}")
    print("ledger: ok" if not problems else f"ledger: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
