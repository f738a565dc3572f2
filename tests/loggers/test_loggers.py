"""The loggers behind ``session.log``: the same job logged to CSV, TensorBoard, MLflow and W&B
(offline) reads back the same series, each store read with its own library; a missing library
is one error at construction naming the extra to install."""

from __future__ import annotations

import csv
import glob
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.errors import ConfigError
from lockstep.loggers import CSVLogger, MLflowLogger, TensorBoardLogger, WandbLogger


def _job(loggers: list[Any]) -> dict[str, list[tuple[int, float]]]:
    """Train a tiny model 6 steps, logging loss and lr each step; return what was logged."""
    session = lockstep.Session(quiet=True, loggers=loggers, log_timings="off")
    model, opt = session.setup(nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    logged: dict[str, list[tuple[int, float]]] = {"loss": [], "lr": []}
    for x, y in session.loader(data, 4, shuffle=False):
        loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        session.step(opt)
        session.log({"loss": loss, "lr": 0.1, "note": "not a number"})  # at the global step
        logged["loss"].append((session.global_step, loss.item()))
        logged["lr"].append((session.global_step, 0.1))
    session.close()
    return logged


def _wandb_records(folder: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file, decoded with wandb's own protobuf messages.

    The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of records (crc, length,
    type: full, first, middle, last), each record one ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, parts, records = Path(path).read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(parts + chunk)
            parts = b""
        elif kind in (2, 3):
            parts += chunk
    decoded = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        decoded.append(record)
    return decoded


def _read_wandb(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The metric series of an offline run: its history records."""
    import json

    out: dict[str, list[tuple[int, float]]] = {}
    for record in _wandb_records(folder):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "_step" not in items:
                items["_step"] = record.history.step.num
            for key, value in items.items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((int(items["_step"]), float(value)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_store_reads_back_the_same_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for those who ask
    mlflow_file = MLflowLogger((tmp_path / "mlruns").as_uri(), experiment="e")
    mlflow_sql = MLflowLogger(tmp_path / "mlflow", experiment="e")  # a folder: sqlite in it
    loggers = [
        CSVLogger(tmp_path / "csv"),
        TensorBoardLogger(tmp_path / "tb"),
        mlflow_file,
        mlflow_sql,
        WandbLogger(tmp_path / "wb", project="p"),
    ]
    logged = _job(loggers)
    assert [s for s, _ in logged["loss"]] == [1, 2, 3, 4, 5, 6]

    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    stores = {"csv": {key: [(int(r["step"]), float(r[key])) for r in rows] for key in logged}}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    stores["tensorboard"] = {key: [(e.step, e.value) for e in events.Scalars(key)] for key in logged}
    for name, logger in (("mlflow-file", mlflow_file), ("mlflow-sqlite", mlflow_sql)):
        client = MlflowClient(tracking_uri=logger.directory)
        stores[name] = {
            key: sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, key)) for key in logged
        }
        assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()
    stores["wandb"] = {key: series for key, series in _read_wandb(tmp_path / "wb").items() if key in logged}
    runs = [r.run for r in _wandb_records(tmp_path / "wb") if r.WhichOneof("record_type") == "run"]
    assert runs and {r.project for r in runs} == {"p"}  # the project given reaches wandb
    for name, series in stores.items():
        assert set(series) == set(logged), name
        for key, values in series.items():
            assert [s for s, _ in values] == [s for s, _ in logged[key]], (name, key)
            assert [v for _, v in values] == pytest.approx([v for _, v in logged[key]], rel=1e-6), (name, key)


@pytest.mark.parametrize(
    "module, build",
    [
        ("tensorboard", lambda p: TensorBoardLogger(p)),
        ("mlflow", lambda p: MLflowLogger(p)),
        ("wandb", lambda p: WandbLogger(p)),
    ],
)
def test_a_missing_library_is_named_with_its_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str, build: Any
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    with pytest.raises(ConfigError, match=rf"needs the {module} package.*pip install 'lockstep\[{module}\]'"):
        build(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was created


def test_only_rank_zero_writes_and_the_folder_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lockstep.loggers import LoggerSet

    quiet = LoggerSet([CSVLogger(tmp_path / "r1")], active=False, say=print)
    quiet.log({"loss": 1.0}, step=1)
    quiet.close()
    assert not (tmp_path / "r1").exists()
    main = LoggerSet([CSVLogger(tmp_path / "r0")], active=True, say=print)
    main.log({"loss": torch.tensor(0.5), "name": "x"}, step=1)
    main.log({"loss": 0.25}, step=2)
    main.close()
    assert capsys.readouterr().out.count(f"logging to {tmp_path / 'r0' / 'metrics.csv'}") == 1
    assert (tmp_path / "r0" / "metrics.csv").read_text().splitlines() == ["step,loss", "1,0.5", "2,0.25"]


def test_csv_widens_its_header_and_resumes_before_a_step(tmp_path: Path) -> None:
    first = CSVLogger(tmp_path)
    first.log({"loss": 1.0}, step=1)
    first.log({"loss": 0.5, "acc": 0.7}, step=2)  # a new name: the header widens
    first.log({"loss": 0.4}, step=3)
    first.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,loss,acc", "1,1,", "2,0.5,0.7", "3,0.4,"]
    again = CSVLogger(tmp_path)
    again.resume_at(3)  # the checkpoint was at step 2: step 3 is trained (and logged) again
    again.log({"loss": 0.45}, step=3)
    again.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,loss,acc", "1,1,", "2,0.5,0.7", "3,0.45,"]
    fixed = CSVLogger(tmp_path / "fixed", columns=("epoch", "step", "loss"), step_column="step")
    fixed.log({"epoch": 1, "loss": 0.3, "other": 2.0}, step=10)
    fixed.log({"timings/compute_s": 0.1}, step=11)  # none of its columns: no row
    fixed.close()
    assert (tmp_path / "fixed" / "metrics.csv").read_text().splitlines() == ["epoch,step,loss", "1,10,0.3"]
