"""What every trainer worker's task is given (sent once per task)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dasktrain.datasets import Dataset
from dasktrain.trainer.worker.compute import BatchCompute

__all__ = ["LossFunction", "WorkerConfig"]

LossFunction = Callable[[Any, Any], torch.Tensor]


@dataclasses.dataclass(kw_only=True, slots=True)
class WorkerConfig:
    """What every trainer worker needs; sent once per worker task."""

    model: Callable[[], torch.nn.Module]
    compute: BatchCompute  # forward, loss and metrics of a batch, and its precision
    data: Dataset
    workers: int
    batch_size: int
    pipeline_options: dict[str, Any]
    mode: str = "sync"
    mode_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: Any = None  # OptimizerConfig, for modes whose workers step locally
    epoch_steps: tuple[int, ...] = ()  # lock-step steps of each epoch of the fit
    device: str | None = None
    torch_threads: int = 1
    timeout: float = 300.0
    clip: tuple[float | None, float | None] = (None, None)  # for modes stepping locally
    assignment: str = "static"  # or "dynamic": batches claimed from the holder on demand
    pause_dask_profiler: bool = True  # see dasktrain.trainer.worker.profiler
