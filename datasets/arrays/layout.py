"""What :func:`~dasktrain.open_arrays` decides before any sample is read: the coordinates'
order, each array's parts, the splits' ranges of samples, the block size, and the
normalization's statistics."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dasktrain.datasets.arrays.reader import Part, WindowArray
from dasktrain.datasets.arrays.source import Source
from dasktrain.datasets.arrays.statistics import (
    Statistics,
    compute_statistics,
    given,
    load_or_compute,
)
from dasktrain.datasets.arrays.windows import Geometry
from dasktrain.datasets.errors import DatasetError

__all__ = ["BLOCK_BYTES", "block_steps", "check_coordinates", "normalized", "parts_of",
           "split_ranges", "statistics_of", "window_arrays"]

#: Bytes of samples a block aims at where the store gives no chunking along time.
BLOCK_BYTES = 4 << 20


def check_coordinates(data: Any, label: str, sample_dim: str, window: list[str]) -> None:
    """The sample dimension's coordinate must increase (windows and splits follow its
    order); a window dimension's must be monotonic, one way or the other."""
    for dim in (sample_dim, *window):
        if dim not in data.indexes:
            continue  # no coordinate: positions are the coordinate
        index = data.indexes[dim]
        increasing = index.is_monotonic_increasing and index.is_unique
        if increasing or (dim != sample_dim and index.is_monotonic_decreasing
                          and index.is_unique):
            continue
        values = np.asarray(index)
        steps = np.diff(values) if len(values) > 1 else values[:0]
        bad = int(np.argmax(steps <= np.zeros_like(steps))) if len(steps) else 0
        order = "increasing" if dim == sample_dim else "monotonic"
        raise DatasetError(
            f"coordinate {dim!r} of {label} is not {order}: "
            f"{values[bad]!r} at index {bad} is followed by {values[bad + 1]!r}; sort it "
            f"first (e.g. data.sortby({dim!r}))")


def parts_of(data: Any, label: str, geometry: Geometry, inputs: Sequence[str],
             targets: Sequence[str], static: Sequence[str]) -> list[Part]:
    """Each variable's part of a sample (its shape), checked against its dimensions."""
    window = [d for d, _ in geometry.window]
    sizes = tuple(size for _, size in geometry.window)
    parts = []
    for kind, names in (("input", inputs), ("static", static), ("target", targets)):
        for name in names:
            dims = data[name].dims
            missing = [d for d in window if d not in dims]
            if missing:
                raise DatasetError(f"variable {name!r} of {label} has no dimension(s) "
                                   f"{missing} to take windows along; its dimensions: {dims}")
            timed = geometry.sample_dim in dims
            if timed == (kind == "static"):
                raise DatasetError(
                    f"variable {name!r} of {label} is given as {kind} but "
                    f"{'has' if timed else 'has no'} dimension {geometry.sample_dim!r}"
                    + ("; static fields are the same at every step" if timed else ""))
            others = tuple(data.sizes[d] for d in dims
                           if d != geometry.sample_dim and d not in window)
            steps = (geometry.steps,) if kind == "input" and geometry.steps > 1 else ()
            parts.append(Part(name, kind, (*steps, *others, *sizes)))
    return parts


def statistics_of(data: Any, opened: Source, geometry: Geometry, variables: list[str],
                  ranges: dict[str, list[int]], normalize: Any, per: tuple[str, ...],
                  path: Any, storage_options: dict | None) -> Statistics | None:
    """The statistics ``normalize`` asks for (None: no normalization): given, or those of
    a split's steps, computed or read back from ``path``."""
    if normalize is None:
        return None
    window = {d for d, _ in geometry.window}
    wrong = [d for d in per if d in window or d == geometry.sample_dim or d not in data.dims]
    if wrong:
        raise DatasetError(f"normalize_per may name only dimensions taken whole (such as a "
                           f"level), not {wrong}")
    if isinstance(normalize, Mapping):
        return given(normalize, variables)
    if not isinstance(normalize, str) or normalize not in ranges:
        known = ", ".join(ranges) or "none: give splits={...}"
        raise DatasetError(f"normalize={normalize!r} names no split; splits: {known}")
    steps = geometry.time_span(*ranges[normalize])
    key = {"source": opened.token, "split": normalize, "steps": [int(v) for v in steps],
           "variables": variables, "per": list(per)}
    return load_or_compute(
        path, key, lambda: compute_statistics(data, variables, geometry.sample_dim, steps,
                                              per), storage_options)


def normalized(part: Part, dims: tuple, geometry: Geometry,
                stats: tuple[np.ndarray, np.ndarray], per: Sequence[str]) -> Part:
    """``part`` with its statistics shaped to broadcast against one sample: the kept
    dimensions' sizes where they stand among the part's axes, 1 elsewhere."""
    window = [d for d, _ in geometry.window]
    others = [d for d in dims if d != geometry.sample_dim and d not in window]
    leading = len(part.shape) - len(others) - len(window)  # the steps axis, if any
    shape = [1] * leading + [-1 if d in per else 1 for d in others] + [1] * len(window)
    mean, std = (np.asarray(v, dtype=np.float32) for v in stats)
    if mean.ndim:
        mean, std = mean.reshape(shape), std.reshape(shape)
    return dataclasses.replace(part, mean=mean, std=std)


