"""What runs on the workers while preparing: each task writes a run of consecutive chunks,
one at a time, and returns the statistics of what it wrote and the chunks it stored.

* :func:`write_rows` — the one-pass build: the source's rows as they are.
* :func:`stage_chunks` — the first of two passes: rows cleaned and grouped by split into an
  uncompressed scratch Zarr.
* :func:`write_chunks` — the second pass: output chunks gathered from the scratch arrays
  and normalised.

Every task checks, chunk by chunk, that its build is still wanted: a task already running
when a build was abandoned must not recreate its directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync as zarr_sync
from zarr.storage import FsspecStore

from dasktrain.datasets.chunks import Written, record_writes
from dasktrain.datasets.sources.base import BlockReader
from dasktrain.datasets.splits import SplitPlan
from dasktrain.datasets.stats import Moments, Summary, summary_of

__all__ = ["stage_chunks", "write_chunks", "write_rows"]


def _finite_rows(blocks: dict[str, np.ndarray]) -> np.ndarray:
    keep = np.ones(len(next(iter(blocks.values()))), dtype=bool)
    for block in blocks.values():
        if block.dtype.kind == "f":
            keep &= np.isfinite(block.reshape(len(block), -1)).all(axis=1)
    return keep


def _still_wanted(arrays: dict[str, zarr.Array]) -> None:
    """Refuse to write into a build that was abandoned (cancelled, interrupted, discarded):
    a task already running when the build was cancelled must not recreate its directory."""
    store = next(iter(arrays.values())).store
    if isinstance(store, FsspecStore):
        # The build's group metadata is written first and deleted with the build.
        try:
            zarr.open_group(store, mode="r", zarr_format=3)
            return
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            pass
        # Raised outside the handler: zarr's error as its context would not unpickle on
        # the client, which would then get a bare Exception instead.
        raise OSError(f"build {store.fs.protocol}://{store.path} is gone or cannot be seen "
                      "from this worker: the preparation was abandoned, or the output is "
                      "storage this worker cannot reach (memory:// is per process)")
    root = getattr(store, "root", None)
    if root is not None and not os.path.isdir(root):
        raise RuntimeError(f"build directory {root} is gone; the preparation was abandoned")


def _rows(names: list[str], reader: BlockReader | None, start: int, stop: int,
          blocks: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
    """A chunk's rows of every array: read here, or handed over as the source's blocks."""
    if reader is not None:
        return reader(start, stop)
    return {name: np.asarray(block) for name, block in zip(names, blocks, strict=True)}


@contextlib.contextmanager
def _reading(reader: BlockReader | None) -> Iterator[None]:
    """A task's reads: a reader that keeps what it decoded for the next chunk (a Parquet
    row group) lets go of it at the task's end, not when the worker next runs it."""
    try:
        yield
    finally:
        release = getattr(reader, "release", None)
        if release is not None:
            release()


def _all_finite(summary: Summary) -> bool:
    # Integer arrays (class counts) cannot hold NaN or infinities.
    return not isinstance(summary, Moments) or summary.finite


def write_rows(out: dict[str, zarr.Array], require_finite: bool, reader: BlockReader | None,
                ranges: list[tuple[int, int]], *blocks: np.ndarray, pooled: tuple[str, ...] = ()
                ) -> tuple[dict[str, Summary], Written] | None:
    """One pass: write the source's rows as they are, chunk by chunk (``ranges``, with the
    source's blocks of each chunk in ``blocks`` where there is no reader), returning the
    statistics of all of them (of the arrays in ``pooled``, over all their values) and the
    chunks stored.

    With ``require_finite``, a chunk holding NaN or infinities is not written and None is
    returned: the caller then falls back to the cleaning (two-pass) build. The statistics
    are computed first because they tell that for free.
    """
    names = list(out)
    stored, log = record_writes(out)  # out stays: _still_wanted looks at its store
    # A reader may summarise its rows itself, knowing how they relate (a token dataset)
    summarise = getattr(reader, "summaries", None) or (
        lambda rows: {name: summary_of(block, name in pooled) for name, block in rows.items()})
    total: dict[str, Summary] | None = None
    with _reading(reader):
        for k, (start, stop) in enumerate(ranges):
            _still_wanted(out)  # per chunk: an abandoned build stops within one chunk's time
            rows = _rows(names, reader, start, stop,
                         blocks[k * len(names):(k + 1) * len(names)])
            summaries = summarise(rows)
            if require_finite and not all(_all_finite(s) for s in summaries.values()):
                return None
            _write_together(stored, slice(start, stop), rows)
            total = summaries if total is None else {
                name: total[name].merge(summaries[name]) for name in names}
    assert total is not None, "a task writes at least one chunk"
    return total, log.written()


