"""Preparation sources: files (npy/npz, CSV/Parquet), bundled datasets and generators."""

from dasktrain.datasets.sources import arrays, bundled, synthetic, tabular  # noqa: F401  (registers)
from dasktrain.datasets.sources.base import (
    ArraySpec,
    Source,
    SourceOptions,
    builtin_names,
    get_source,
)

__all__ = ["ArraySpec", "Source", "SourceOptions", "builtin_names", "get_source"]
