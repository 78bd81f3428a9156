"""Per-feature statistics computed chunk by chunk and merged exactly (Chan et al.).

Each chunk task returns a small :class:`Moments` (or :class:`ClassCounts`); the client merges
them, so statistics of a dataset of any size cost one pass and O(features) memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["ClassCounts", "Moments", "merge_all", "summary_of"]

#: Integer targets with labels in [0, _MAX_CLASSES) get per-class counts.
_MAX_CLASSES = 100_000


@dataclasses.dataclass(slots=True)
class Moments:
    """Count, mean, sum of squared deviations, min and max per feature (float64)."""

    count: int
    mean: np.ndarray
    m2: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray

    @classmethod
    def of(cls, block: np.ndarray) -> Moments:
        """Moments of a block of shape (rows, *feature_shape)."""
        block = np.asarray(block)
        shape = block.shape[1:]
        if len(block) == 0:
            inf = np.full(shape, np.inf)
            return cls(0, np.zeros(shape), np.zeros(shape), inf, -inf)
        flat = block.reshape(len(block), -1)
        # Deviations in float64 (one copy, centred in place); einsum avoids a squared temporary.
        values = flat.astype(np.float64)
        mean = values.mean(axis=0)
        values -= mean
        m2 = np.einsum("ij,ij->j", values, values)
        return cls(len(block), mean.reshape(shape), m2.reshape(shape),
                   flat.min(axis=0).astype(np.float64).reshape(shape),
                   flat.max(axis=0).astype(np.float64).reshape(shape))

    def merge(self, other: Moments) -> Moments:
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        count = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / count)
        return Moments(count, mean, m2, np.minimum(self.minimum, other.minimum),
                       np.maximum(self.maximum, other.maximum))

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / max(self.count, 1))

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.tolist(), "std": self.std.tolist(),
                "min": self.minimum.tolist(), "max": self.maximum.tolist()}


@dataclasses.dataclass(slots=True)
class ClassCounts:
    """Moments of integer labels plus, for small non-negative labels, a count per class."""

    moments: Moments
    counts: np.ndarray | None

    @classmethod
    def of(cls, block: np.ndarray) -> ClassCounts:
        labels = np.asarray(block).reshape(len(block), -1)[:, 0] if block.ndim > 1 else block
        ok = len(labels) == 0 or (labels.min() >= 0 and labels.max() < _MAX_CLASSES)
        counts = np.bincount(labels.astype(np.int64)) if ok and len(labels) else (
            np.zeros(0, np.int64) if ok else None)
        return cls(Moments.of(block), counts)

    def merge(self, other: ClassCounts) -> ClassCounts:
        counts = None
        if self.counts is not None and other.counts is not None:
            size = max(len(self.counts), len(other.counts))
            counts = np.zeros(size, np.int64)
            counts[: len(self.counts)] += self.counts
            counts[: len(other.counts)] += other.counts
        return ClassCounts(self.moments.merge(other.moments), counts)

    def to_json(self) -> dict[str, Any]:
        out = self.moments.to_json()
        if self.counts is not None:
            out["num_classes"] = len(self.counts)
            out["class_counts"] = self.counts.tolist()
        return out


Summary = Moments | ClassCounts


def summary_of(block: np.ndarray) -> Summary:
    """The right summary for a block: class counts for integer labels, moments otherwise."""
    return ClassCounts.of(block) if block.dtype.kind in "iu" else Moments.of(block)


def merge_all(parts: list[Summary]) -> Summary:
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return total
