"""Cutting samples out of the store: one array of an in-place dataset, read a range of
samples at a time (the pipeline reads a block of rows of every array the same way)."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import numpy as np

from dasktrain.datasets.arrays.source import read_span, read_whole
from dasktrain.datasets.arrays.windows import Geometry
from dasktrain.datasets.errors import DatasetError

__all__ = ["Part", "WindowArray"]


@dataclasses.dataclass(frozen=True)
class Part:
    """One variable's share of a sample array: its input steps (``kind="input"``), its
    value at the target time (``"target"``), or a static field (``"static"``); with the
    mean and standard deviation it is normalized by (shaped to broadcast against a
    sample), if any."""

    variable: str
    kind: str
    shape: tuple[int, ...]  # per sample, the steps axis of inputs included
    mean: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    std: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)


class WindowArray:
    """Samples ``[a, b)`` of one array as ``array[a:b]``, a numpy array of shape
    ``(b - a, *sample_shape)``: each part's windows, stacked along a channel axis when
    there are several (the parts' leading axes flattened into it).

    Pickles as the variables' lazy handles and the geometry: a worker reads only the
    chunks its samples need (the time range of the block and every window position in it).
    """

    def __init__(self, data: Any, token: str, geometry: Geometry, parts: tuple[Part, ...],
                 stacked: bool, dtype: np.dtype, nan: str = "raise", fill: float = 0.0
                 ) -> None:
        self.data = data
        self.token = token
        self.nan = nan
        self.fill = fill
        # The arrays of the dataset read block by block together (set by open_arrays).
        self.siblings = 1
        self.geometry = geometry
        self.parts = parts
        self.stacked = stacked
        self.dtype = np.dtype(dtype)
        window = tuple(size for _, size in geometry.window)
        if stacked:
            channels = sum(int(np.prod(p.shape[:len(p.shape) - len(window)])) for p in parts)
            sample = (channels, *window)
        else:
            sample = parts[0].shape
        self.shape = (len(geometry), *sample)
        self.ndim = len(self.shape)
        # Messages name the rows of a failed read by chunk, as for a prepared array.
        self.chunks = (max(geometry.per_step, 1), *sample)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        rest: tuple = ()
        if isinstance(key, tuple):
            key, rest = key[0], key[1:]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"an in-place array is read by a range of samples, got {key!r}")
        start, stop, _ = key.indices(self.shape[0])
        out = self._read(start, max(start, stop))
        return out[(slice(None), *rest)] if rest else out

    def _read(self, start: int, stop: int) -> np.ndarray:
        if stop == start:
            return np.empty((0, *self.shape[1:]), dtype=self.dtype)
        geometry = self.geometry
        times, corners = geometry.locate(start, stop)
        t0, t1 = geometry.time_span(start, stop)
        sizes = [size for _, size in geometry.window]
        n = stop - start
        whole = np.empty((n, *self.shape[1:]), dtype=self.dtype)
        channel = 0
        for part in self.parts:
            if part.kind == "static":
                source, offsets = _cached(self, part.variable, None, None), None
            else:
                source = _cached(self, part.variable, t0, t1)
                first = times - t0
                offsets = first + (geometry.steps - 1 + geometry.lead) \
                    if part.kind == "target" else first
            # The part's place in the array: its channels of a stacked one (written there,
            # not copied in after), or all of it.
            if self.stacked:
                channels = int(np.prod(part.shape[:len(part.shape) - len(sizes)]))
                out = whole[:, channel:channel + channels].reshape(n, *part.shape)
                channel += channels
            else:
                out = whole
            for k in range(n):
                where = tuple(slice(c, c + s) for c, s in zip(corners[k], sizes, strict=True))
                if offsets is None:
                    out[k] = source[(Ellipsis, *where)]
                elif part.kind == "target" or geometry.steps == 1:
                    out[k] = source[(offsets[k], Ellipsis, *where)]
                else:
                    out[k] = source[(slice(offsets[k], offsets[k] + geometry.steps),
                                     Ellipsis, *where)]
            if part.mean is not None:
                out -= part.mean
                out /= part.std
            self._missing(out, part, start, times, corners)
        _done(self, t0, t1)
        return whole

    def _missing(self, out: np.ndarray, part: Part, start: int, times: np.ndarray,
                 corners: np.ndarray) -> None:
        """NaN in the samples: filled (``nan="fill"``) or named (``"raise"``)."""
        # One pass without a mask for the usual case: a minimum is NaN when any value is.
        if out.dtype.kind != "f" or not np.isnan(out.min()):
            return
        missing = np.isnan(out)
        if self.nan == "fill":
            out[missing] = self.fill
            return
        k = int(np.argmax(missing.reshape(len(out), -1).any(axis=1)))
        geometry = self.geometry
        step = int(times[k]) + (geometry.steps - 1 + geometry.lead
                                if part.kind == "target" else 0)
        where = ", ".join(f"{d} {c}:{c + s}" for (d, s), c
                          in zip(geometry.window, corners[k], strict=True))
        at = "" if part.kind == "static" else f" at {geometry.sample_dim} index {step}"
        raise DatasetError(
            f"variable {part.variable!r} has {int(missing[k].sum())} NaN value(s) in sample "
            f"{start + k}{at} ({where}): give open_arrays nan='fill' to fill them with "
            f"{self.fill!r}, or count them with count_nan()")

    def __repr__(self) -> str:
        names = ", ".join(f"{p.variable} ({p.kind})" for p in self.parts)
        return f"<in-place array {self.shape} {self.dtype} of {names}>"


def _cached(array: WindowArray, name: str, t0: int | None, t1: int | None) -> np.ndarray:
    """A variable's slab ``[t0, t1)`` along the sample dimension (or all of a static one),
    with its dimensions ordered (sample, the others, the window's). The slabs of the
    block a thread reads are kept by that thread until it reads another block: a block's
    arrays are read one after the other in one thread, so a variable that is both an input
    and a target comes from the store once, however many threads read other blocks
    meanwhile. Static fields are kept for the process."""
    key = (array.token, name, t0, t1)
    if t0 is None:
        with _LOCK:
            found = _STATIC.get(key)
        if found is None:
            found = _read(array, name, None, None)
            with _LOCK:
                _STATIC[key] = found
                while len(_STATIC) > _KEEP_STATIC:
                    _STATIC.popitem(last=False)
        return found
    block = (array.token, t0, t1)
    kept = getattr(_THREAD, "slabs", None)
    if kept is None or _THREAD.block != block:
        kept = _THREAD.slabs = {}
        _THREAD.block = block
    found = kept.get(name)
    if found is None:
        found = kept[name] = _read(array, name, t0, t1)
    return found


def _done(array: WindowArray, t0: int, t1: int) -> None:
    """``array`` has read the block ``[t0, t1)``: once every array of its dataset has,
    the thread lets the block's slabs go rather than hold them until its next block."""
    if getattr(_THREAD, "block", None) != (array.token, t0, t1):
        return
    readers = _THREAD.__dict__.setdefault("readers", set())
    readers.add(id(array))
    if len(readers) >= array.siblings:
        _THREAD.slabs, _THREAD.block, _THREAD.readers = None, None, set()


def _read(array: WindowArray, name: str, t0: int | None, t1: int | None) -> np.ndarray:
    geometry = array.geometry
    variable = array.data[name]
    window = [d for d, _ in geometry.window]
    lead = [geometry.sample_dim] if t0 is not None else []
    others = [d for d in variable.dims if d not in window and d not in lead]
    variable = variable.transpose(*lead, *others, *window)
    return read_whole(variable) if t0 is None else \
        read_span(variable, geometry.sample_dim, t0, t1)


_THREAD = threading.local()
_STATIC: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()
_LOCK = threading.Lock()
_KEEP_STATIC = 16  # a few datasets' static fields
