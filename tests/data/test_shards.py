"""Sharded datasets: the shard-aware order, the formats, the writer, the cache, and exactly once through the loader."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lockstep.data import (
    CorruptShardError,
    ShardedDataset,
    ShardLayout,
    image_folder_samples,
    index_shards,
    make_loader,
    plan_batches,
    rank_batches,
    write_shards,
)
from lockstep.data.order import SHARD_PERMUTATION, EpochOrder
from lockstep.data.steps import StepSampler
from lockstep.errors import ConfigError


def _digits(count: int = 300) -> list[tuple[torch.Tensor, int]]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return [
        (torch.tensor(x, dtype=torch.float32).reshape(8, 8), int(y)) for x, y in zip(d.data[:count], d.target[:count])
    ]


def _shard_of(layout: ShardLayout, indices: list[int]) -> list[int]:
    starts = np.cumsum([0, *layout.counts])
    return [int(np.searchsorted(starts, i, side="right") - 1) for i in indices]


# --- the order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 8])
def test_the_shard_order_is_a_permutation_that_reads_few_shards_at_a_time(window: int) -> None:
    rng = np.random.default_rng(window)
    layout = ShardLayout([int(c) for c in rng.integers(0, 40, 29)], window)  # uneven, some empty
    n = layout.samples
    seen = []
    for epoch in range(3):
        order = EpochOrder(n, 7, epoch, permutation=SHARD_PERMUTATION, shards=layout).take(0, n)
        assert sorted(order) == list(range(n))
        assert order == EpochOrder(n, 7, epoch, permutation=SHARD_PERMUTATION, shards=layout).take(0, n)
        shards = _shard_of(layout, order)
        run = min(c for c in layout.counts if c)  # shorter than any shard: spans at most two windows
        assert max(len(set(shards[i : i + run])) for i in range(n - run)) <= 2 * window
        seen.append(order)
    assert seen[0] != seen[1] != seen[2]  # a new order every epoch


@pytest.mark.parametrize(("first", "then"), [(2, 3), (3, 2), (1, 3)])
def test_ranks_share_each_epoch_exactly_once_across_a_change_of_world_size(first: int, then: int) -> None:
    layout = ShardLayout([37, 0, 50, 13, 41, 29, 60, 8], window=3)
    n, global_batch = layout.samples, 10  # 10 does not divide 3: uneven shares
    start = {"seed": 1, "epoch": 2, "cursor": 0, "permutation": SHARD_PERMUTATION}
    trained: list[int] = []
    steps = 7
    for rank in range(first):
        batches = rank_batches(start, n, plan_batches(global_batch, first, 10), rank, shards=layout)
        trained += [i for b in batches[:steps] for i in b]
    moved = {**start, "cursor": steps * global_batch}
    for rank in range(then):
        trained += [
            i for b in rank_batches(moved, n, plan_batches(global_batch, then, 10), rank, shards=layout) for i in b
        ]
    assert sorted(trained) == list(range(n))


def test_a_position_in_the_shard_order_needs_its_dataset_and_window() -> None:
    layout = ShardLayout([5, 5, 5], window=2)
    sampler = StepSampler(15, plan_batches(3, 1, 3), 0, shards=layout)
    state = sampler.state_dict()
    assert state["permutation"] == SHARD_PERMUTATION and state["shard_window"] == 2
    with pytest.raises(ConfigError, match="shuffle window of 2 shards"):
        StepSampler(15, plan_batches(3, 1, 3), 0, shards=ShardLayout([5, 5, 5], window=4)).load_state_dict(state)
    with pytest.raises(ConfigError, match="shuffle window of 2 shards"):
        StepSampler(15, plan_batches(3, 1, 3), 0).load_state_dict(state)
    with pytest.raises(ConfigError, match="needs the sharded dataset"):
        EpochOrder(15, 0, 0, permutation=SHARD_PERMUTATION)
    with pytest.raises(ConfigError, match="at least one shard"):
        ShardLayout([5], window=0)


# --- formats and the writer --------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "fields"), [("tar", ("pth", "cls")), ("jsonl", ("x", "y")), ("parquet", ("x", "y"))])
def test_each_format_round_trips_through_the_writer(tmp_path: Path, fmt: str, fields: tuple[str, str]) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    samples: list[Any] = _digits(250)
    if fmt != "tar":
        samples = [(x.flatten().tolist(), y) for x, y in samples]
    index = write_shards(samples, tmp_path / fmt, fields=fields, samples_per_shard=100, format=fmt)
    assert [s["samples"] for s in index["shards"]] == [100, 100, 50] and index["samples"] == 250
    data = ShardedDataset(tmp_path / fmt, fields=fields)
    assert len(data) == 250 and data.shard_layout.counts == (100, 100, 50)
    for i in (0, 99, 100, 249):
        x, y = data[i]
        assert y == samples[i][1]
        assert torch.equal(x, samples[i][0]) if fmt == "tar" else x == samples[i][0]
    with pytest.raises(IndexError):
        data[250]


def test_an_image_folder_is_written_with_its_own_file_bytes(tmp_path: Path) -> None:
    from PIL import Image

    root = tmp_path / "images"
    for label, cls in enumerate(("cat", "dog")):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((4, 4), 40 * i + label, np.uint8)).save(root / cls / f"{i}.png")
    write_shards(image_folder_samples(root), tmp_path / "shards", samples_per_shard=4)
    data = ShardedDataset(tmp_path / "shards", fields=("png", "cls"), decode=False)
    assert [int(data[i][1]) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert data[4][0] == (root / "dog" / "1.png").read_bytes()
    image, label = ShardedDataset(tmp_path / "shards", fields=("png", "cls"))[4]
    assert label == 1 and np.asarray(image)[0, 0] == 41


def test_shards_of_another_tool_are_indexed_and_bad_input_is_named(tmp_path: Path) -> None:
    write_shards(_digits(30), tmp_path, fields=("pth", "cls"), samples_per_shard=10)
    (tmp_path / "index.json").unlink()
    with pytest.raises(ConfigError, match="no index.json at .*index_shards"):
        ShardedDataset(tmp_path)
    index = index_shards(tmp_path)
    assert [s["samples"] for s in index["shards"]] == [10, 10, 10]
    with pytest.raises(ConfigError, match="name its fields"):
        write_shards([(1, 2)], tmp_path / "x")
    with pytest.raises(KeyError, match="no field 'png'"):
        ShardedDataset(tmp_path, fields=("png",))[0]


# --- through the loader: exactly once at any world size and num_workers ------------------------


def _keys(loader: Any, steps: int | None = None) -> list[str]:
    """The keys a rank trains: of each micro-batch, its share (a rank with no sample in a short last
    step reads one, weighted zero, so that every rank steps)."""
    sampler = loader.sampler
    shares = [hi - lo for lo, hi, _ in sampler.upcoming().shares(sampler.world_size, sampler.rank)]
    out: list[str] = []
    for i, ((keys, _), share) in enumerate(zip(loader, shares)):
        if steps is not None and i == steps:
            break
        out += list(keys)[:share]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_loader_trains_every_sample_once_resumed_at_another_world_size_and_worker_count(tmp_path: Path) -> None:
    write_shards(_digits(230), tmp_path, fields=("pth", "cls"), samples_per_shard=25)
    data = ShardedDataset(tmp_path, fields=("__key__", "cls"), window=2)
    batch, steps = 6, 9
    trained: list[str] = []
    for rank in range(2):  # world 2, two worker processes each, stopped after 9 steps of 12 samples
        loader = make_loader(data, batch, world_size=2, rank=rank, num_workers=2, seed=3, seed_samples=False)
        loader.sampler.set_epoch(1)
        trained += _keys(loader, steps)
    position = {**loader.sampler.state_dict(), "cursor": steps * 2 * batch}
    assert position["permutation"] == SHARD_PERMUTATION
    for rank in range(3):  # resumed at world 3, no workers, the same global batch of 12
        loader = make_loader(data, 4, world_size=3, rank=rank, num_workers=0, seed=3, seed_samples=False)
        loader.sampler.load_state_dict(position)
        loader.sampler.set_epoch(1)
        trained += _keys(loader)
    assert sorted(trained) == sorted(data.raw(i)["__key__"] for i in range(230))
    assert len(set(trained)) == 230


# --- a URL: the cache --------------------------------------------------------------------------


def test_shards_at_a_url_are_cached_checked_and_evicted(s3: Any, tmp_path: Path) -> None:
    url = s3.url()
    index = write_shards(_digits(120), url, fields=("pth", "cls"), samples_per_shard=30)
    shard_bytes = index["shards"][0]["bytes"]
    cache = tmp_path / "cache"
    data = ShardedDataset(url, fields=("pth", "cls"), cache=cache, cache_limit=2 * shard_bytes + 1)
    digits = _digits(120)
    for i in (0, 35, 65, 95):  # four shards through a cache of two
        assert data[i][1] == digits[i][1] and torch.equal(data[i][0], digits[i][0])
    kept = sorted(p.name.split("-", 1)[1] for p in cache.iterdir() if p.is_file())  # "<hash>-<name>"
    assert kept == ["shard-000002.tar", "shard-000003.tar"]
    copy = pickle.loads(pickle.dumps(data))  # as a spawned DataLoader worker gets it
    assert copy[95][1] == digits[95][1]
    # a download left by a process that died is removed by the next cache on the folder
    (cache / ".partial" / "shard-000000.tar.999999999.0000abcd").write_bytes(b"half")
    ShardedDataset(url, cache=cache)
    assert not list((cache / ".partial").iterdir())
    # a shard changed behind the index's back is named, never read
    client = s3.client()
    bucket, prefix = url[len("s3://") :].split("/", 1)
    body = bytearray(client.get_object(Bucket=bucket, Key=f"{prefix}/shard-000001.tar")["Body"].read())
    body[600] ^= 0xFF
    client.put_object(Bucket=bucket, Key=f"{prefix}/shard-000001.tar", Body=bytes(body))
    with pytest.raises(CorruptShardError, match=r"shard-000001.tar differs from the index"):
        ShardedDataset(url, cache=tmp_path / "other")[40]


@pytest.mark.timeout(120)
def test_a_download_killed_mid_way_leaves_nothing_that_stops_the_next_reader(tmp_path: Path) -> None:
    """A reader SIGKILLed while holding a shard's download lock: the kernel drops the lock, the next reader
    fetches the shard and uses it."""
    source = tmp_path / "src"
    write_shards(_digits(40), source, fields=("pth", "cls"), samples_per_shard=20)
    cache = tmp_path / "cache"
    url = f"memory://lockstep-test-{os.getpid()}"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, os\n"
            f"os.makedirs({str(cache / '.locks')!r}, exist_ok=True)\n"
            f"f = open({str(cache / '.locks' / 'shard-000000.tar.lock')!r}, 'a+b')\n"
            "fcntl.lockf(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in source.iterdir():
        fs.pipe_file(f"{url[len('memory://') :]}/{path.name}", path.read_bytes())
    data = ShardedDataset(url, fields=("pth", "cls"), cache=cache)
    assert data[3][1] == _digits(4)[3][1]


@pytest.mark.timeout(200)
def test_the_loader_announces_each_shard_before_its_first_read_and_fetches_it_once(s3: Any, tmp_path: Path) -> None:
    url = s3.url()
    write_shards(_digits(240), url, fields=("pth", "cls"), samples_per_shard=20)  # 12 shards
    data = ShardedDataset(url, fields=("pth", "cls"), cache=tmp_path / "cache", window=2)
    assert data.cache is not None
    events: list[tuple[str, int]] = []
    fetched: list[str] = []
    prefetch, reader, fetch = data.prefetch, data._reader, data.cache._fetch

    def announced(indices: Any) -> None:
        events.extend(("announce", data.shard_of(int(i))[0]) for i in indices)
        prefetch(indices)

    def read(shard: int) -> Any:
        events.append(("read", shard))
        return reader(shard)

    def fetched_once(entry: dict[str, Any], final: Path) -> None:
        fetched.append(entry["name"])
        fetch(entry, final)

    data.prefetch, data._reader, data.cache._fetch = announced, read, fetched_once  # type: ignore[method-assign]
    loader = make_loader(data, 8, world_size=1, rank=0, num_workers=0, seed=1, seed_samples=False)
    assert sum(len(y) for _, y in loader) == 240
    first = {}
    for n, (kind, shard) in enumerate(events):
        first.setdefault((kind, shard), n)
    late = [s for s in range(12) if first.get(("announce", s), len(events)) > first[("read", s)]]
    assert late == []  # the first batch announces everything up to one window ahead
    assert sorted(fetched) == sorted(e["name"] for e in data.shards)  # each shard downloaded once (reads wait)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loader_workers_forked_while_shards_are_prefetched_read_every_sample_once(s3: Any, tmp_path: Path) -> None:
    """Workers forked from a process whose S3 client and prefetch threads are busy make their own client and
    locks (the parent's client is not fork-safe; a lock a prefetch thread held at the fork would never open)."""
    url = s3.url()
    write_shards(_digits(200), url, fields=("pth", "cls"), samples_per_shard=20)
    data = ShardedDataset(url, fields=("__key__", "cls"), cache=tmp_path / "cache", window=2)
    data[0]  # the parent's client in use before the workers fork
    for epoch in range(2):  # workers forked anew each epoch, and an empty cache: they download the first shards
        for shard in (tmp_path / "cache").glob("shard-*"):
            shard.unlink()
        loader = make_loader(
            data, 10, world_size=1, rank=0, num_workers=2, seed=0, seed_samples=False, persistent_workers=False
        )
        loader.sampler.set_epoch(epoch)
        keys = _keys(loader)
        assert sorted(keys) == [f"{i:09d}" for i in range(200)]


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax"])
def test_tar_shards_written_by_other_tools_are_read_with_long_names_and_folders(tmp_path: Path, fmt: str) -> None:
    import io
    import tarfile

    formats = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
    stem = "train/" + ("n" * (40 if fmt == "ustar" else 120))  # past ustar's 100 characters: another header kind
    with tarfile.open(tmp_path / "a.tar", "w", format=formats[fmt]) as tar:
        folder = tarfile.TarInfo("train")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i in range(3):
            for ext, data in (("cls", str(i).encode()), ("txt", f"sample {i}".encode())):
                info = tarfile.TarInfo(f"{stem}{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    index_shards(tmp_path)
    data = ShardedDataset(tmp_path, fields=("__key__", "cls", "txt"))
    assert [data[i] for i in range(3)] == [(f"{stem}{i}", i, f"sample {i}") for i in range(3)]


@pytest.mark.parametrize("fmt", ["tar", "jsonl"])
def test_a_forked_reader_never_moves_the_file_offset_it_shares_with_its_parent(tmp_path: Path, fmt: str) -> None:
    """A DataLoader worker forked after the parent read a shard shares that file's offset with the parent and
    its sibling workers: a read that seeks would hand another process the wrong bytes."""
    rows: list[Any] = _digits(40) if fmt == "tar" else [(x.flatten().tolist(), y) for x, y in _digits(40)]
    fields = ("pth", "cls") if fmt == "tar" else ("x", "y")
    write_shards(rows, tmp_path, fields=fields, samples_per_shard=40, format=fmt)
    data = ShardedDataset(tmp_path, fields=fields)
    assert data[0][1] == rows[0][1]  # the parent holds the shard open
    (reader,) = data._open.values()
    fd = reader.file.fileno()  # type: ignore[attr-defined]
    before = os.lseek(fd, 0, os.SEEK_CUR)
    pid = os.fork()
    if pid == 0:  # the child reads every sample, as a worker would
        ok = all(data[i][1] == rows[i][1] for i in range(40))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.lseek(fd, 0, os.SEEK_CUR) == before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reader_killed_mid_download_leaves_nothing_that_stops_the_next(s3: Any, tmp_path: Path) -> None:
    """SIGKILL of a process while its shard is half downloaded (its partial file growing, its lock held): the
    next reader on the same cache folder removes the partial, takes the lock, fetches the shard and reads it."""
    import signal
    import time

    url = s3.url()
    noise = [({"bin": os.urandom(1 << 20), "cls": i}) for i in range(48)]  # one 48 MiB shard
    write_shards(noise, url, samples_per_shard=48)
    cache = tmp_path / "cache"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom lockstep.data import ShardedDataset\n"
            f"ShardedDataset({url!r}, cache={str(cache)!r})[0]\nprint('read', flush=True)\n",
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    partial = cache / ".partial"
    while reader.poll() is None and not any(p.stat().st_size for p in partial.glob("*") if p.exists()):
        time.sleep(0.01)  # until the download has begun writing
    if reader.poll() is not None:
        pytest.skip("the download finished before the reader could be stopped mid-way")  # a very fast server
    reader.send_signal(signal.SIGKILL)
    reader.wait()
    assert list(partial.glob("*"))  # it left a half download behind
    data = ShardedDataset(url, fields=("bin", "cls"), cache=cache)
    assert not list(partial.glob("*"))  # removed by the next cache on the folder
    assert data[47] == (noise[47]["bin"], 47)


def test_a_shard_set_rewritten_at_the_same_url_is_never_read_from_the_old_copy(tmp_path: Path) -> None:
    url = f"memory://lockstep-rewrite-{os.getpid()}"
    cache = tmp_path / "cache"
    write_shards([(f"s{i}", 3) for i in range(4)], url, fields=("txt", "cls"), samples_per_shard=4)
    assert ShardedDataset(url, fields=("txt", "cls"), cache=cache)[0] == ("s0", 3)
    write_shards([(f"s{i}", 5) for i in range(4)], url, fields=("txt", "cls"), samples_per_shard=4)  # same sizes
    assert ShardedDataset(url, fields=("txt", "cls"), cache=cache)[0] == ("s0", 5)


def test_a_position_resumed_over_shards_of_other_sizes_is_refused() -> None:
    saved = StepSampler(12, plan_batches(4, 1, 4), 0, shards=ShardLayout([4, 4, 4], window=2))
    saved.advance(4)
    resharded = StepSampler(12, plan_batches(4, 1, 4), 0, shards=ShardLayout([6, 6], window=2))
    with pytest.raises(ConfigError, match="another layout of shards"):
        resharded.load_state_dict(saved.state_dict())


def test_bad_shards_and_bad_input_are_named(tmp_path: Path) -> None:
    from lockstep.data.shard_formats import CorruptShardError as FormatError

    assert FormatError is CorruptShardError
    write_shards([(b"x" * 3000, 1), (b"y" * 3000, 2)], tmp_path / "cut", fields=("bin", "cls"), samples_per_shard=2)
    shard = tmp_path / "cut" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:2000])  # cut inside the first member
    with pytest.raises(CorruptShardError, match="cut short"):
        ShardedDataset(tmp_path / "cut")[0]
    with pytest.raises(ConfigError, match="cannot be read back from a tar shard"):
        write_shards([{"__key__": "a.b", "cls": 1}], tmp_path / "dotted")
    with pytest.raises(ConfigError, match="cannot be read back from a tar shard"):
        write_shards([{"__key__": "a", "cls": 1}, {"__key__": "a", "cls": 2}], tmp_path / "twice")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.json").write_text('{"format": "lockstep-shards", "version": 1, "shards": [{"name": 3}]}')
    with pytest.raises(ConfigError, match="needs name, samples, bytes and xxh3_128"):
        ShardedDataset(tmp_path / "bad")
    (tmp_path / "bad" / "index.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        ShardedDataset(tmp_path / "bad")
