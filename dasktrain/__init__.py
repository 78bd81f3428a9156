"""dasktrain: train PyTorch models on Zarr datasets larger than memory, on a Dask cluster."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from dasktrain._cluster import get_client
from dasktrain.datasets import (
    ArrayDataset,
    Dataset,
    DatasetError,
    OutputExistsError,
    PrepareConfig,
    SourceError,
    VerifyReport,
    describe,
    open_arrays,
    open_dataset,
    prepare,
    verify,
)
from dasktrain.datasets.tokenizers import load_tokenizer
from dasktrain.errors import ClusterStuck, DasktrainError

try:
    __version__ = version("dasktrain")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

# Names whose modules import torch load on first use: preparing or inspecting a dataset (and
# every Dask worker that only runs preparation tasks) never pays for importing torch.
_LAZY = {
    "EpochPlan": "dasktrain.pipeline",
    "NamedBatch": "dasktrain.pipeline",
    "Pipeline": "dasktrain.pipeline",
    "PipelineError": "dasktrain.pipeline",
    "Callback": "dasktrain.trainer",
    "JsonLinesLogger": "dasktrain.trainer.view.loggers",
    "LiveView": "dasktrain.trainer.view.live",
    "MLflowLogger": "dasktrain.trainer.view.loggers",
    "TensorBoardLogger": "dasktrain.trainer.view.loggers",
    "compare": "dasktrain.trainer.view.compare",
    "EarlyStopping": "dasktrain.trainer",
    "History": "dasktrain.trainer",
    "Fenced": "dasktrain.trainer",
    "HolderLost": "dasktrain.trainer",
    "InvalidLoss": "dasktrain.trainer",
    "ModelCheckpoint": "dasktrain.trainer",
    "ParameterHolder": "dasktrain.trainer",
    "ReduceLROnPlateau": "dasktrain.trainer",
    "ShardedWorkerLost": "dasktrain.trainer",
    "Trainer": "dasktrain.trainer",
    "TrainerError": "dasktrain.trainer",
    "TrainingDiverged": "dasktrain.trainer",
    "WorkersPaused": "dasktrain.trainer",
    "EvolutionError": "dasktrain.evolve",
    "EvolutionHistory": "dasktrain.evolve",
    "Evolver": "dasktrain.evolve",
    "FitnessFailed": "dasktrain.evolve",
    "InvalidFitness": "dasktrain.evolve",
}


def __getattr__(name: str) -> Any:
    if name == "optim":  # dt.optim.sgd(...): plain configs, no torch import until built
        return import_module("dasktrain.trainer.optim")
    if name == "images":  # dt.images.ImageTransform(...): decoding and augmentation
        return import_module("dasktrain.pipeline.images")
    if name == "evolve":  # dt.evolve.es(...), dt.evolve.ga(...): gradient-free training
        return import_module("dasktrain.evolve")
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dasktrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazily imported names too, for tab completion and documentation tools.
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ArrayDataset",
    "Callback",
    "ClusterStuck",
    "DasktrainError",
    "Dataset",
    "DatasetError",
    "EarlyStopping",
    "EpochPlan",
    "EvolutionError",
    "EvolutionHistory",
    "Evolver",
    "Fenced",
    "FitnessFailed",
    "History",
    "HolderLost",
    "InvalidFitness",
    "InvalidLoss",
    "JsonLinesLogger",
    "LiveView",
    "MLflowLogger",
    "ModelCheckpoint",
    "NamedBatch",
    "OutputExistsError",
    "ParameterHolder",
    "Pipeline",
    "PipelineError",
    "PrepareConfig",
    "ReduceLROnPlateau",
    "ShardedWorkerLost",
    "SourceError",
    "TensorBoardLogger",
    "Trainer",
    "TrainerError",
    "TrainingDiverged",
    "VerifyReport",
    "WorkersPaused",
    "__version__",
    "compare",
    "describe",
    "evolve",
    "get_client",
    "images",
    "load_tokenizer",
    "open_arrays",
    "open_dataset",
    "optim",
    "prepare",
    "verify",
]
