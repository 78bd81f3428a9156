"""The trainer: a central parameter holder (a Dask actor), workers as Dask tasks, the API."""

from dasktrain.trainer import optim
from dasktrain.trainer.driver.trainer import Trainer
from dasktrain.trainer.errors import (
    Fenced,
    HolderLost,
    InvalidLoss,
    ShardedWorkerLost,
    TrainerError,
    TrainingDiverged,
    WorkersPaused,
)
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.modes import MODES, get_mode
from dasktrain.trainer.view.callbacks import (
    Callback,
    EarlyStopping,
    ModelCheckpoint,
    ReduceLROnPlateau,
)
from dasktrain.trainer.view.history import History

__all__ = ["MODES", "Callback", "EarlyStopping", "Fenced", "History", "HolderConfig",
           "HolderLost", "InvalidLoss", "ModelCheckpoint", "ParameterHolder",
           "ReduceLROnPlateau", "ShardedWorkerLost", "Trainer", "TrainerError",
           "TrainingDiverged", "WorkersPaused", "get_mode", "optim"]
