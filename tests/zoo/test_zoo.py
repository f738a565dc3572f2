"""recipes: models, datasets (digits, MNIST IDX, image folders, synthetic), configuration checks, outputs."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.recipes.checks import check_data
from lockstep.recipes.config import TrainConfig
from lockstep.recipes.outputs import RunLog
from lockstep.session.config import SessionConfig
from lockstep.strategies import check_strategy
from lockstep.zoo.datasets import ImageTensors, SyntheticImages, open_data, parse_data
from lockstep.zoo.folders import CHECK_PER_CLASS
from lockstep.zoo.idx import read_idx, read_mnist, write_idx
from lockstep.zoo.models import ConvNet, build_model, input_channels, load_weights, parse_model
from support.data_files import write_image_folder, write_mnist

# -- models --------------------------------------------------------------------------------------


def test_convnet_is_the_seed_architecture() -> None:
    net = ConvNet(10, channels=1, image_size=28)
    kinds = [type(m) for m in net.layer1] + [type(m) for m in net.layer2]
    assert kinds == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d] * 2
    conv1, conv2 = net.layer1[0], net.layer2[0]
    assert (conv1.in_channels, conv1.out_channels, conv1.kernel_size, conv1.padding) == (1, 16, (5, 5), (2, 2))
    assert (conv2.in_channels, conv2.out_channels, conv2.kernel_size, conv2.padding) == (16, 32, (5, 5), (2, 2))
    assert (net.fc.in_features, net.fc.out_features) == (7 * 7 * 32, 10)


@pytest.mark.parametrize("channels,size", [(1, 28), (3, 8), (1, 30), (3, 64)])
def test_convnet_sized_to_input(channels: int, size: int) -> None:
    net = build_model("convnet", channels, 7, size)
    assert net(torch.zeros(2, channels, size, size)).shape == (2, 7)


def test_torchvision_models_by_name() -> None:
    net = build_model("resnet18", 3, 5, 32)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 5)
    net = build_model("mobilenet_v3_small", 3, 4, 32)
    assert net.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 4)
    assert input_channels("resnet50", 1) == 3 and input_channels("convnet", 1) == 1


def test_unknown_model_refused() -> None:
    with pytest.raises(ConfigError, match="unknown model 'resnet19'"):
        build_model("resnet19", 3, 10, 32)


def test_a_near_miss_gets_the_name_and_a_script_gets_the_form_that_works() -> None:
    from lockstep.zoo.models import check_model, parse_model

    with pytest.raises(ConfigError, match="did you mean 'resnet50'"):
        check_model("resnet5")
    with pytest.raises(ConfigError, match="unknown model 'qwertyuiop'; choose") as far:
        check_model("qwertyuiop")
    assert "did you mean" not in str(far.value) and "module:function" not in str(far.value)  # train takes names only
    with pytest.raises(ConfigError, match=r"--model digits_cnn:build_model, where digits_cnn.py has def build_model"):
        parse_model("digits_cnn.py")  # verify and bench: the user's own factory
    with pytest.raises(ConfigError, match="run your own script with lockstep run scripts/digits_cnn.py"):
        check_model("scripts/digits_cnn.py")  # train


def test_load_weights_skips_the_other_head(tmp_path: Path) -> None:
    source = ConvNet(5, 1, 28)
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "w.pt")
    target = ConvNet(10, 1, 28)
    skipped = load_weights(target, tmp_path / "w.pt")
    assert skipped == ["fc.bias", "fc.weight"]
    assert torch.equal(target.layer1[0].weight, source.layer1[0].weight)


def test_load_weights_refuses_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_weights(ConvNet(), tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read weights file"):
        load_weights(ConvNet(), tmp_path / "junk.pt")
    torch.save(build_model("resnet18", 3, 10, 32).state_dict(), tmp_path / "r.pt")
    with pytest.raises(ConfigError, match="fits only 1 of the model"):
        load_weights(ConvNet(), tmp_path / "r.pt")


# -- datasets ------------------------------------------------------------------------------------


def test_digits_fixed_split_and_shape() -> None:
    a = open_data(parse_data("digits"), image_size=28, channels=1)
    b = open_data(parse_data("digits"), image_size=16, channels=3)
    assert (len(a.train), len(a.test), a.num_classes) == (1500, 297, 10)
    x, y = a.train[0]
    assert x.shape == (1, 28, 28) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert b.train[0][0].shape == (3, 16, 16)
    assert torch.equal(a.test.labels, b.test.labels)  # the split does not depend on the size


def test_image_tensors_resize_repeat_and_materialize() -> None:
    images = torch.arange(2 * 8 * 8, dtype=torch.uint8).reshape(2, 1, 8, 8)
    ds = ImageTensors(images, torch.tensor([0, 1]), image_size=8, channels=3, scale=255.0)
    x, y = ds[1]
    assert x.shape == (3, 8, 8) and int(y) == 1
    assert torch.equal(x[0], x[2]) and torch.allclose(x[0], images[1, 0].float() / 255)
    dense = ds.materialized()
    assert torch.equal(dense[1][0], x)


def test_idx_roundtrip_and_damage(tmp_path: Path) -> None:
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    for name in ("a-idx3-ubyte", "a-idx3-ubyte.gz"):
        write_idx(tmp_path / name, array)
        assert np.array_equal(read_idx(tmp_path / name), array)
    raw = (tmp_path / "a-idx3-ubyte").read_bytes()
    (tmp_path / "cut").write_bytes(raw[:-3])
    with pytest.raises(ConfigError, match="truncated"):
        read_idx(tmp_path / "cut")
    (tmp_path / "png").write_bytes(b"\x89PNG....")
    with pytest.raises(ConfigError, match="not an IDX file"):
        read_idx(tmp_path / "png")


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_folder(tmp_path: Path, gz: bool) -> None:
    write_mnist(tmp_path / "m", gz=gz)
    images, labels = read_mnist(tmp_path / "m", "train")
    assert images.shape == (1200, 8, 8) and labels.dtype == np.int64
    data = open_data(parse_data(f"mnist:{tmp_path / 'm'}"), image_size=12, channels=1)
    assert (len(data.train), len(data.test), data.num_classes) == (1200, 597, 10)
    assert data.train[0][0].shape == (1, 12, 12)


def test_mnist_missing_file_is_named(tmp_path: Path) -> None:
    write_mnist(tmp_path / "m")
    (tmp_path / "m" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError, match="t10k-labels-idx1-ubyte"):
        open_data(parse_data(f"mnist:{tmp_path / 'm'}"), 28, 1)


def test_image_folder_train_val(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "f")
    data = open_data(parse_data(f"imagefolder:{tmp_path / 'f'}"), image_size=16, channels=3)
    assert data.num_classes == 3 and len(data.train) == 27 and len(data.test) == 9
    x, y = data.test[0]
    assert x.shape == (3, 16, 16) and int(y) == 0


def test_image_folder_split_by_fraction(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "f", split=False)
    a = open_data(parse_data(f"imagefolder:{tmp_path / 'f'}"), 16, 3, val_fraction=0.25)
    b = open_data(parse_data(f"imagefolder:{tmp_path / 'f'}"), 16, 3, val_fraction=0.25)
    assert (len(a.train), len(a.test)) == (27, 9)
    assert a.test.indices == b.test.indices  # seeded: the same split every time
    assert not set(a.test.indices) & set(a.train.indices)


def test_bad_folders_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        parse_data(f"imagefolder:{tmp_path / 'nope'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is empty"):
        parse_data(f"imagefolder:{tmp_path / 'empty'}")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(b"x")
    with pytest.raises(ConfigError, match="holds images but no class folders"):
        open_data(parse_data(f"imagefolder:{tmp_path / 'flat'}"), 16, 3)
    with pytest.raises(ConfigError, match="unknown data 'cifar'"):
        parse_data("cifar")
    with pytest.raises(ConfigError, match="needs a folder"):
        parse_data("mnist")


@pytest.mark.parametrize("layout", ["flat", "train/val"])
def test_images_without_class_folders_are_named_so(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "f"
    flat = root if layout == "flat" else root / "train"
    for folder in [flat] if layout == "flat" else [flat, root / "val"]:
        folder.mkdir(parents=True)
        (folder / "a.JPG").write_bytes(b"x")
    with pytest.raises(ConfigError) as info:
        open_data(parse_data(f"imagefolder:{root}"), 16, 3)
    assert str(info.value) == (
        f"{flat} holds images but no class folders: put each class's images in a sub-folder ({flat}/<class>/<image>)"
    )
    (flat / "a.JPG").rename(flat / "notes.txt")
    with pytest.raises(ConfigError, match=f"^{flat} holds no images and no class folders: put each class"):
        open_data(parse_data(f"imagefolder:{root}"), 16, 3)


def test_unreadable_image_named(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "f", per_class=CHECK_PER_CLASS)
    bad = tmp_path / "f" / "train" / "digit1" / "000-broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    with pytest.raises(ConfigError, match="cannot read image .*000-broken.png"):
        open_data(parse_data(f"imagefolder:{tmp_path / 'f'}"), 16, 3)


def test_synthetic_is_deterministic() -> None:
    data = open_data(parse_data("synthetic"), image_size=20, channels=3)
    x, y = data.train[5]
    assert x.shape == (3, 20, 20) and 0 <= int(y) < 10
    assert torch.equal(SyntheticImages(1024, 3, 20, 10, seed=1)[5][0], x)
    assert not torch.equal(data.test[5][0], x)


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"nproc": 0}, "--nproc must be at least 1"),
        ({"strategy": "horovod2"}, "unknown strategy 'horovod2'; choose one of auto"),
        ({"strategy": "fsdp+dp"}, "fsdp shards the model"),
        ({"strategy": "dp", "nproc": 2}, r"strategy='dp' \(--strategy\) drives every GPU from one process"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"model": "nonet"}, "unknown model 'nonet'"),
        ({"resume": True}, "--resume needs --out"),
        ({"pretrained": True, "model": "resnet18"}, "downloads nothing.*--weights FILE"),
        ({"nodes": 2, "node_rank": 2, "master": "h:1"}, "--node-rank 2 is out of range"),
        ({"nodes": 2}, "needs --master"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"data": "imagefolder:/nonexistent/dir"}, "data directory /nonexistent/dir does not exist"),
    ],
)
def test_config_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_session_config_canonical_names_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    options = SessionConfig(strategy=" DDP", precision="O1").resolved
    assert (options.strategy, options.precision) == ("ddp", "fp16-mixed")
    assert SessionConfig().strategy == "auto"
    with pytest.raises(ConfigError, match="strategy 'dp' cannot be used here; choose one of ddp, fsdp"):
        check_strategy("dp", ("ddp", "fsdp"))
    with pytest.raises(ConfigError, match=r"strategy='dp' \(--strategy\) drives every GPU from one process"):
        SessionConfig(strategy="dp").resolved.check_processes(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"sync_bn=True \(--sync-bn\) needs GPUs"):
        SessionConfig(sync_bn=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert SessionConfig(sync_bn=True).sync_bn  # checked against the device the ranks will use: a GPU


def test_model_spec_names_and_factories() -> None:
    assert not parse_model("convnet").is_factory
    assert parse_model("convnet").build(channels=1, num_classes=3, image_size=8)(torch.zeros(2, 1, 8, 8)).shape == (
        2,
        3,
    )
    assert isinstance(parse_model("support.models:tiny_factory").build(), nn.Linear)
    with pytest.raises(ConfigError, match="unknown model 'resnet19'"):
        parse_model("resnet19")
    with pytest.raises(ConfigError, match="no callable 'nothing'"):
        parse_model("support.models:nothing")
    with pytest.raises(ConfigError, match="returned str, not a torch.nn.Module"):
        parse_model("support.models:not_a_module").build()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_sync_bn_refused_on_cpu() -> None:
    with pytest.raises(ConfigError, match=r"sync_bn=True \(--sync-bn\) needs GPUs"):
        TrainConfig(sync_bn=True)


def test_out_with_checkpoints_needs_resume(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-000010").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run; pass --resume"):
        TrainConfig(out=str(tmp_path))
    assert TrainConfig(out=str(tmp_path), resume=True).resume


def test_batch_larger_than_shard() -> None:
    config = TrainConfig(batch_size=751, nproc=2)
    with pytest.raises(ConfigError, match=r"1500 samples / 2 processes = 750"):
        check_data(config, world_size=2)
    assert len(check_data(TrainConfig(batch_size=750), world_size=2).train) == 1500


def test_worker_argv_round_trip(tmp_path: Path) -> None:
    from lockstep.cli.train import add_arguments, config_from_args, worker_argv

    config = TrainConfig(
        model="resnet18", epochs=2, lr=0.1, scale_lr=True, out=str(tmp_path), nproc=2, max_steps=3, image_size=32
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = worker_argv(config)
    again = config_from_args(parser.parse_args(argv))
    assert "--resume" in argv  # a restarted worker continues from the last checkpoint
    assert again.to_dict() == {**config.to_dict(), "resume": True, "progress": again.progress}
    assert again.progress in ("on", "off")


def test_run_log_trims_on_resume(tmp_path: Path) -> None:
    log = RunLog(tmp_path, is_main=True, start_epoch=0)
    log.write_config({"model": "convnet"})
    for epoch in (1, 2, 3):
        log.epoch({"epoch": epoch, "test_accuracy": 0.5 + epoch / 10})
    log.close()
    RunLog(tmp_path, is_main=True, start_epoch=2).close()  # the checkpoint covers 2 epochs
    with open(tmp_path / "metrics.csv") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2"]
    assert (tmp_path / "config.json").read_text().strip().startswith("{")
    RunLog(tmp_path / "other", is_main=False, start_epoch=0).epoch({"epoch": 1})
    assert not (tmp_path / "other").exists()
