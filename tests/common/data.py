"""Datasets whose samples say who they are: feature 0 and the target are the row index."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import dasktrain as dt


def indexed_dataset(client, directory: Path, rows: int, width: int = 3,
                    chunk_rows: int = 100, split: str | None = None) -> dt.Dataset:
    x = np.zeros((rows, width), dtype=np.float32)
    x[:, 0] = np.arange(rows)
    x[:, 1:] = np.random.default_rng(0).standard_normal((rows, width - 1))
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", np.arange(rows, dtype=np.int64))
    return dt.prepare(directory / "x.npy", directory / "indexed.zarr", client=client,
                      target=str(directory / "y.npy"), chunk_rows=chunk_rows, split=split,
                      progress=False)


def slowly(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A transform whose units take a while to compute (a third of a second each): work
    that is still running when a consumer stops."""
    time.sleep(0.3)
    return arrays
