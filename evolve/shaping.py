"""Fitness shaping: a generation's fitness as ranks, and ranks as centred weights.

The driver turns a generation's fitness into ranks once (:func:`ranks_of`); the ranks are
the whole *update record* of that generation: every process advances the algorithm's state
from them (ES weights perturbations by :func:`centered_ranks`, the GA selects by order),
so none depends on how fitness values print or round. A record is ``ceil(log2 n)`` bits a
member (:func:`encode_ranks`): 36 bytes for a population of 48.
"""

from __future__ import annotations

import numpy as np

__all__ = ["centered_ranks", "decode_ranks", "encode_ranks", "rank_bits", "ranks_of",
           "ranks_size"]


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


def rank_bits(n: int) -> int:
    """Bits one rank of ``n`` members takes: ``ceil(log2 n)``, at least 1."""
    return max(1, (n - 1).bit_length())


def ranks_size(n: int) -> int:
    """Bytes of :func:`encode_ranks` for ``n`` members."""
    return (n * rank_bits(n) + 7) // 8


def encode_ranks(ranks: np.ndarray) -> bytes:
    """Ranks (a permutation of ``0 .. n - 1``) packed in :func:`rank_bits` bits each, most
    significant bit first, in :func:`ranks_size` bytes."""
    ranks = np.asarray(ranks, dtype=np.int64)
    bits = rank_bits(len(ranks))
    # (n, bits) array of the binary digits, highest first.
    digits = (ranks[:, None] >> np.arange(bits - 1, -1, -1)) & 1
    return np.packbits(digits.astype(np.uint8).reshape(-1)).tobytes()


def decode_ranks(data: bytes, n: int) -> np.ndarray:
    """The ranks of :func:`encode_ranks` for ``n`` members."""
    bits = rank_bits(n)
    digits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=ranks_size(n)),
                           count=n * bits).reshape(n, bits).astype(np.int64)
    return digits @ (np.int64(1) << np.arange(bits - 1, -1, -1))