def _write_together(out: dict[str, zarr.Array], rows: slice, blocks: dict[str, np.ndarray]
                    ) -> None:
    """Write the same rows of every array in one batch: one hand-over to zarr's event loop
    instead of one per array, and the arrays compressed side by side."""
    async def write_all() -> None:
        await asyncio.gather(*(out[name].async_array.setitem(rows, block)
                               for name, block in blocks.items()))

    zarr_sync(write_all())


def stage_chunks(scratch: dict[str, zarr.Array], fit_split: int, fit_names: tuple[str, ...],
                  clean: bool, reader: BlockReader | None, ranges: list[tuple[int, int]],
                  plan: SplitPlan | None, *blocks: np.ndarray
                  ) -> list[tuple[np.ndarray, dict[str, Moments]]]:
    """First pass, chunk by chunk (``ranges``; the source's blocks of each in ``blocks``
    where there is no reader): drop non-finite rows, group the rest by split into the
    scratch arrays, and return per chunk the rows of each split and, per array of
    ``fit_names``, the moments of the rows normalisation is fitted on."""
    names = list(scratch)
    staged = []
    with _reading(reader):
        for k, (start, stop) in enumerate(ranges):
            _still_wanted(scratch)
            named = _rows(names, reader, start, stop,
                          blocks[k * len(names):(k + 1) * len(names)])
            staged.append(_stage(scratch, fit_split, fit_names, clean, plan, start, stop,
                                 named))
    return staged


def _stage(scratch: dict[str, zarr.Array], fit_split: int, fit_names: tuple[str, ...],
           clean: bool, plan: SplitPlan | None, start: int, stop: int,
           named: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, Moments]]:
    """One chunk of :func:`stage_chunks`: its rows ``start .. stop`` (``named``) staged."""
    n = stop - start
    keep = _finite_rows(named) if clean else np.ones(n, dtype=bool)
    ids = plan.assign(start, stop) if plan is not None else np.zeros(n, dtype=np.int8)
    rows = np.flatnonzero(keep)
    rows = rows[np.argsort(ids[rows], kind="stable")]  # grouped by split, order kept
    grouped = {name: block[rows] for name, block in named.items()}
    _write_together(scratch, slice(start, start + len(rows)), grouped)
    counts = np.bincount(ids[rows], minlength=len(plan.names) if plan else 1)
    # The rows of a split are a contiguous run of the grouped rows: a view, no copy.
    first = int(counts[:fit_split].sum())
    fit = {name: Moments.of(grouped[name][first : first + int(counts[fit_split])])
           for name in fit_names}
    return counts, fit


def write_chunks(out: dict[str, zarr.Array], sources: list[Any], norm: dict[str, tuple],
                  chunks: list[tuple[int, list[tuple[int, int]]]], pooled: tuple[str, ...] = ()
                  ) -> tuple[dict[str, Summary], Written]:
    """Second pass: write output chunks, each ``(start, pieces)``: its rows gathered from
    the scratch arrays ``sources`` by ``pieces`` (row ranges) and normalised. Returns the
    statistics of all of them (of the arrays in ``pooled``, over all their values) and the
    chunks stored."""
    stored, log = record_writes(out)  # out stays: _still_wanted looks at its store
    total: dict[str, Summary] | None = None
    for start, pieces in chunks:
        _still_wanted(out)
        blocks = {}
        for (name, target), source in zip(out.items(), sources, strict=True):
            block = np.concatenate([source[a:b] for a, b in pieces]).astype(
                target.dtype, copy=False)
            if name in norm:  # in place: the block is this task's own copy
                mean, std = norm[name]
                block -= mean
                block /= std
            blocks[name] = block
        _write_together(stored, slice(start, start + len(next(iter(blocks.values())))), blocks)
        summaries = {name: summary_of(block, name in pooled) for name, block in blocks.items()}
        total = summaries if total is None else {
            name: total[name].merge(summaries[name]) for name in summaries}
    assert total is not None, "a task writes at least one chunk"
    return total, log.written()
