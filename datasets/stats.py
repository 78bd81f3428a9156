"""Per-feature statistics computed chunk by chunk and merged exactly (Chan et al.).

Each chunk task returns a small :class:`Moments` (or :class:`ClassCounts`); the client merges
them, so statistics of a dataset of any size cost one pass and O(features) memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["ClassCounts", "IntegerSums", "Moments", "merge_all", "summary_of"]

#: Integer targets with labels in [0, _MAX_CLASSES) get per-class counts.
_MAX_CLASSES = 100_000
#: Values per (widened) row in reductions, and per refill of the float64 deviations buffer.
_WIDE = 512
_BUFFER_VALUES = 32_768


def _fold(partial: np.ndarray, group: int, combine: np.ufunc) -> np.ndarray:
    """Combine ``group`` consecutive runs of features: (group * width,) -> (width,)."""
    return combine.reduce(partial.reshape(group, -1), axis=0) if group > 1 else partial


def _squared_deviations(flat: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Sum over rows of (row - mean)**2 in float64, for (rows, width) ``flat``."""
    rows, width = flat.shape
    total = np.zeros(width)
    step = max(1, _BUFFER_VALUES // max(width, 1))
    buffer = np.empty((min(step, rows), width))
    for a in range(0, rows, step):
        deviations = np.subtract(flat[a : a + step], mean, out=buffer[: min(step, rows - a)])
        total += np.einsum("ij,ij->j", deviations, deviations)
    return total


def _small_integer_moments(wide: np.ndarray, rest: np.ndarray, group: int,
                           minimum: np.ndarray, maximum: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray] | None:
    """Mean and squared deviations of 8- and 16-bit integers (tokens, pixels, labels) from
    integer sums of the values and of their squares: exact, and three times faster than
    the float64 deviations. None where the integers could overflow int64 (then the float
    path runs)."""
    if wide.dtype.kind not in "iu" or wide.dtype.itemsize > 2:
        return None
    rows = len(wide) * group + len(rest)
    largest = max(abs(int(minimum.min())), abs(int(maximum.max())))
    # rows * sum(x^2) < rows^2 * largest^2 must fit in int64
    if rows * rows * largest * largest >= 2**62:
        return None
    squared = np.uint32 if wide.dtype.kind == "u" else np.int64
    total = _fold(np.add.reduce(wide, axis=0, dtype=np.int64), group, np.add)
    total += np.add.reduce(rest, axis=0, dtype=np.int64)
    squares = _fold(np.add.reduce(np.square(wide, dtype=squared), axis=0, dtype=np.int64),
                    group, np.add)
    squares += np.add.reduce(np.square(rest, dtype=squared), axis=0, dtype=np.int64)
    # rows * sum(x^2) - sum(x)^2, exact in int64, then divided once
    return total / rows, (rows * squares - total * total) / rows


@dataclasses.dataclass(frozen=True, slots=True)
class IntegerSums:
    """Count, sum, sum of squares, minimum and maximum of 8- or 16-bit integers, as Python
    integers: exact, and a value more or less is one addition (a token dataset's inputs and
    targets are the same stream but for one token at each end)."""

    count: int
    total: int
    squares: int
    low: int
    high: int

    @classmethod
    def of(cls, flat: np.ndarray) -> IntegerSums | None:
        """The sums of a 1-D array; None where it is empty, not of 8/16-bit integers or so
        long that the int64 sums could overflow."""
        count = len(flat)
        if not count or flat.dtype.kind not in "iu" or flat.dtype.itemsize > 2:
            return None
        low, high = int(flat.min()), int(flat.max())
        if count * max(low * low, high * high) >= 2**62:
            return None
        squared = np.square(flat, dtype=np.uint32 if flat.dtype.kind == "u" else np.int64)
        return cls(count, int(np.add.reduce(flat, dtype=np.int64)),
                   int(np.add.reduce(squared, dtype=np.int64)), low, high)

    def plus(self, value: int) -> IntegerSums:
        return IntegerSums(self.count + 1, self.total + value, self.squares + value * value,
                           min(self.low, value), max(self.high, value))

    def moments(self) -> Moments:
        """The pooled moments (one feature) of these values."""
        n, total = self.count, self.total
        return Moments(n, np.array([total / n]), np.array([(n * self.squares - total * total) / n]),
                       np.array([float(self.low)]), np.array([float(self.high)]), pooled=True)


@dataclasses.dataclass(slots=True)
class Moments:
    """Count, mean, sum of squared deviations, min and max per feature (float64), or, when
    ``pooled``, of all values as one feature (see :meth:`of_all`)."""

    count: int
    mean: np.ndarray
    m2: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray
    pooled: bool = False

    @classmethod
    def of(cls, block: np.ndarray) -> Moments:
        """Moments of a block of shape (rows, *feature_shape), exact in float64.

        Two passes over the block (sum, then squared deviations from the mean) without a
        float64 copy of it: a float64 buffer of a few hundred KiB is refilled per slice.
        """
        block = np.asarray(block)
        shape = block.shape[1:]
        if len(block) == 0:
            inf = np.full(shape, np.inf)
            return cls(0, np.zeros(shape), np.zeros(shape), inf, -inf)
        flat = block.reshape(len(block), -1)
        rows, width = flat.shape
        # Reductions along axis 0 of a narrow array run one short inner loop per row; viewing
        # `group` consecutive rows as one wide row (rows/group, group * width) makes them
        # vectorise, and the `group` partial results are folded at the end.
        group = max(1, min(_WIDE // max(width, 1), rows))
        body = rows - rows % group
        wide = flat[:body].reshape(body // group, group * width)
        rest = flat[body:]
        minimum = _fold(wide.min(axis=0), group, np.minimum)
        maximum = _fold(wide.max(axis=0), group, np.maximum)
        if len(rest):
            minimum = np.minimum(minimum, rest.min(axis=0))
            maximum = np.maximum(maximum, rest.max(axis=0))
        moments = _small_integer_moments(wide, rest, group, minimum, maximum)
        if moments is None:
            total = _fold(np.add.reduce(wide, axis=0, dtype=np.float64), group, np.add)
            total += np.add.reduce(rest, axis=0, dtype=np.float64)
            mean = total / rows
            with np.errstate(invalid="ignore"):  # inf - inf with infinities: see finite
                m2 = _fold(_squared_deviations(wide, np.tile(mean, group)), group, np.add)
                m2 += _squared_deviations(rest, mean)
        else:
            mean, m2 = moments
        return cls(rows, mean.reshape(shape), m2.reshape(shape),
                   minimum.astype(np.float64).reshape(shape),
                   maximum.astype(np.float64).reshape(shape))

    @classmethod
    def of_all(cls, block: np.ndarray) -> Moments:
        """Moments of every value of a block as one feature (``pooled``): token ids, where a
        position in a sequence is no feature and per-position moments are noise. 8- and
        16-bit integers take integer sums, exact; anything else the general path."""
        flat = np.asarray(block).reshape(-1)
        sums = IntegerSums.of(flat)
        if sums is not None:
            return sums.moments()
        found = cls.of(flat.reshape(-1, 1))
        found.pooled = True
        return found

    @property
    def finite(self) -> bool:
        """Whether every value summarised is finite.

        The float64 sum of float32 (or integer) values cannot overflow, so it is finite
        exactly when no value is NaN or infinite: the check costs nothing beyond the moments.
        """
        return bool(np.isfinite(self.mean).all())

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
                       np.maximum(self.maximum, other.maximum), self.pooled)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / max(self.count, 1))

    @property
    def constant(self) -> np.ndarray:
        """Per feature (the shape of a sample), whether every value summarised is the same:
        exact, from the minimum and maximum, where the std of a constant may be rounding
        noise."""
        return (self.minimum == self.maximum) & (self.count > 0)

    def to_json(self) -> dict[str, Any]:
        out = {"count": self.count, "mean": self.mean.tolist(), "std": self.std.tolist(),
               "min": self.minimum.tolist(), "max": self.maximum.tolist()}
        return {**out, "pooled": True} if self.pooled else out


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


def _channel_moments(images: np.ndarray) -> Moments:
    """Moments per channel of uint8 images (samples, channels, height, width), exact: from
    integer sums of the values and of their squares (three times faster than a histogram).
    Per-pixel statistics of a 224x224 image would be 150,528 numbers of each kind in the
    attributes; the per-channel ones are what a normalisation of images takes."""
    count = images.shape[0] * images.shape[2] * images.shape[3]
    means, m2s, lows, highs = [], [], [], []
    for channel in range(images.shape[1]):
        values = images[:, channel]
        total = int(values.sum(dtype=np.uint64))
        squares = int(np.square(values, dtype=np.uint16).sum(dtype=np.uint64))
        means.append(total / max(count, 1))
        # n * sum(x^2) - sum(x)^2 in Python integers: exact, no cancellation
        m2s.append((count * squares - total * total) / max(count, 1))
        lows.append(float(values.min()) if count else np.inf)
        highs.append(float(values.max()) if count else -np.inf)
    return Moments(count, np.array(means), np.array(m2s), np.array(lows), np.array(highs))


def summary_of(block: np.ndarray, pooled: bool = False) -> Summary:
    """The right summary for a block: class counts for integer labels, moments per channel
    for uint8 images (samples, channels, height, width), moments of the lengths for
    variable-length bytes (encoded images), moments otherwise; with ``pooled``, the moments
    of all its values as one feature (token ids)."""
    if pooled:
        return Moments.of_all(block)
    if block.dtype == np.uint8 and block.ndim == 4:
        return _channel_moments(block)
    if block.dtype == object:
        return Moments.of(np.fromiter(map(len, block), np.float64, len(block)))
    return ClassCounts.of(block) if block.dtype.kind in "iu" else Moments.of(block)


def merge_all(parts: list[Summary]) -> Summary:
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return total
