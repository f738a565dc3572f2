"""The two trainings of ``lockstep verify``: one process in this process, N processes launched.

Both start from the same weights and train with plain SGD on the same batches; rank 0 of the N
writes the losses, state dicts and first forward outputs back. The workers' entry point::

    python -m lockstep.verify.run JOB_FILE      # started by the launcher, once per rank
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep.errors import LockstepError
from lockstep.verify.config import VerifyConfig
from lockstep.verify.inputs import Batch, apply_dropout_mode, build_model, make_loss, shard
from lockstep.verify.record import ActivationRecorder, recorded_rows

__all__ = ["RunResult", "train", "run_reference", "run_parallel", "worker_main", "VerifyRunError", "initial_state"]


class VerifyRunError(LockstepError):
    """The N-process training failed or returned no result."""


@dataclass
class RunResult:
    """What one training run produced (``first_state``: the state dict after the first step)."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    activations: list[dict[str, torch.Tensor]]
    order: list[str]
    first_state: dict[str, torch.Tensor] = field(default_factory=dict)


def train(
    session: Any, config: VerifyConfig, init: dict[str, torch.Tensor], steps: list[list[Batch]], reference: bool = False
) -> RunResult:
    """Train the config's model under ``session`` on ``steps``, this rank's micro-batches of each step."""
    if config.resolved.precision == "fp32" and session.device.type == "cuda":
        # TF32 convolutions/matmuls round to 10 bits, differently for different batch shapes:
        # an fp32 comparison must compute in fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
    bare = build_model(config)
    bare.load_state_dict(init)
    apply_dropout_mode(bare, config.dropout)
    model, optimizer = session.setup(bare, lambda params: torch.optim.SGD(params, lr=config.lr))
    # hooks after setup: SyncBatchNorm replaces the BatchNorm modules inside the model
    recorder = ActivationRecorder(bare, *recorded_rows(config, reference))
    loss_fn = make_loss(config)
    model.train()
    losses, first_state = [], {}
    for step, micro_batches in enumerate(steps):
        if config.dropout == "align":
            torch.manual_seed(config.seed + 1 + step)  # the same stream on every rank and in the reference
        total = torch.zeros((), dtype=torch.float64, device=session.device)
        for x, y in micro_batches:
            loss = loss_fn(model(x.to(session.device)), y.to(session.device))
            recorder.close()
            session.backward(loss)
            total += loss.detach().double()
        session.step(optimizer)
        if step == 0:
            first_state = session.model_state_dict(model)
        # equal micro-batches on every rank: the mean of the means is the global mean
        losses.append(float(session.all_reduce(total / len(micro_batches), "mean").item()))
    state = session.model_state_dict(model)
    activations = session.comm.all_gather_object(recorder.outputs)
    return RunResult(losses, state, activations, recorder.order, first_state)


def initial_state(config: VerifyConfig) -> dict[str, torch.Tensor]:
    """The initial weights both runs start from (the config's seed decides them)."""
    torch.manual_seed(config.seed)
    return {k: v.detach().clone() for k, v in build_model(config).state_dict().items()}


def run_reference(config: VerifyConfig, init: dict[str, torch.Tensor], batches: list[Batch]) -> RunResult:
    """Train in this process, world size 1, each global batch whole."""
    from lockstep.session.session import Session

    with Session(strategy="single", precision=config.resolved.precision, seed=config.seed, quiet=True) as session:
        return train(session, config, init, [[batch] for batch in batches], reference=True)


def run_parallel(config: VerifyConfig, init: dict[str, torch.Tensor], batches: list[Batch]) -> RunResult:
    """Launch ``config.nproc`` workers with the launcher of ``lockstep run``; return rank 0's result."""
    from lockstep.launch.relaunch import relaunch

    with tempfile.TemporaryDirectory(prefix="lockstep-verify-") as tmp:
        job, out = Path(tmp) / "job.pt", Path(tmp) / "result.pt"
        paths = [p for p in sys.path if p and os.path.isdir(p)]  # where the user's factories import from
        torch.save(
            {"config": config.to_dict(), "init": init, "batches": batches, "out": str(out), "sys_path": paths}, job
        )
        code = relaunch(
            [str(job)],
            module="lockstep.verify.run",
            prefix=True,
            nproc=config.nproc,
            timeout=config.timeout,
            label="lockstep verify",
        )
        if code != 0 or not out.exists():
            raise VerifyRunError(
                f"the {config.nproc}-process training failed (exit code {code}); "
                "the launcher's message above names the rank and the error"
            )
        values = torch.load(out, weights_only=True)
    return RunResult(**values)


def worker_main(job_file: str) -> int:
    """One rank of the parallel run: train on this rank's slices, rank 0 writes the result."""
    from lockstep.session.session import Session

    job = torch.load(job_file, weights_only=True)
    sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
    config = VerifyConfig.from_dict(job["config"])
    session = Session(config=config.session_config())
    if session.world_size != config.nproc:
        raise VerifyRunError(f"expected {config.nproc} ranks, the job has {session.world_size}")
    steps = [shard(batch, session.rank, session.world_size, config.accumulate) for batch in job["batches"]]
    result = train(session, config, job["init"], steps)
    if session.is_main:
        torch.save(asdict(result), job["out"])
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
