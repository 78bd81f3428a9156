"""Preparation sources: files (npy/npz, CSV/Parquet, text, images), bundled data and generators."""

from dasktrain.datasets.sources import (  # noqa: F401  (registers)
    arrays,
    bundled,
    images,
    synthetic,
    tabular,
    text,
)
from dasktrain.datasets.sources.base import (
    ArraySpec,
    Source,
    SourceOptions,
    builtin_names,
    get_source,
)

__all__ = ["ArraySpec", "Source", "SourceOptions", "builtin_names", "get_source"]
