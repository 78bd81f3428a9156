"""Datasets: the Zarr format, opening, preparing from sources, inspecting and verifying;
arrays read in place."""

from dasktrain.datasets.arrays import ArrayDataset, open_arrays
from dasktrain.datasets.config import PrepareConfig
from dasktrain.datasets.dataset import Dataset, open_dataset
from dasktrain.datasets.errors import DatasetError, OutputExistsError, SourceError
from dasktrain.datasets.inspect import VerifyReport, describe, verify
from dasktrain.datasets.prepare import prepare
from dasktrain.datasets.sources import builtin_names

__all__ = [
    "ArrayDataset",
    "Dataset",
    "DatasetError",
    "OutputExistsError",
    "PrepareConfig",
    "SourceError",
    "VerifyReport",
    "builtin_names",
    "describe",
    "open_arrays",
    "open_dataset",
    "prepare",
    "verify",
]
