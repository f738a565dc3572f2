"""Where ``session.log`` and the session's timings go: TensorBoard, CSV, MLflow, Weights & Biases.

Each logger writes through its own library, installed by the lockstep extra of its name
(``pip install 'lockstep[tensorboard]'``, ``[mlflow]``, ``[wandb]``; CSV needs nothing). Only
rank 0 writes, unless the session is asked for every rank's timings (rank 0 then logs them all).

Example::

    from lockstep.loggers import CSVLogger, TensorBoardLogger
    session = lockstep.Session(loggers=[CSVLogger("runs/a"), TensorBoardLogger("runs/a/tb")])
    session.log({"loss": loss}, step=session.global_step)
"""

from lockstep.loggers.base import Logger, LoggerSet, require, scalars
from lockstep.loggers.files import CSVLogger, TensorBoardLogger
from lockstep.loggers.tracking import MLflowLogger, WandbLogger, tracking_uri

__all__ = [
    "Logger",
    "LoggerSet",
    "CSVLogger",
    "TensorBoardLogger",
    "MLflowLogger",
    "WandbLogger",
    "require",
    "scalars",
    "tracking_uri",
]
