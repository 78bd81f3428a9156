"""Where perturbations come from: a seed names one vector of standard normal noise.

Every process that knows a run's noise settings draws the same vector for the same seed,
so a member of the population travels as a seed and a generation's update is rebuilt from
seeds. Two sources, one interface (:class:`NoiseSource`):

* :class:`NoiseTable` (``"table"``, the default): one block of standard normal float32
  values made once per process from the run's seed, as in Salimans et al. (2017); a seed
  is an offset into it and a perturbation is a slice, read without any arithmetic. About
  fifteen times cheaper per member than drawing the perturbation (numpy 2.4, 2 cores:
  1.9 ms against 32 ms for a million parameters, ``benchmarks/evolve.py``), at the cost of
  the table's memory in every process (``max(2**22, 4 x parameters)`` values by default:
  16 MiB for models under a million parameters).
* :class:`SeedNoise` (``"generator"``): each perturbation drawn from its own PCG64
  generator; no memory beyond one vector, for models too large for a table.
"""

from __future__ import annotations

import collections
import threading
from typing import Protocol

import numpy as np

__all__ = ["DEFAULT_TABLE_VALUES", "NoiseSource", "NoiseTable", "SeedNoise", "noise_source",
           "table_size"]

#: The least values of a default noise table (16 MiB of float32).
DEFAULT_TABLE_VALUES = 2**22


class NoiseSource(Protocol):
    """Vectors of ``size`` standard normal float32 values, each named by an integer seed."""

    size: int

    def seeds(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` seeds drawn from ``rng`` (int64)."""
        ...

    def vector(self, seed: int) -> np.ndarray:
        """The perturbation of ``seed``: a read-only float32 array of ``size`` values."""
        ...


def table_size(parameters: int, requested: int | None = None) -> int:
    """Values of a noise table for a model of ``parameters``: ``requested`` or the
    default, never fewer than the parameters."""
    if requested is not None:
        if requested < parameters:
            raise ValueError(f"noise_size {requested} is smaller than the model's "
                             f"{parameters} parameters: a perturbation is a slice of the "
                             "table")
        return requested
    return max(DEFAULT_TABLE_VALUES, 4 * parameters)


class NoiseTable:
    """A seed is an offset into one shared table of standard normal values."""

    def __init__(self, table_seed: int, values: int, size: int) -> None:
        if values < size:
            raise ValueError(f"a noise table of {values} values cannot hold perturbations "
                             f"of {size}")
        self.size = size
        self.values = values
        self._table = _table(table_seed, values)

    def seeds(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(0, self.values - self.size + 1, count, dtype=np.int64)

    def vector(self, seed: int) -> np.ndarray:
        return self._table[seed : seed + self.size]


class SeedNoise:
    """A seed seeds its own generator, which draws the perturbation."""

    def __init__(self, size: int) -> None:
        self.size = size

    def seeds(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(0, 2**62, count, dtype=np.int64)

    def vector(self, seed: int) -> np.ndarray:
        values = np.random.Generator(np.random.PCG64(int(seed))).standard_normal(
            self.size, dtype=np.float32)
        values.flags.writeable = False
        return values


def noise_source(kind: str, table_seed: int, size: int, values: int | None = None
                 ) -> NoiseSource:
    """The source of ``kind`` (``"table"`` or ``"generator"``) for perturbations of
    ``size`` values; a table holds ``values`` (see :func:`table_size`)."""
    if kind == "table":
        return NoiseTable(table_seed, table_size(size, values), size)
    if kind == "generator":
        return SeedNoise(size)
    raise ValueError(f"noise must be 'table' or 'generator', got {kind!r}")


# Tables by (seed, values): made once per process, shared by every run that uses the same
# one; the least recently used goes when a third is made.
_TABLES: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()
_TABLES_LOCK = threading.Lock()
_TABLES_KEEP = 2


def _table(seed: int, values: int) -> np.ndarray:
    key = (int(seed), int(values))
    with _TABLES_LOCK:
        found = _TABLES.get(key)
        if found is not None:
            _TABLES.move_to_end(key)
            return found
        table = np.random.Generator(np.random.PCG64(key)).standard_normal(
            values, dtype=np.float32)
        table.flags.writeable = False
        _TABLES[key] = table
        while len(_TABLES) > _TABLES_KEEP:
            _TABLES.popitem(last=False)
        return table
