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
from numpy.lib.stride_tricks import sliding_window_view

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

    def sample_view(self, source: np.ndarray, kind: str) -> np.ndarray:
        """Every sample of a part at once, as a view of ``source`` (no copy): for a part of
        ``kind`` "input" or "target", ``source`` is a slab ordered (sample dimension, the
        others, the window's) and the view is ``[r, *position, *sample]``, the sample whose
        first input step is the slab's ``r``-th at each window position; for a "static" one
        (no sample dimension), ``[*position, *sample]``. One copy out of it cuts a range of
        samples in C, not sample by sample."""
        sizes = tuple(size for _, size in self.window)
        timed = kind != "static"
        rest = source.ndim - len(sizes) - timed  # the other dimensions' axes
        view = sliding_window_view(source, sizes, axis=tuple(range(source.ndim - len(sizes),
                                                                   source.ndim))) \
            if sizes else source
        # Every stride-th position, then the positions' axes next to the sample dimension.
        view = view[(slice(None),) * (timed + rest) + tuple(
            slice(0, count * step, step)
            for count, (_, step) in zip(self.positions, self.stride, strict=True))]
        first = timed + rest
        view = view.transpose(*range(timed), *range(first, first + len(sizes)),
                              *range(timed, first), *range(first + len(sizes), view.ndim))
        if kind == "input" and self.steps > 1:
            steps = sliding_window_view(view, self.steps, axis=0)
            return np.moveaxis(steps, -1, 1 + len(sizes))
        if kind == "target":
            return view[self.steps - 1 + self.lead:]
        return view
