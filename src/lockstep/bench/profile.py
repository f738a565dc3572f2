"""One process's step, taken apart for ``lockstep bench --project``: what a projection to N devices needs.

Measured on this machine, in this process, without a process group: forward, backward and optimizer
time per step at the per-device batch (medians over the timed steps); the gradient buckets DDP
would form (its order, reversed parameters, a 1 MiB first bucket, then ``bucket_mb``) with each
bucket's bytes and when it is ready during backward (the last of its gradients accumulated, from
``register_post_accumulate_grad_hook``); the FSDP units (``apply_fsdp``'s blocks and the root) with
their parameter bytes; and, for a real ``--data``, the loader's samples/s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError

__all__ = ["StepProfile", "Bucket", "profile_step", "ddp_buckets", "FIRST_BUCKET_MB"]

FIRST_BUCKET_MB = 1.0
"""DDP's first bucket holds at most this much (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``): it goes out early."""


@dataclass(frozen=True)
class Bucket:
    """One DDP gradient bucket.

    Args:
        nbytes: gradient bytes in it.
        ready_s: seconds after backward began when its last gradient was accumulated.
        tensors: gradients in it.
        matrices: the ``(rows, columns)`` of its gradients of two or more dimensions (PowerSGD's input).
        vectors: elements of its one-dimensional gradients (sent uncompressed by PowerSGD).
    """

    nbytes: int
    ready_s: float
    tensors: int
    matrices: tuple[tuple[int, int], ...] = ()
    vectors: int = 0


