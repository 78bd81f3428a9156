"""dasktrain: train PyTorch models on Zarr datasets larger than memory, on a Dask cluster."""

from importlib.metadata import PackageNotFoundError, version

from dasktrain.datasets import (
    Dataset,
    DatasetError,
    PrepareConfig,
    SourceError,
    VerifyReport,
    describe,
    open_dataset,
    prepare,
    verify,
)
from dasktrain.pipeline import EpochPlan, Pipeline, PipelineError

try:
    __version__ = version("dasktrain")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "Dataset",
    "DatasetError",
    "EpochPlan",
    "Pipeline",
    "PipelineError",
    "PrepareConfig",
    "SourceError",
    "VerifyReport",
    "__version__",
    "describe",
    "open_dataset",
    "prepare",
    "verify",
]
