"""The trainer: a central parameter holder (a Dask actor), workers as Dask tasks, the API."""

from dasktrain.trainer import optim
from dasktrain.trainer.callbacks import (
    Callback,
    EarlyStopping,
    ModelCheckpoint,
    ReduceLROnPlateau,
)
from dasktrain.trainer.errors import HolderLost, TrainerError, TrainingDiverged, WorkersPaused
from dasktrain.trainer.history import History
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.modes import MODES, get_mode
from dasktrain.trainer.trainer import Trainer

__all__ = ["MODES", "Callback", "EarlyStopping", "History", "HolderConfig", "HolderLost",
           "ModelCheckpoint", "ParameterHolder", "ReduceLROnPlateau", "Trainer", "TrainerError",
           "TrainingDiverged", "WorkersPaused", "get_mode", "optim"]