def window_arrays(data: Any, token: str, geometry: Geometry, parts: list[Part], stack: bool,
                  missing: dict[str, Any]) -> dict[str, tuple[WindowArray, str]]:
    """The dataset's arrays and their roles: ``x`` and ``y`` stacked, or one per variable
    (a target that is also an input named ``{name}_target``). Each knows how many arrays
    read a block together (see :class:`WindowArray`)."""
    arrays = _arrays_of(data, token, geometry, parts, stack, missing)
    for array, _ in arrays.values():
        array.siblings = len(arrays)
    return arrays


def _arrays_of(data: Any, token: str, geometry: Geometry, parts: list[Part], stack: bool,
               missing: dict[str, Any]) -> dict[str, tuple[WindowArray, str]]:
    def make(chosen: list[Part], stacked: bool) -> WindowArray:
        dtype = np.result_type(*(data[p.variable].dtype for p in chosen))
        if any(p.mean is not None for p in chosen):
            dtype = np.result_type(dtype, np.float32)
        return WindowArray(data, token, geometry, tuple(chosen), stacked, dtype, **missing)

    features = [p for p in parts if p.kind != "target"]
    targets = [p for p in parts if p.kind == "target"]
    if stack:
        arrays = {"x": (make(features, True), "features")}
        if targets:
            arrays["y"] = (make(targets, True), "targets")
        return arrays
    arrays = {p.variable: (make([p], False), "features") for p in features}
    for p in targets:
        name = f"{p.variable}_target" if p.variable in arrays else p.variable
        if name in arrays:
            raise DatasetError(f"a target would be named {name!r}, which an input has: "
                               "rename one, or stack=True")
        arrays[name] = (make([p], False), "targets")
    return arrays


def block_steps(data: Any, name: str, sample_dim: str, geometry: Geometry,
                arrays: dict[str, tuple[WindowArray, str]]) -> int:
    """Sample times per block. Chunked along the sample dimension (a store, dask), whole
    chunks: one, or where a sample reads past its own step (``input_steps`` + ``lead`` > 1,
    so a block also decodes the first chunk(s) of the next) twice as many chunks as that
    halo takes, so that an epoch decodes at most 1.5 x the steps it covers. Otherwise (numpy
    in memory), as many as make about :data:`BLOCK_BYTES` of samples."""
    variable = data[name]
    axis = variable.dims.index(sample_dim)
    chunk = None
    if variable.chunks:
        chunk = int(variable.chunks[axis][0])
    else:
        chunks = variable.encoding.get("chunks") or variable.encoding.get("preferred_chunks")
        if isinstance(chunks, dict):
            chunk = chunks.get(sample_dim)
        elif chunks:
            chunk = chunks[axis]
    if chunk:
        chunk = max(1, int(chunk))
        halo = geometry.steps - 1 + geometry.lead
        return chunk * (2 * math.ceil(halo / chunk) if halo else 1)
    sample_bytes = sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a, _ in arrays.values())
    return max(1, min(geometry.times, BLOCK_BYTES // max(1, sample_bytes * geometry.per_step)))


def split_ranges(data: Any, label: str, geometry: Geometry, splits: Mapping[str, Any]
                 ) -> dict[str, list[int]]:
    """Each split's range of samples: those whose every step lies in its coordinates."""
    out = {}
    dim = geometry.sample_dim
    for name, where in splits.items():
        if isinstance(where, tuple) and len(where) == 2:
            where = slice(*where)
        if not isinstance(where, slice) or where.step is not None:
            raise DatasetError(f"split {name!r} must be a slice or a (start, stop) pair of "
                               f"{dim!r} coordinates, got {where!r}")
        if dim in data.indexes:
            try:
                positions = data.indexes[dim].slice_indexer(where.start, where.stop)
            except (KeyError, TypeError, ValueError) as exc:
                raise DatasetError(f"split {name!r}: cannot select {where.start!r} to "
                                   f"{where.stop!r} along {dim!r}: {exc}") from exc
            first, stop = positions.start or 0, positions.stop
        else:
            first = 0 if where.start is None else int(where.start)
            stop = geometry.length if where.stop is None else int(where.stop) + 1
        stop = geometry.length if stop is None else min(stop, geometry.length)
        # Every step of a sample in the range: its first input at >= first, its target
        # (steps - 1 + lead later) before stop.
        a, b = geometry.rows_of_times(first + geometry.steps - 1,
                                      stop - geometry.lead)
        if b <= a:
            raise DatasetError(
                f"split {name!r} ({where.start!r} to {where.stop!r} along {dim!r}) selects "
                f"no sample of {label}: it spans {max(0, stop - first)} step(s), and a "
                f"sample needs {geometry.steps + geometry.lead}")
        out[name] = [a, b]
    return out
