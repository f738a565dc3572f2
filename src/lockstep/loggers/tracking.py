"""Loggers that write to an experiment tracker's store: MLflow, and W&B offline (``wandb sync`` uploads it later)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.errors import ConfigError
from lockstep.loggers.base import Logger, require

__all__ = ["MLflowLogger", "WandbLogger", "tracking_uri", "DATABASE"]


DATABASE = "mlflow.db"
"""The sqlite database a folder given to :class:`MLflowLogger` holds."""


def tracking_uri(where: str | Path) -> str:
    """An MLflow tracking URI: a folder becomes the sqlite database ``mlflow.db`` in it; a URI stays as it is.

    Args:
        where: a folder or a tracking URI.
    """
    text = str(where)
    return text if "://" in text or text.startswith("sqlite:") else f"sqlite:///{Path(text).resolve() / DATABASE}"


def _artifacts(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside a sqlite database (not in the working directory)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "artifacts").resolve().as_uri()
    return None


class MLflowLogger(Logger):
    """An MLflow run, written through ``MlflowClient`` (no global active run is touched).

    Args:
        where: a folder (a sqlite database ``mlflow.db`` in it) or a tracking URI (``sqlite:///runs/mlflow.db``).
        experiment: the experiment's name (made if missing).
        run_name: the run's name (MLflow picks one when ``None``).
        params: parameters recorded with the run (values become strings).
    """

    extra = "mlflow"

    def __init__(
        self,
        where: str | Path,
        experiment: str = "lockstep",
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(tracking_uri(where))
        require("mlflow", self.extra, type(self).__name__)
        self.experiment, self.run_name, self.params = experiment, run_name, dict(params or {})
        self.run_id: str | None = None
        self._client: Any = None

    @property
    def location(self) -> str:
        run = f", run {self.run_id}" if self.run_id else ""
        return f"{self.directory} (MLflow experiment {self.experiment}{run})"

    def _open(self) -> None:
        from mlflow.tracking import MlflowClient

        if self.directory.startswith("sqlite:///"):
            Path(self.directory[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        self._client = client = MlflowClient(tracking_uri=self.directory)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else client.create_experiment(self.experiment, artifact_location=_artifacts(self.directory))
        )
        self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        for key, value in self.params.items():
            client.log_param(self.run_id, key, str(value))

    def _write(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def _close(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)


class WandbLogger(Logger):
    """A Weights & Biases run, offline by default: it stays in ``directory/wandb`` until ``wandb sync``.

    Args:
        directory: the folder W&B writes its ``wandb/offline-run-*`` folder into.
        project: the W&B project.
        name: the run's name.
        config: the run's configuration (hyperparameters).
        mode: ``"offline"`` (no network) or ``"online"``.
    """

    extra = "wandb"

    def __init__(
        self,
        directory: str | Path,
        project: str = "lockstep",
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: str = "offline",
    ) -> None:
        super().__init__(directory)
        require("wandb", self.extra, type(self).__name__)
        if mode not in ("offline", "online"):
            raise ConfigError(
                f"WandbLogger(mode={mode!r}): choose 'offline' (no network; wandb sync later) or 'online'"
            )
        self.project, self.name, self.config, self.mode = project, name, dict(config or {}), mode
        self._run: Any = None

    @property
    def location(self) -> str:
        return str(Path(self.directory) / "wandb") + f" (W&B {self.mode} run)"

    def _open(self) -> None:
        import wandb

        Path(self.directory).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off")  # the job's output stays the job's
        self._run = wandb.init(
            mode=self.mode,  # type: ignore[arg-type]  # checked when built
            dir=self.directory,
            project=self.project,
            name=self.name,
            config=self.config,
            settings=settings,
        )

    def _write(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def _close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
