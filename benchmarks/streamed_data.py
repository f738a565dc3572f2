"""Streamed datasets side by side: samples/s per rank and an exactly-once ledger, at world 2.

One ImageFolder-like workload (PNG images decoded, randomly cropped and normalised by two loader
workers per rank, batch 32 per rank) read by:

* ``dataloader``: torchvision's ``ImageFolder`` on local disk, ``DistributedSampler`` + ``set_epoch``,
  a plain ``DataLoader`` (the seed tutorials' loop): the reference;
* ``lockstep-local``: ``lockstep.data.ShardedDataset`` over tar shards in a local folder,
  through ``make_loader`` (the loader ``session.loader`` builds);
* ``lockstep-s3``: the same shards on an S3 server, a cold cache in epoch 0, warm in epoch 1;
* ``mosaic-s3``: Mosaic Streaming's ``StreamingDataset`` over MDS shards of the same images on
  the same server (cold, then warm);
* ``litdata-s3``: litData's ``StreamingDataset`` over its optimized chunks on the same server.

Each arm builds its loader once, with its library's defaults (lockstep keeps its workers between
epochs, a plain ``DataLoader`` forks them anew), and runs two epochs; epoch 0's time includes
building the loader and, from S3, filling the cache.

Each rank records the id of every sample it was handed; the ledger counts, per epoch, the ids
handed out twice (duplicates) and never (drops) over both ranks. The arms take turns round by
round (a new order each round) so the machine's load falls on all alike; the table gives medians.

The server is ``weed mini`` (SeaweedFS) started on free local ports, as the tests start it; the
peers need their own environment (Mosaic pins ``numpy<2.2``): ``make streaming-peers`` builds
``.venv-streaming`` with both and this package. An arm whose package does not import is left out
with one line.

Run::

    make streaming-peers
    OMP_NUM_THREADS=1 .venv-streaming/bin/python benchmarks/streamed_data.py --images 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("dataloader", "lockstep-local", "lockstep-s3", "mosaic-s3", "litdata-s3")
BATCH, WORKERS, WORLD = 32, 2, 2
SHARD_SAMPLES = 256


def _transform() -> Any:
    import torchvision.transforms as T

    return T.Compose([T.RandomCrop(56), T.ToTensor(), T.Normalize((0.5,) * 3, (0.25,) * 3)])


def _png(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def make_images(folder: Path, count: int) -> None:
    """``count`` 64x64 RGB PNGs (digits, upscaled and tinted) in ``folder/<class>/<id>.png``."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    for i in range(count):
        k = i % len(digits.target)
        gray = (digits.images[k] * 16).clip(0, 255).astype(np.uint8)
        big = np.kron(gray, np.ones((8, 8), np.uint8))
        rgb = np.stack([big, np.roll(big, 3, 1), rng.integers(0, 255, big.shape, dtype=np.uint8)], -1)
        (folder / str(digits.target[k])).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb).save(folder / str(digits.target[k]) / f"{i:07d}.png")


# --- the arms, built inside a rank -------------------------------------------------------------


class _Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, folder: Path) -> None:
        from torchvision.datasets import ImageFolder

        self.inner = ImageFolder(str(folder), transform=_transform())
        self.ids = [int(Path(p).stem) for p, _ in self.inner.samples]

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        x, y = self.inner[i]
        return x, y, self.ids[i]


def _lockstep_sample(sample: tuple[Any, int, str]) -> tuple[Any, int, int]:
    png, label, key = sample
    return _transform()(_png(png)), label, int(key)


