"""ResNet-50 training throughput on GPUs: lockstep's Session against a hand-written loop.

Rows (images/s, bf16 autocast, channels_last, SGD with momentum, synthetic 224x224 batches kept
on the GPU, a window of steps between two ``torch.cuda.synchronize`` calls after a warm-up):

* ``hand-written``: the plain PyTorch loop on one GPU;
* ``lockstep single``: ``Session(strategy="single", precision="bf16-mixed")`` with its defaults
  (``nonfinite="skip"`` reads one flag per step), and the same with ``nonfinite="ignore"``;
* ``--compile BACKEND``: ``lockstep single, compiled`` (``Session(compile={"backend": ...})``,
  compiled during the warm-up), interleaved with the rows above;
* with more than one GPU: ``lockstep dp`` (one process, ``nn.DataParallel``, a batch per GPU)
  and ``lockstep ddp`` (one process per GPU through ``lockstep.spawn``), and one more ddp row
  per ``--ddp-variants`` entry: ``bf16``, ``fp16`` or ``powersgd`` (gradient compression hooks,
  ``Session(grad_compression=...)``), ``compile`` (the ``--compile`` backend, inductor by
  default) or ``zero`` (``shard_optimizer=True``).

The single-GPU rows are interleaved over ``--rounds`` rounds and their medians reported.
Without CUDA the script stops at once with exit code 2 (``--allow-cpu`` runs it on the CPU with
tiny settings, only to check the script itself: the ddp rows then use 2 CPU processes on gloo).

Run::

    python benchmarks/gpu_resnet50.py
    python benchmarks/gpu_resnet50.py --batch-size 256 --steps 100 --rounds 5
    python benchmarks/gpu_resnet50.py --compile inductor --ddp-variants bf16,powersgd,compile,zero
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

BF16 = torch.bfloat16


def make_model(image_size: int) -> nn.Module:
    """ResNet-50 with random weights, as ``lockstep train --model resnet50`` builds it."""
    from lockstep.recipes import build_model

    torch.manual_seed(0)
    return build_model("resnet50", channels=3, num_classes=1000, image_size=image_size)


def make_batch(batch: int, image_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random channels_last batch and labels on ``device``."""
    images = torch.randn(batch, 3, image_size, image_size, device=device).to(memory_format=torch.channels_last)
    return images, torch.randint(1000, (batch,), device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], None], steps: int, warmup: int, device: torch.device) -> float:
    """Seconds for ``steps`` steps after ``warmup`` untimed ones, between device syncs."""
    for _ in range(warmup):
        step()
    _sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - began