@dataclass(frozen=True)
class StepProfile:
    """One device's step, measured.

    Args:
        model: the ``--model`` text.
        device: where it ran (``cpu``, ``cuda:0``).
        threads: CPU threads torch used.
        batch_size: samples per step on the device.
        precision: the autocast precision of forward (``fp32``, ``bf16-mixed``, ``fp16-mixed``).
        forward_s: median seconds of forward and loss.
        backward_s: median seconds of backward.
        optimizer_s: median seconds of the optimizer's step and ``zero_grad``.
        param_bytes: bytes of the parameters.
        grad_bytes: bytes of the gradients.
        buckets: DDP's buckets in the order they are all-reduced.
        fsdp_units: parameter bytes of each FSDP unit (blocks, then the root's own).
        loader_samples_per_s: the loader's rate on this machine (``None`` for synthetic data).
        steps: timed steps.
        compute_spread_s: the standard deviation of a step's forward, backward and optimizer over the
            timed steps (0 with one step): what makes ranks wait for the slowest one.
    """

    model: str
    device: str
    threads: int
    batch_size: int
    precision: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    param_bytes: int
    grad_bytes: int
    buckets: tuple[Bucket, ...]
    fsdp_units: tuple[int, ...]
    loader_samples_per_s: float | None = None
    steps: int = 0
    bucket_mb: float = 25.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    compute_spread_s: float = 0.0

    @property
    def compute_s(self) -> float:
        """Forward, backward and optimizer: the step of one device with nothing to communicate."""
        return self.forward_s + self.backward_s + self.optimizer_s

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain JSON values."""
        doc = asdict(self)
        doc["buckets"] = [asdict(b) for b in self.buckets]
        doc["compute_s"] = self.compute_s
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StepProfile:
        """The profile :meth:`to_dict` wrote."""
        fields = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        fields["buckets"] = tuple(
            Bucket(**{**b, "matrices": tuple(tuple(m) for m in b.get("matrices", ()))}) for b in doc["buckets"]
        )
        fields["fsdp_units"] = tuple(doc["fsdp_units"])
        fields["notes"] = tuple(doc.get("notes", ()))
        return cls(**fields)


def ddp_buckets(params: list[nn.Parameter], bucket_mb: float = 25.0, order: list[int] | None = None) -> list[list[int]]:
    """DDP's bucket assignment: parameters in the order their gradients are ready, a 1 MiB first
    bucket, then ``bucket_mb`` each (what DDP's rebuild after the first step does).

    Args:
        params: the model's parameters that need gradients, in ``model.parameters()`` order.
        bucket_mb: the later buckets' cap (DDP's ``bucket_cap_mb``).
        order: parameter indexes in the order their gradients are ready; by default reversed, DDP's
            guess before its first step.

    Returns:
        Each bucket's parameter indexes, in the order DDP all-reduces the buckets.

    Example:
        >>> ddp_buckets([nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))])
        [[1, 0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, FIRST_BUCKET_MB * 2**20
    for index in order if order is not None else reversed(range(len(params))):
        p = params[index]
        current.append(index)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, bucket_mb * 2**20
    if current:
        buckets.append(current)
    return buckets


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, precision: str) -> Any:
    dtypes = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    if precision not in dtypes:
        raise ConfigError(f"--project profiles fp32, bf16-mixed or fp16-mixed, not {precision!r}")
    return torch.autocast(device.type, dtype=dtypes[precision])


def _loader_rate(
    data: str, image_size: int, channels: int, batch_size: int, batches: int, device: torch.device
) -> tuple[float, int]:
    """Samples/s of one rank's shuffled ``make_loader`` over the data set (after its first batch), and its classes."""
    from lockstep.data.loader import make_loader
    from lockstep.zoo.datasets import materialized, open_data, parse_data

    opened = open_data(parse_data(data), image_size, channels)
    loader = make_loader(materialized(opened.train), batch_size, world_size=1, rank=0, drop_last=True, device=device)

    def forever() -> Generator[Any, None, None]:
        while True:
            yield from loader

    stream = forever()
    next(stream)  # the first batch holds the workers' start
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    elapsed = max(time.perf_counter() - start, 1e-9)
    stream.close()
    return batches * batch_size / elapsed, opened.num_classes


def profile_step(
    model: str = "convnet",
    *,
    data: str = "synthetic",
    batch_size: int = 100,
    image_size: int = 28,
    channels: int = 1,
    num_classes: int = 10,
    precision: str = "fp32",
    steps: int = 30,
    warmup: int = 5,
    threads: int = 0,
    bucket_mb: float = 25.0,
    seed: int = 0,
) -> StepProfile:
    """Measure one device's step of ``model`` (see the module's docstring for what).

    Args:
        model: a ``lockstep train`` model name or ``pkg.module:factory``.
        data: ``synthetic`` (a resident random batch) or a data set whose loader is timed too.
        batch_size: samples per step on the device.
        image_size: side of the input images.
        channels: input channels.
        num_classes: classes of the synthetic labels.
        precision: forward's autocast precision.
        steps: timed steps (medians are taken over them).
        warmup: untimed steps first.
        threads: CPU threads (0: torch's choice).
        bucket_mb: DDP's bucket cap.
        seed: seed of weights and batch.
    """
    from lockstep.strategies.fsdp import fsdp_blocks
    from lockstep.zoo.models import ModelSpec

    if steps < 1 or warmup < 0:
        raise ConfigError(f"--project needs at least one timed step, got --max-steps {steps}")
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    loader_rate, classes = None, num_classes
    if data != "synthetic":
        loader_rate, classes = _loader_rate(data, image_size, channels, batch_size, max(steps, 10), device)
    net = ModelSpec(model).build(channels, classes, image_size).to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(f"the model {model!r} has no parameters that need gradients: nothing to project")
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, channels, image_size, image_size, generator=gen).to(device)
    labels = torch.randint(classes, (batch_size,), generator=gen).to(device)
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    ready: dict[int, float] = {}
    clock: Callable[[], float] = time.perf_counter
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

    def hook(index: int) -> Callable[[torch.Tensor], None]:
        def record(_: torch.Tensor) -> None:
            ready[index] = clock()

        return record

    handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    offsets: list[list[float]] = [[] for _ in params]
    net.train()
    try:
        for step in range(warmup + steps):
            ready.clear()
            _sync(device)
            t0 = time.perf_counter()
            with _autocast(device, precision):
                loss = criterion(net(images).float(), labels)
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            t3 = time.perf_counter()
            if step < warmup:
                continue
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
            times["optimizer"].append(t3 - t2)
            for i in range(len(params)):
                offsets[i].append(min(max(ready.get(i, t2) - t1, 0.0), t2 - t1) / max(t2 - t1, 1e-12))
    finally:
        for handle in handles:
            handle.remove()
    backward = statistics.median(times["backward"])
    ready_at = [statistics.median(o) for o in offsets]
    order = sorted(range(len(params)), key=lambda i: (ready_at[i], -i))
    buckets = []
    for indexes in ddp_buckets(params, bucket_mb, order):
        shapes = [tuple(params[i].shape) for i in indexes]
        buckets.append(
            Bucket(
                nbytes=sum(params[i].numel() * params[i].element_size() for i in indexes),
                ready_s=backward * max(ready_at[i] for i in indexes),
                tensors=len(indexes),
                matrices=tuple((s[0], int(torch.Size(s[1:]).numel())) for s in shapes if len(s) >= 2),
                vectors=sum(int(torch.Size(s).numel()) for s in shapes if len(s) < 2),
            )
        )
    blocks = list(fsdp_blocks(net, None))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    units.append(sum(p.numel() * p.element_size() for p in net.parameters() if id(p) not in in_blocks))
    return StepProfile(
        model=model,
        device=str(device),
        threads=torch.get_num_threads(),
        batch_size=batch_size,
        precision=precision,
        forward_s=statistics.median(times["forward"]),
        backward_s=backward,
        optimizer_s=statistics.median(times["optimizer"]),
        param_bytes=sum(p.numel() * p.element_size() for p in net.parameters()),
        grad_bytes=sum(p.numel() * p.element_size() for p in params),
        buckets=tuple(buckets),
        fsdp_units=tuple(u for u in units if u > 0),
        loader_samples_per_s=loader_rate,
        steps=steps,
        bucket_mb=bucket_mb,
        compute_spread_s=_spread(times),
    )


def _spread(times: dict[str, list[float]]) -> float:
    """The standard deviation of the timed steps' forward, backward and optimizer (0 with one step)."""
    totals = [sum(parts) for parts in zip(times["forward"], times["backward"], times["optimizer"])]
    return statistics.pstdev(totals) if len(totals) > 1 else 0.0