def _dataloader_arm(work: Path, rank: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    data = _Indexed(work / "images")
    sampler = DistributedSampler(data, WORLD, rank, shuffle=True, seed=0)
    return DataLoader(data, BATCH, sampler=sampler, num_workers=WORKERS)


def _lockstep_arm(location: str, cache: Path, rank: int) -> Any:
    from lockstep.data import ShardedDataset, make_loader

    data = ShardedDataset(
        location, fields=("png", "cls", "__key__"), decode=False, transform=_lockstep_sample, cache=cache
    )
    return make_loader(data, BATCH, world_size=WORLD, rank=rank, num_workers=WORKERS, seed=0, seed_samples=False)


def _mosaic_arm(remote: str, local: Path) -> Any:
    from torch.utils.data import DataLoader

    data = _mosaic_images()(remote=remote, local=str(local), shuffle=True, batch_size=BATCH, shuffle_seed=0)
    return DataLoader(data, BATCH, num_workers=WORKERS)


def _mosaic_images() -> Any:
    """Mosaic's ``StreamingDataset`` yielding ``(image, label, id)``, made once (module level, so workers
    unpickle it)."""
    global MosaicImages
    if "MosaicImages" not in globals():
        from streaming import StreamingDataset

        class MosaicImages(StreamingDataset):  # type: ignore[misc,no-redef]
            def __getitem__(self, i: int) -> Any:
                row = super().__getitem__(i)
                return _transform()(_png(row["png"])), row["cls"], row["id"]

        MosaicImages.__qualname__ = "MosaicImages"
    return MosaicImages


def _litdata_over_http() -> None:
    """Let litData's async S3 client (obstore) reach the local server over http:// (it refuses a plain
    http endpoint unless told): the one change made to a peer, which real S3 over https does not need."""
    import obstore.store

    made = obstore.store.S3Store
    if getattr(made, "_over_http", False):
        return

    def over_http(*args: Any, **kwargs: Any) -> Any:
        kwargs["client_options"] = {**(kwargs.get("client_options") or {}), "allow_http": True}
        return made(*args, **kwargs)

    over_http._over_http = True  # type: ignore[attr-defined]
    obstore.store.S3Store = over_http


def _litdata_arm(remote: str, cache: Path, options: dict[str, Any]) -> Any:
    import litdata

    _litdata_over_http()
    data = _litdata_images()(remote, cache_dir=str(cache), shuffle=True, seed=0, storage_options=options)
    return litdata.StreamingDataLoader(data, batch_size=BATCH, num_workers=WORKERS)


def _litdata_images() -> Any:
    """litData's ``StreamingDataset`` yielding ``(image, label, id)`` (module level, as above)."""
    global LitImages
    if "LitImages" not in globals():
        import litdata

        class LitImages(litdata.StreamingDataset):  # type: ignore[misc,no-redef]
            def __getitem__(self, i: Any) -> Any:
                row = super().__getitem__(i)
                return _transform()(_png(row["png"])), row["cls"], row["id"]

        LitImages.__qualname__ = "LitImages"
    return LitImages


def _rank(rank: int, arm: str, work: str, setup: dict[str, Any], rdzv: str, out: str) -> None:
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)  # every arm's workers forked, as on Linux by default
    os.environ.update(setup["env"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=WORLD)
    _transform(), _png  # noqa: B018 - imported here, before any worker forks, as a training script imports them
    import PIL.PngImagePlugin  # noqa: F401

    base = Path(work)
    cache = base / "caches" / f"{arm}-{setup['run']}" / f"rank{rank if arm == 'litdata-s3' else 0}"
    results = []
    start = time.perf_counter()
    if arm == "dataloader":
        loader = _dataloader_arm(base, rank)
    elif arm == "lockstep-local":
        loader = _lockstep_arm(str(base / "shards"), cache, rank)
    elif arm == "lockstep-s3":
        loader = _lockstep_arm(setup["urls"]["lockstep"], cache, rank)
    elif arm == "mosaic-s3":
        loader = _mosaic_arm(setup["urls"]["mosaic"], cache)
    else:
        loader = _litdata_arm(setup["urls"]["litdata"], cache, setup["litdata_options"])
    for epoch in range(2):  # one loader for both epochs, as a training loop keeps it
        if epoch:
            start = time.perf_counter()
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)  # Mosaic and litData count epochs themselves
        ids: list[int] = []
        for _, _, batch_ids in loader:
            ids += [int(i) for i in batch_ids]
        results.append({"seconds": time.perf_counter() - start, "ids": ids})
        dist.barrier()
    Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_arm(arm: str, work: Path, setup: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks of one arm for two epochs: per epoch, each rank's seconds and the ids handed out."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        outs = [f"{tmp}/rank{r}.json" for r in range(WORLD)]
        mp.start_processes(
            _wrapped, args=(arm, str(work), setup, f"file://{tmp}/rdzv", outs), nprocs=WORLD, start_method="spawn"
        )
        per_rank = [json.loads(Path(o).read_text()) for o in outs]
    return [{"seconds": [r[e]["seconds"] for r in per_rank], "ids": [r[e]["ids"] for r in per_rank]} for e in range(2)]


def _wrapped(rank: int, arm: str, work: str, setup: dict[str, Any], rdzv: str, outs: list[str]) -> None:
    _rank(rank, arm, work, setup, rdzv, outs[rank])


def ledger(ids_by_rank: list[list[int]], total: int) -> tuple[int, int]:
    """(duplicates, drops) of one epoch over every rank."""
    counts = Counter(i for ids in ids_by_rank for i in ids)
    return sum(c - 1 for c in counts.values() if c > 1), total - len(counts)


# --- preparing the data ------------------------------------------------------------------------


def prepare(work: Path, images: int, arms: list[str], s3: Any) -> dict[str, Any]:
    from lockstep.data import image_folder_samples, write_shards

    make_images(work / "images", images)
    samples = list(image_folder_samples(work / "images"))
    # the ledger's id: the image's own number (its file name); samples come in ImageFolder's order
    from torchvision.datasets import ImageFolder

    file_ids = [int(Path(p).stem) for p, _ in ImageFolder(str(work / "images")).samples]
    for s, fid in zip(samples, file_ids):
        s["__key__"] = f"{fid:09d}"
    write_shards(samples, work / "shards", samples_per_shard=SHARD_SAMPLES)
    setup: dict[str, Any] = {"env": dict(s3.env) if s3 else {}, "urls": {}, "litdata_options": {}, "run": 0}
    if s3 is None:
        return setup
    os.environ.update(s3.env)
    setup["urls"]["lockstep"] = s3.url("lockstep")
    write_shards(samples, setup["urls"]["lockstep"], samples_per_shard=SHARD_SAMPLES)
    rows = [{"png": s["png"], "cls": s["cls"], "id": int(s["__key__"])} for s in samples]
    if "mosaic-s3" in arms:
        from streaming import MDSWriter

        setup["urls"]["mosaic"] = s3.url("mosaic")
        setup["env"]["S3_ENDPOINT_URL"] = s3.endpoint  # how Mosaic Streaming finds an S3-compatible server
        os.environ["S3_ENDPOINT_URL"] = s3.endpoint
        with MDSWriter(
            out=(str(work / "mds"), setup["urls"]["mosaic"]),
            columns={"png": "bytes", "cls": "int", "id": "int"},
            size_limit=SHARD_SAMPLES * len(rows[0]["png"]) * 2,
        ) as writer:
            for row in rows:
                writer.write(row)
    if "litdata-s3" in arms:
        import litdata

        setup["urls"]["litdata"] = s3.url("litdata")
        options = {"endpoint_url": s3.endpoint}
        setup["litdata_options"] = options
        _litdata_over_http()
        litdata.optimize(
            fn=_identity,
            inputs=rows,
            output_dir=setup["urls"]["litdata"],
            chunk_size=SHARD_SAMPLES,
            num_workers=1,
            storage_options=options,
            verbose=False,
        )
    return setup


def _identity(row: dict[str, Any]) -> dict[str, Any]:
    return row


def available(arm: str) -> str | None:
    """Why ``arm`` cannot run here, or ``None``."""
    needs = {"mosaic-s3": "streaming", "litdata-s3": "litdata"}.get(arm)
    if needs is None:
        return None
    try:
        __import__(needs)
    except ImportError:
        return f"{arm}: left out ({needs} does not import here; make streaming-peers builds .venv-streaming with it)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--images", type=int, default=4000, help="images (default 4000: not a multiple of the global batch)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; every arm runs once per round (default 3)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms (default all: {','.join(ARMS)})")
    parser.add_argument("--work", default="", help="a folder for the data and caches (default: a temporary one)")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    for arm in list(arms):
        if (why := available(arm)) is not None:
            print(why)
            arms.remove(arm)
    sys.path.insert(0, str(ROOT / "tests"))
    from support.s3 import start_s3

    work = Path(args.work or tempfile.mkdtemp(prefix="lockstep-streaming-"))
    s3 = start_s3(work / "s3") if any(a.endswith("-s3") for a in arms) else None
    try:
        setup = prepare(work, args.images, arms, s3)
        results: dict[str, list[list[dict[str, Any]]]] = {a: [] for a in arms}
        for round_number in range(args.rounds):
            order = arms[round_number % len(arms) :] + arms[: round_number % len(arms)]
            for arm in order:
                setup["run"] = round_number
                if arm == "mosaic-s3":
                    from streaming.base.util import clean_stale_shared_memory

                    clean_stale_shared_memory()
                results[arm].append(run_arm(arm, work, setup))
                shutil.rmtree(work / "caches", ignore_errors=True)
        print(report(results, args.images, args.rounds))
    finally:
        if s3 is not None:
            s3.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict[str, list[list[dict[str, Any]]]], images: int, rounds: int) -> str:
    """The table: per arm, samples/s per rank (median over rounds) in epoch 0 and 1, the ratio to the
    plain DataLoader, and the ledger of each epoch (duplicates/drops, summed over rounds)."""
    load = os.getloadavg()[0]
    lines = [
        f"{images} images, world {WORLD}, batch {BATCH} per rank, {WORKERS} workers per rank, {rounds} rounds, "
        f"load average {load:.1f} on {os.cpu_count()} cores",
        "| arm | epoch 0 samples/s per rank | epoch 1 | / dataloader (0, 1) | ledger epoch 0: dup/drop | epoch 1 |",
        "|---|---|---|---|---|---|",
    ]

    def rate(runs: list[list[dict[str, Any]]], epoch: int) -> float:
        return statistics.median(
            statistics.mean(len(ids) / s for ids, s in zip(run[epoch]["ids"], run[epoch]["seconds"])) for run in runs
        )

    base = [rate(results["dataloader"], e) for e in range(2)] if results.get("dataloader") else None
    for arm, runs in results.items():
        r0, r1 = rate(runs, 0), rate(runs, 1)
        ratio = f"{r0 / base[0]:.2f}, {r1 / base[1]:.2f}" if base else "-"
        books = []
        for e in range(2):
            dup = sum(ledger(run[e]["ids"], images)[0] for run in runs)
            drop = sum(ledger(run[e]["ids"], images)[1] for run in runs)
            books.append(f"{dup}/{drop}")
        lines.append(f"| {arm} | {r0:.0f} | {r1:.0f} | {ratio} | {books[0]} | {books[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
