"""Where each sample of an in-place dataset lies: windows over named dimensions.

A sample is a window of fixed size along the *window dimensions* (e.g. ``lat`` and
``lon``), taken every ``stride`` along each, at one place along the *sample dimension*
(e.g. ``time``). Samples are numbered time-major: sample ``i`` is at sample-time index
``i // per_step`` and at the window position ``i % per_step`` (row-major over the window
dimensions), so that a contiguous range of samples covers a contiguous range of time,
which is what a store chunked along time reads best, and a split by time is a range of
samples.

A sample at time ``t`` holds its inputs at ``t - steps + 1 .. t`` and its targets at
``t + lead``; the first sample time is therefore ``steps - 1`` and the last
``length - 1 - lead``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from dasktrain.datasets.errors import DatasetError

__all__ = ["Geometry"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The windows of one dataset: sizes, strides and the sample times.

    Parameters
    ----------
    sample_dim, length
        The dimension samples are taken along and its length in the store.
    window, stride, sizes
        Window size and stride per window dimension, and that dimension's length.
    steps, lead
        Input time steps per sample, and how far past the last of them the targets lie.
    """

    sample_dim: str
    length: int
    window: tuple[tuple[str, int], ...]
    stride: tuple[tuple[str, int], ...]
    sizes: tuple[tuple[str, int], ...]
    steps: int = 1
    lead: int = 0

    @classmethod
    def of(cls, sample_dim: str, length: int, window: Mapping[str, int],
           stride: Mapping[str, int], sizes: Mapping[str, int], steps: int, lead: int
           ) -> Geometry:
        """The geometry, or a :class:`DatasetError` that names what does not fit."""
        for what, value, least in (("input_steps", steps, 1), ("lead", lead, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise DatasetError(f"{what} must be an integer >= {least}, got {value!r}")
        for dim, size in window.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise DatasetError(f"window size along {dim!r} must be a positive integer, "
                                   f"got {size!r}")
            if size > sizes[dim]:
                raise DatasetError(f"window of {size} along {dim!r} is larger than the "
                                   f"dimension, which has {sizes[dim]}")
            step = stride[dim]
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise DatasetError(f"stride along {dim!r} must be a positive integer, "
                                   f"got {step!r}")
        if steps + lead > length:
            raise DatasetError(
                f"{sample_dim!r} has {length} steps: too few for {steps} input step(s) and "
                f"targets {lead} step(s) ahead (that needs {steps + lead})")
        return cls(sample_dim, int(length), tuple(window.items()),
                   tuple((d, int(stride[d])) for d in window),
                   tuple((d, int(sizes[d])) for d in window), steps, lead)

    # -- counts ------------------------------------------------------------------------
    @property
    def positions(self) -> tuple[int, ...]:
        """Window positions along each window dimension."""
        return tuple((size - w) // s + 1 for (_, w), (_, s), (_, size)
                     in zip(self.window, self.stride, self.sizes, strict=True))

    @property
    def per_step(self) -> int:
        """Samples at one sample time: every window position."""
        return math.prod(self.positions)

    @property
    def times(self) -> int:
        """Sample times: those with every input step and the target in the store."""
        return self.length - self.steps + 1 - self.lead

    def __len__(self) -> int:
        return self.times * self.per_step

    @property
    def first_time(self) -> int:
        """The store index of the first sample time."""
        return self.steps - 1

    # -- where samples lie ---------------------------------------------------------------
    def rows_of_times(self, first: int, stop: int) -> tuple[int, int]:
        """The samples whose sample time's store index lies in ``[first, stop)``."""
        a = min(max(first - self.first_time, 0), self.times)
        b = min(max(stop - self.first_time, a), self.times)
        return a * self.per_step, b * self.per_step

    def time_span(self, start: int, stop: int) -> tuple[int, int]:
        """The store indices ``[a, b)`` along the sample dimension that samples
        ``[start, stop)`` read (their input steps and their targets)."""
        first = start // self.per_step
        last = (stop - 1) // self.per_step
        return first, last + self.steps + self.lead

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For samples ``[start, stop)``: the store index of each one's first input step
        (shape ``(n,)``) and its window's start along each window dimension (``(n, d)``)."""
        rows = np.arange(start, stop)
        times, places = np.divmod(rows, self.per_step)
        corner = np.stack(np.unravel_index(places, self.positions), axis=1) \
            if self.window else np.zeros((len(rows), 0), dtype=np.int64)
        strides = np.array([s for _, s in self.stride], dtype=np.int64)
        return times, corner * strides