def hand_written(args: argparse.Namespace, device: torch.device) -> Callable[[], None]:
    """The plain loop: autocast bf16, channels_last, zero_grad / backward / step."""
    model = make_model(args.image_size).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    images, labels = make_batch(args.batch_size, args.image_size, device)

    def step() -> None:
        with torch.autocast(device.type, dtype=BF16):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def with_session(session: Any, args: argparse.Namespace, per_step_batch: int) -> Callable[[], None]:
    """The same training through a lockstep Session (any strategy)."""
    model = make_model(args.image_size).to(memory_format=torch.channels_last)
    model, optimizer = session.setup(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    criterion = nn.CrossEntropyLoss()
    images, labels = make_batch(per_step_batch, args.image_size, session.device)

    def step() -> None:
        session.backward(criterion(model(images), labels))
        session.step(optimizer)

    return step


def single_gpu_rows(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Interleave the hand-written loop and the Sessions on one device; median images/s each."""
    import lockstep

    session = lockstep.Session(strategy="single", precision="bf16-mixed", quiet=True)
    steps = {
        "hand-written": hand_written(args, device),
        "lockstep single": with_session(session, args, args.batch_size),
    }
    steps["lockstep single, nonfinite=ignore"] = steps["lockstep single"]
    sessions = {"lockstep single": session, "lockstep single, nonfinite=ignore": session}
    if args.compile:
        compiled = lockstep.Session(
            strategy="single", precision="bf16-mixed", quiet=True, compile={"backend": args.compile}
        )
        steps["lockstep single, compiled"] = with_session(compiled, args, args.batch_size)
        sessions["lockstep single, compiled"] = compiled
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        names = list(rates) if r % 2 == 0 else list(reversed(rates))
        for name in names:
            if name in sessions:
                sessions[name].nonfinite = "ignore" if name.endswith("ignore") else "skip"
            seconds = timed(steps[name], args.steps, args.warmup, device)
            rates[name].append(args.batch_size * args.steps / seconds)
    return {name: statistics.median(values) for name, values in rates.items()}


def dp_row(args: argparse.Namespace, gpus: int) -> float:
    """``nn.DataParallel`` over every GPU from one process; the batch is per GPU."""
    import lockstep

    session = lockstep.Session(strategy="dp", precision="bf16-mixed", quiet=True)
    step = with_session(session, args, args.batch_size * gpus)
    seconds = timed(step, args.steps, args.warmup, session.device)
    return args.batch_size * gpus * args.steps / seconds


VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "bf16": {"grad_compression": "bf16"},
    "fp16": {"grad_compression": "fp16"},
    "powersgd": {"grad_compression": "powersgd"},
    "compile": {"compile": True},
    "zero": {"shard_optimizer": True},
}


def ddp_rank(args: argparse.Namespace, variant: str = "plain") -> float:
    """One rank of a ddp row (run by ``lockstep.spawn``); returns its window in seconds."""
    import lockstep

    options = dict(VARIANTS[variant])
    if "compile" in options:
        options["compile"] = {"backend": args.compile or "inductor"}
    session = lockstep.Session(strategy="ddp", precision="bf16-mixed", quiet=True, **options)
    step = with_session(session, args, args.batch_size)
    for _ in range(args.warmup):
        step()
    _sync(session.device)
    session.barrier()
    seconds = timed(step, args.steps, 0, session.device)
    session.close()
    return seconds


def main() -> int:
    """Check for GPUs, run the rows, print images/s."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=128, help="images per GPU per step (default 128)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per window (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the single-GPU rows")
    parser.add_argument(
        "--compile",
        metavar="BACKEND",
        default=None,
        help="add a compiled single-GPU row with this torch.compile backend (e.g. inductor)",
    )
    parser.add_argument(
        "--ddp-variants",
        default="",
        help="more ddp rows with >1 GPU, comma-separated: bf16, fp16, powersgd, compile, zero",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (checks the script only)")
    args = parser.parse_args()
    variants = [v.strip() for v in args.ddp_variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS or v == "plain"]
    if unknown:
        parser.error(f"--ddp-variants: unknown {', '.join(unknown)}; choose from bf16, fp16, powersgd, compile, zero")
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "gpu_resnet50.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
            "run it on a machine with GPUs",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    name = torch.cuda.get_device_name(0) if gpus else "cpu"
    print(
        f"ResNet-50, bf16 autocast, channels_last, batch {args.batch_size} per GPU, {args.image_size}px, "
        f"{args.steps} steps after {args.warmup} warm-up; {gpus} x {name}; torch {torch.__version__}"
    )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # the same for every row
    rows = single_gpu_rows(args, device)
    base = rows["hand-written"]
    for label, rate in rows.items():
        print(f"  {label:36s} {rate:10.1f} images/s   {rate / base:6.3f} x hand-written")
    ranks = gpus if gpus > 1 else (2 if device.type == "cpu" else 0)  # --allow-cpu: 2 CPU ranks on gloo
    if ranks > 1:
        import lockstep

        results = []
        if gpus > 1:
            torch.cuda.empty_cache()  # the single-GPU rows' memory goes back before GPU 0 is shared
            results.append((f"lockstep dp ({gpus} GPUs, 1 process)", dp_row(args, gpus)))
        for variant in ["plain", *variants]:
            windows = lockstep.spawn(ddp_rank, ranks, args=(args, variant))
            label = f"lockstep ddp ({ranks} processes)" + ("" if variant == "plain" else f", {variant}")
            results.append((label, args.batch_size * ranks * args.steps / max(windows)))
        for label, rate in results:
            print(f"  {label:36s} {rate:10.1f} images/s   {rate / (base * ranks):6.3f} scaling efficiency")
    return 0


if __name__ == "__main__":
    sys.exit(main())
