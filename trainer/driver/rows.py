"""A dataset's rows as the batches a model sees: shaped as the pipeline delivers them (a pair,
or a dict batch), after an optional transform; read on whichever process calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dasktrain.datasets import Dataset
from dasktrain.pipeline.named import NamedBatch

__all__ = ["ArraysTransform", "as_batch", "batches", "read_rows"]

ArraysTransform = Callable[[dict[str, np.ndarray], np.random.Generator],
                           dict[str, np.ndarray]]
"""A pipeline transform: ``transform(arrays, rng) -> arrays``."""

#: The generator a transform gets outside a pipeline: evaluation transforms draw nothing,
#: and one that does draws the same numbers every time.
_SEED = 0


def read_rows(dataset: Dataset, start: int, stop: int,
              transform: ArraysTransform | None = None) -> dict[str, np.ndarray]:
    """Rows ``[start, stop)`` of every array, after ``transform`` where one is given."""
    arrays = {n: np.asarray(dataset.zarr_array(n)[start:stop]) for n in dataset.array_names}
    if transform is not None:
        arrays = transform(arrays, np.random.default_rng(_SEED))
    return arrays


def as_batch(dataset: Dataset, arrays: dict[str, np.ndarray], as_dict: bool) -> Any:
    """``arrays`` (rows of every array) as one batch shaped as the pipeline delivers it."""
    tensors = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in arrays.items()}
    if as_dict:
        return NamedBatch(tensors, dataset.roles)
    if dataset.targets_name is None:
        return tensors[dataset.features_name]
    return tensors[dataset.features_name], tensors[dataset.targets_name]


def batches(dataset: Dataset, start: int, stop: int, batch_size: int, as_dict: bool,
            transform: ArraysTransform | None = None) -> Iterator[Any]:
    """The rows [start, stop) as batches shaped as the pipeline delivers them."""
    arrays = read_rows(dataset, start, stop, transform)
    for a in range(0, stop - start, batch_size):
        yield as_batch(dataset, {n: v[a:a + batch_size] for n, v in arrays.items()}, as_dict)
