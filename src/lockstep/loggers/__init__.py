"""Where ``session.log`` and the session's timings go: TensorBoard, CSV, MLflow, W&B; only rank 0 writes.

Each logger's library comes with the lockstep extra of its name (``pip install 'lockstep[mlflow]'``).
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
