"""Fitness shaping: a generation's fitness as ranks, and ranks as centred weights.

The driver turns a generation's fitness into ranks once (:func:`ranks_of`); the ranks are
the whole *update record* of that generation: every process advances the algorithm's state
from them (ES weights perturbations by :func:`centered_ranks`, the GA selects by order),
so none depends on how fitness values print or round, and a record is two bytes a member.
"""

from __future__ import annotations

import numpy as np

__all__ = ["centered_ranks", "decode_ranks", "encode_ranks", "ranks_of"]


def ranks_of(values: np.ndarray, maximize: bool) -> np.ndarray:
    """Rank of each member, 0 for the worst and ``n - 1`` for the best; ties go to the
    member of lower index (a stable sort), so the ranks are a permutation."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values if maximize else -values, kind="stable")
    ranks = np.empty(len(values), dtype=np.int64)
    ranks[order] = np.arange(len(values))
    return ranks


def centered_ranks(ranks: np.ndarray) -> np.ndarray:
    """Ranks mapped linearly onto [-0.5, 0.5] (float32): the shaped fitness of OpenAI-ES,
    insensitive to the scale and outliers of the raw values."""
    n = len(ranks)
    if n < 2:
        return np.zeros(n, dtype=np.float32)
    return (np.asarray(ranks, dtype=np.float64) / (n - 1) - 0.5).astype(np.float32)


def _dtype(n: int) -> type:
    return np.uint16 if n <= 2**16 else np.uint32


def encode_ranks(ranks: np.ndarray) -> bytes:
    """Ranks as bytes (two a member up to 65,536 members)."""
    return np.asarray(ranks).astype(_dtype(len(ranks))).tobytes()


def decode_ranks(data: bytes, n: int) -> np.ndarray:
    """The ranks of :func:`encode_ranks` for ``n`` members."""
    return np.frombuffer(data, dtype=_dtype(n), count=n).astype(np.int64)
