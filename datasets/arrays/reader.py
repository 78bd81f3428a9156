"""Cutting samples out of the store: one array of an in-place dataset, read a range of
samples at a time (the pipeline reads a block of rows of every array the same way)."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
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
        whole = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        if stop > start:
            self.read_into(whole, start, stop)
        return whole

    def read_into(self, out: np.ndarray, start: int, stop: int,
                  rows: np.ndarray | None = None) -> None:
        """Samples ``[start, stop)`` into ``out`` (of this array's dtype and sample shape):
        its first rows, or, with ``rows``, row ``rows[i]`` for sample ``start + i``. The
        pipeline reads a shuffled group of blocks that way: each sample is copied once,
        from the store's slab to its place in the shuffled group."""
        geometry = self.geometry
        times, corners = geometry.locate(start, stop)
        t0, t1 = geometry.time_span(start, stop)
        window = len(geometry.window)
        channel = 0
        for part in self.parts:
            timed = part.kind != "static"
            source, nan = _slab(self, part, t0 if timed else None, t1 if timed else None)
            # The part's place in the array: its channels of a stacked one (written there,
            # not copied in after), or all of it.
            if self.stacked:
                channels = int(np.prod(part.shape[:len(part.shape) - window]))
                target = out[:, channel:channel + channels].reshape(
                    len(out), *part.shape, copy=False)
                channel += channels
            else:
                target = out
            _cut(target, geometry.sample_view(source, part.kind), start,
                 times - t0 if timed else None, corners, geometry, rows)
            if nan:  # NaN in the slab: name the first sample that holds one, if any does
                self._missing(target[:stop - start] if rows is None else target[rows],
                              part, start, times, corners)
        _done(self, t0, t1)

    def _missing(self, out: np.ndarray, part: Part, start: int, times: np.ndarray,
                 corners: np.ndarray) -> None:
        """A NaN in samples ``start, start + 1, ...`` (``out``, read from a slab that holds
        one) is named (``nan="fill"`` filled the slab already)."""
        missing = np.isnan(out)
        if not missing.any():
            return  # the slab's NaN lie outside every window
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


def _cut(out: np.ndarray, view: np.ndarray, start: int, first: np.ndarray | None,
         corners: np.ndarray, geometry: Geometry, rows: np.ndarray | None = None) -> None:
    """Samples ``start, start + 1, ...`` of a part into ``out`` (its first rows, or
    ``rows``) from its :meth:`~Geometry.sample_view` (``first``: each sample's first input
    step in the slab, ``None`` for a static part). The whole sample times among them are
    one copy in C; the samples of a time cut at either end, one gather each."""
    n, per_step = len(corners), geometry.per_step
    head = min((-start) % per_step, n)
    whole_times = (n - head) // per_step
    body = slice(head, head + whole_times * per_step)
    if whole_times:
        grid = (whole_times, *geometry.positions)
        source = view[None] if first is None else \
            view[first[head]:first[head] + whole_times]
        if rows is None:
            np.copyto(out[body].reshape(*grid, *out.shape[1:], copy=False), source,
                      casting="unsafe")
        else:
            out[rows[body].reshape(grid)] = source
    steps = np.array([step for _, step in geometry.stride], dtype=np.int64)
    for at in (slice(0, head), slice(body.stop, n)):
        if at.stop > at.start:
            places = tuple((corners[at] // steps).T)
            out[at if rows is None else rows[at]] = \
                view[places if first is None else (first[at], *places)]


def _slab(array: WindowArray, part: Part, t0: int | None, t1: int | None
          ) -> tuple[np.ndarray, bool]:
    """What ``part`` is cut from: its variable's slab in the array's dtype, normalized,
    its NaN filled where ``nan="fill"``; and whether it still holds a NaN (``"raise"``:
    the samples that hold one are then named). The work per value is done on the slab,
    once for every part of the variable, and usually on fewer values than the samples
    hold (a step serves ``input_steps`` samples' inputs and one's target); it gives each
    sample the values that normalizing and filling the sample itself would."""
    stats = None if part.mean is None else (part.mean.tobytes(), part.std.tobytes())

    def raw() -> np.ndarray:
        return _cached(array, part.variable, t0, t1, lambda: _read(array, part.variable, t0, t1))

    return _cached(array, (part.variable, array.dtype.str, stats), t0, t1,
                   lambda: _ready(array, part, raw()))


def _ready(array: WindowArray, part: Part, raw: np.ndarray) -> tuple[np.ndarray, bool]:
    dtype = array.dtype
    if part.mean is not None:
        # The statistics broadcast against a sample: their leading axes (steps) are 1s.
        axes = raw.ndim - (part.kind != "static")
        mean, std = (v if v.ndim == 0 else v.reshape(v.shape[v.ndim - axes:])
                     for v in (part.mean, part.std))
        ready = np.subtract(raw, mean, dtype=dtype)
        ready /= std
    else:
        ready = raw if raw.dtype == dtype else raw.astype(dtype)
    if dtype.kind != "f" or not np.isnan(ready.min()):
        return ready, False
    if array.nan != "fill":
        return ready, True
    if ready is raw:  # the raw slab may serve an array of another dtype still
        ready = raw.copy()
    ready[np.isnan(ready)] = array.fill
    return ready, False


def _cached(array: WindowArray, key: Any, t0: int | None, t1: int | None,
            make: Callable[[], Any]) -> Any:
    """What ``make`` gives for a variable's slab ``[t0, t1)`` along the sample dimension
    (or for all of a static one; a slab's dimensions are ordered (sample, the others, the
    window's)). The slabs of the block a thread reads are kept by that thread until it
    reads another block: a block's arrays are read one after the other in one thread, so a
    variable that is both an input and a target comes from the store once, however many
    threads read other blocks meanwhile. Static fields are kept for the process."""
    if t0 is None:
        key = (array.token, key)
        with _LOCK:
            found = _STATIC.get(key)
        if found is None:
            found = make()
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
    found = kept.get(key)
    if found is None:
        found = kept[key] = make()
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
_KEEP_STATIC = 32  # a few datasets' static fields, as read and as cut
