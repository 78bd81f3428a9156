"""The two-pass build, for a source holding NaN or infinities, a split or normalisation;
memory stays bounded by a few chunks.

1. *stage*: each source chunk is cleaned, its rows are grouped by split and written to an
   uncompressed scratch Zarr; the tasks return per-split row counts and the moments of the
   rows normalisation is fitted on.
2. *write*: each output chunk gathers its rows from at most a few scratch chunks (rows of
   split 0 first, then split 1, ...), normalises, compresses and writes.
"""

from __future__ import annotations

import functools

import numpy as np
import zarr
from distributed import Client
from zarr.storage import StoreLike

from dasktrain.datasets.build_tasks import (
    create_arrays,
    group_blocks,
    plan_tasks,
    pooled_arrays,
    run_tasks,
    source_task_bytes,
    task_reader,
    task_slots,
)
from dasktrain.datasets.config import PrepareConfig
from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.format import create_sample_array
from dasktrain.datasets.sources import Source
from dasktrain.datasets.sources.base import BlockReader
from dasktrain.datasets.splits import SplitPlan
from dasktrain.datasets.stats import merge_all
from dasktrain.datasets.write_tasks import stage_chunks, write_chunks

__all__ = ["write_staged"]


def write_staged(client: Client, source: str, src: Source, root: zarr.Group,
                 reader: BlockReader | None, blocks: list,
                 starts: list[int], lengths: list[int], chunk_rows: int, scratch_store: StoreLike,
                 plan: SplitPlan | None, config: PrepareConfig, progress: bool
                 ) -> tuple[list, np.ndarray, dict | None]:
    """Two passes through a scratch Zarr: clean and group rows by split, then write."""
    specs = src.specs
    names = list(specs)
    scratch_root = zarr.open_group(scratch_store, mode="w")
    scratch = {
        name: create_sample_array(
            scratch_root, name, shape=(src.num_samples, *spec.sample_shape), dtype=spec.dtype,
            chunks=(chunk_rows, *spec.sample_shape), compressors=None, fill_value=0,
            # Chunk files side by side, not a directory each: fewer to make and remove.
            chunk_key_encoding={"name": "default", "separator": "."})
        for name, spec in specs.items()
    }
    # Every features array of floats is normalised, each with its own mean and std per
    # value; integer or byte features (token ids, uint8 pixels, encoded images) keep their
    # values, for an embedding or a transform to use.
    fit_names = tuple(n for n in names if specs[n].role == "features"
                      and specs[n].dtype.kind == "f") if config.normalize else ()
    stage = functools.partial(stage_chunks, scratch, 0, fit_names, not src.known_finite)
    chunk_bytes = chunk_rows * sum(s.sample_bytes for s in specs.values())
    parallelism = task_slots(client)
    groups = plan_tasks(len(starts), chunk_bytes, parallelism,
                        source_task_bytes(src, chunk_rows, chunk_bytes))
    args = []
    for group in groups:
        first, last = group[0], group[-1]
        ranges = [(starts[i], starts[i] + lengths[i]) for i in group]
        args.append((task_reader(reader, ranges), ranges,
                     plan.slice_for(starts[first], starts[last] + lengths[last]) if plan
                     else None))
    staged = [chunk for task in run_tasks(client, stage, args,
                                          group_blocks(reader, blocks, groups), "staging",
                                          progress) for chunk in task]
    counts = np.stack([c for c, _ in staged])
    num_samples = int(counts.sum())
    if num_samples == 0:
        raise SourceError(f"source {source!r} has no finite rows: all {src.num_samples} dropped")
    if plan is not None:
        empty = [name for name, size in zip(plan.names, counts.sum(axis=0), strict=True)
                 if size == 0]
        if empty:
            raise SourceError(
                f"split{'s' if len(empty) > 1 else ''} {', '.join(map(repr, empty))} would be "
                f"empty with {num_samples} samples; use larger fractions or more data"
            )
    norm, normalization = {}, {}
    for fit_name in fit_names:
        fit = merge_all([m[fit_name] for _, m in staged])
        # A constant feature is divided by 1, not by a std of 0 (or of rounding noise): it
        # becomes 0, which the preparation warns about.
        constant = fit.constant
        std = np.where((fit.std > 0) & ~constant, fit.std, 1.0)
        norm[fit_name] = (fit.mean.astype(np.float32), std.astype(np.float32))
        normalization[fit_name] = {
            "mean": fit.mean.tolist(), "std": std.tolist(), "count": fit.count,
            "fitted_on": plan.names[0] if plan else "all",
            "constant": np.flatnonzero(constant).tolist()}
    out = create_arrays(root, src, num_samples, chunk_rows, config.compression)
    scratch_list = [scratch[n] for n in names]
    write = functools.partial(write_chunks, out, scratch_list, norm,
                              pooled=pooled_arrays(src))
    layout = _layout(counts, starts, chunk_rows)
    results = run_tasks(client, write,
                        [([(j * chunk_rows, layout[j]) for j in group],)
                         for group in plan_tasks(len(layout), chunk_bytes, parallelism)],
                        None, "writing", progress)
    return results, counts, normalization or None


def _layout(counts: np.ndarray, starts: list[int], chunk_rows: int
            ) -> list[list[tuple[int, int]]]:
    """Scratch row ranges that make up each output chunk.

    ``counts[i, s]`` rows of split ``s`` sit in scratch chunk ``i`` after the rows of the
    splits before it; the output holds split 0 of every chunk in order, then split 1, ...
    """
    runs = []
    for s in range(counts.shape[1]):
        for i, start in enumerate(starts):
            if counts[i, s]:
                a = start + int(counts[i, :s].sum())
                runs.append((a, a + int(counts[i, s])))
    chunks: list[list[tuple[int, int]]] = [[]]
    room = chunk_rows
    for a, b in runs:
        while a < b:
            if room == 0:
                chunks.append([])
                room = chunk_rows
            take = min(room, b - a)
            chunks[-1].append((a, a + take))
            a += take
            room -= take
    return [c for c in chunks if c]
