"""The training program of ``lockstep train``, as every worker process runs it, on :class:`lockstep.Session` only.

Run it through the command line (which starts the workers)::

    lockstep train --model resnet18 --data imagefolder:data/flowers --image-size 64 --out runs/f
    lockstep run --nproc 2 -m lockstep train --epochs 2     # under an explicit launcher
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.checkpoint import is_url
from lockstep.recipes.checks import check_data
from lockstep.recipes.config import CHECKPOINTS, TrainConfig
from lockstep.recipes.outputs import TENSORBOARD_DIR, RunLog, tensorboard_logger
from lockstep.zoo.datasets import materialized
from lockstep.zoo.models import build_model, load_weights

__all__ = ["train", "DivergedError", "EVAL_BATCH", "POSTFIX_EVERY"]

EVAL_BATCH = 256
POSTFIX_EVERY = 10  # steps between progress-bar updates of loss and speed (each costs a sync)


class DivergedError(lockstep.LockstepError):
    """Every optimizer step of an epoch was skipped for a non-finite loss, or the epoch's train loss is not
    finite: the model learns nothing. ``lockstep train`` exits with code 1."""


def train(config: TrainConfig, data: Any = None) -> int:
    """Train as one worker of the job described by the environment; return the exit code.

    Args:
        config: the validated configuration.
        data: the data from :func:`~lockstep.recipes.checks.check_data` when already opened.

    Raises:
        DivergedError: every step of an epoch was skipped for a non-finite loss, or its train loss is not finite.
    """
    world = lockstep.detect_world()
    if data is None:
        data = check_data(config, world.world_size)  # before the process group: errors stay one line
    # the step timings of every window go to TensorBoard beside the epoch metrics, against the global step
    # (a local --out only: a URL holds the checkpoints alone)
    local = config.out is not None and not is_url(config.out)
    timings = tensorboard_logger(Path(str(config.out)) / TENSORBOARD_DIR / "timings", None) if local else None
    session = lockstep.Session(config=replace(config.session_config(), loggers=[timings] if timings else None))
    with session:
        _run(session, config, data)
    return 0


def _prepare(session: lockstep.Session, config: TrainConfig, data: Any) -> tuple[Any, Any, Any, Any, float]:
    """Build and wrap the model and optimizer, and the loaders; return them with the learning rate."""
    global_batch = config.batch_size * session.world_size * config.accumulate
    lr = config.lr * global_batch / config.base_batch if config.scale_lr else config.lr
    model = build_model(config.model, data.channels, data.num_classes, data.image_size)
    if config.weights is not None:
        skipped = load_weights(model, config.weights)
        session.print(f"lockstep train: started from {config.weights}; left at random: {', '.join(skipped) or 'none'}")
    model, optimizer = session.setup(
        model, lambda params: torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    )
    options = {} if config.workers is None else {"num_workers": config.workers}
    train_loader = session.loader(materialized(data.train), config.batch_size, shuffle=True, **options)
    test_loader = session.loader(materialized(data.test), EVAL_BATCH, eval=True, **options)
    return model, optimizer, train_loader, test_loader, lr


def _where(state: lockstep.ResumeState, start: int, epochs: int) -> str:
    """Where a resume continues, epochs counted from 1 as the ``Epoch [i/N]`` lines count them."""
    ended = state.extras.get("epoch_end_step")  # the step of the last whole epoch's save (a preemption's is later)
    if state.mid_epoch if ended is None else int(ended) != state.step:
        return f"in epoch {start + 1}/{epochs} at step {state.step}: the epoch goes on with its remaining batches"
    return f"after epoch {start}/{epochs}" if start else f"at step {state.step}, before epoch 1/{epochs}"


def _world_changed(was: int, now: int, config: TrainConfig, lr: float) -> str:
    """The resume line of a run continued at another world size: --batch-size is per device."""
    per_step = config.batch_size * config.accumulate
    scaled = f", and --scale-lr makes the learning rate {lr:g}" if config.scale_lr else ""
    return (
        f"lockstep train: world size {was} -> {now}: global batch {per_step * now}, was {per_step * was} "
        f"(--batch-size {config.batch_size} is per device){scaled}; resume with --nproc {was} to keep the run's"
    )


def _run(session: lockstep.Session, config: TrainConfig, data: Any) -> None:
    model, optimizer, train_loader, test_loader, lr = _prepare(session, config, data)
    url = config.out if config.out is not None and is_url(config.out) else None
    out = Path(config.out) if config.out is not None and url is None else None  # the local files' folder
    checkpoints = f"{url}/{CHECKPOINTS}" if url is not None else (out / CHECKPOINTS if out is not None else None)
    state = lockstep.ResumeState()
    if checkpoints is not None:  # also the folder a preemption saves into
        state = session.load(checkpoints, model=model, optimizer=optimizer)
    # The recipe saves after whole epochs only; the count it stored is authoritative even when
    # --max-steps ended the epoch before its last batch.
    start = int(state.extras.get("epochs_done", state.epoch)) if state.resumed else 0
    session.print(f"{session.summary(config.max_steps)}, lr {lr:g}")  # --max-steps: the steps it takes
    if state.resumed:
        session.print(f"lockstep train: resumed from {state.path} {_where(state, start, config.epochs)}")
        if state.world_size is not None and state.world_size != session.world_size:
            session.print(_world_changed(state.world_size, session.world_size, config, lr))
    for logger in session.config.resolved.loggers:
        logger.resume_at(session.global_step + 1)  # steps after the checkpoint are trained (and logged) again
    log = RunLog(out, session.is_main, start, say=session.print)
    # "resume": whether this run continued from a checkpoint (every worker is given --resume)
    log.write_config(
        {
            **config.to_dict(),
            "resume": state.resumed,
            "world_size": session.world_size,
            "image_size": data.image_size,
            "lr_effective": lr,
            "global_batch": train_loader.batch_size * session.world_size * session.accumulate,
            "lockstep": lockstep.__version__,
            "torch": torch.__version__,
        }
    )
    began = time.perf_counter()
    try:
        for epoch in session.epochs(config.epochs, start=start):
            row = _epoch(session, config, model, optimizer, train_loader, test_loader)
            row.update(epoch=epoch + 1, step=session.global_step, lr=lr)
            resumed = row["resumed_at_batch"]
            over = f" (batches {resumed + 1}-{row['last_batch']}: resumed mid-epoch)" if resumed else ""
            session.print(
                f"Epoch [{epoch + 1}/{config.epochs}] train loss {row['train_loss']:.4f}{over}, "
                f"test loss {row['test_loss']:.4f}, test accuracy {row['test_accuracy']:.4f} "
                f"({row['test_count']} samples), {row['samples_per_s']:.0f} samples/s, "
                f"{row['epoch_time_s']:.1f} s"
            )
            if checkpoints is not None:
                session.save(
                    checkpoints,
                    model=model,
                    optimizer=optimizer,
                    keep=config.keep,
                    epochs_done=epoch + 1,
                    epoch_end_step=session.global_step,
                )
            log.epoch(row)
    except lockstep.Preempted as stop:
        log.preempted(config.to_dict(), stop.step, stop.path)  # the same command continues it
        raise
    finally:
        log.close()
    log.finished()
    if start >= config.epochs:
        session.print(
            f"lockstep train: nothing to train: the checkpoint already covers {start} of "
            f"{config.epochs} epochs (raise --epochs to train more)"
        )
    whole = time.monotonic() - lockstep.IMPORTED_AT
    session.print(
        f"Training complete in {time.perf_counter() - began:.1f} s "
        f"({whole:.1f} s since this process started: imports, data and set-up included)"
    )


def _epoch(
    session: lockstep.Session,
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: Any,
    test_loader: Any,
) -> dict[str, Any]:
    """Train one epoch and evaluate; return the row of ``metrics.csv`` (without epoch and step)."""
    criterion = nn.CrossEntropyLoss()
    limit = config.max_steps * config.accumulate if config.max_steps is not None else None
    done = len(train_loader) - train_loader.remaining if hasattr(train_loader, "remaining") else 0
    if limit is not None:  # an epoch resumed mid-way counts the batches it took before the stop
        limit -= done
    totals = torch.zeros(2, dtype=torch.float64, device=session.device)  # loss sum, samples
    skipped, took, batches = session.skipped_steps, 0, 0
    model.train()
    bar = _progress(session, config, train_loader)
    began = time.perf_counter()
    try:
        for i, (images, labels) in enumerate(bar if limit is None or limit > 0 else ()):
            loss = criterion(model(images).float(), labels)
            session.backward(loss)
            took += session.step(optimizer)
            batches += 1
            share = getattr(train_loader, "share", labels.shape[0])  # a zero-sample rank's stand-in counts 0
            totals[0] += loss.detach().double() * share
            totals[1] += share
            if hasattr(bar, "set_postfix") and i % POSTFIX_EVERY == 0:
                speed = totals[1].item() * session.world_size / max(time.perf_counter() - began, 1e-9)
                bar.set_postfix(loss=f"{loss.item():.4f}", samples_s=f"{speed:.0f}", refresh=False)
            if limit is not None and i + 1 >= limit:
                break
    finally:
        if hasattr(bar, "close"):
            bar.close()
    elapsed = time.perf_counter() - began
    if took == 0 and session.skipped_steps > skipped:  # the same decision on every rank
        raise DivergedError(
            f"every step of epoch {session.epoch + 1} was skipped: the loss was not finite "
            f"({session.skipped_steps - skipped} steps); lower --lr, or check the data and "
            "--weights"
        )
    session.all_reduce(totals)
    loss_sum, samples = totals.tolist()
    if samples and not math.isfinite(loss_sum):  # the same sum on every rank: every rank raises
        raise DivergedError(
            f"epoch {session.epoch + 1}'s train loss is {loss_sum / samples}: the run diverged "
            f"({session.skipped_steps - skipped} steps skipped); lower --lr, or check the data and --weights"
        )
    result = lockstep.metrics.evaluate(model, test_loader, session)
    return {
        "train_loss": loss_sum / samples if samples else math.nan,
        "test_loss": result["loss"],
        "test_accuracy": result["accuracy"],
        "test_count": int(result["count"]),
        "samples_per_s": samples / max(elapsed, 1e-9),
        "epoch_time_s": elapsed,
        "resumed_at_batch": done,  # the train loss covers the batches after it
        "last_batch": done + batches,  # shown on the screen, not a column
    }


def _progress(session: lockstep.Session, config: TrainConfig, loader: Iterable[Any]) -> Iterable[Any]:
    if config.progress == "off":
        return loader
    desc = f"epoch {session.epoch + 1}/{config.epochs}"
    bar: Iterable[Any]
    if config.progress == "on" and not sys.stderr.isatty():
        # a launcher collects the output line by line (each refresh becomes a line): refresh rarely
        bar = session.progress(loader, force=True, mininterval=5.0, leave=True, desc=desc)
    else:
        bar = session.progress(loader, desc=desc)
    return bar
