"""Build a dataset from a source with Dask: clean, split, normalise, write Zarr atomically.

Without a split or normalisation a build takes one pass: chunk by chunk, a task reads the
source's rows, computes their exact statistics (which also tell whether every value is
finite), and compresses and writes them as one output chunk. A source holding NaN or
infinities, a split or normalisation take two passes, which keep memory bounded by a few
chunks:

1. *stage*: each source chunk is cleaned (rows with NaN/inf dropped), its rows are assigned to
   splits and grouped by split, and the chunk is written to an uncompressed scratch Zarr;
   the task returns per-split row counts and the moments of the rows normalisation is fitted
   on.
2. *write*: each output chunk gathers its rows from at most a few scratch chunks (rows of
   split 0 first, then split 1, ...), normalises, compresses and writes, returning statistics
   of the stored values.

A task handles a run of consecutive chunks (:func:`plan_tasks`, ~32 MiB), one at a time;
every output chunk is written by exactly one task, so no two tasks ever write the same chunk.
Where the source has a :data:`BlockReader` (files, generators), a task reads its own rows:
no task per source block and no copy of the rows between workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import importlib.metadata
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import dask
import numpy as np
import zarr
from distributed import Client
from zarr.core.sync import sync as zarr_sync
from zarr.storage import FsspecStore, StoreLike

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions, is_url, local_path, strip_url
from dasktrain._malloc import tune_allocator
from dasktrain._progress import gather_with_progress
from dasktrain.datasets.atomic import StagedDirectory, check_output_path
from dasktrain.datasets.chunks import MANIFEST_KEY, Written, manifest_of, record_writes
from dasktrain.datasets.cleaning import warn_about_cleaning
from dasktrain.datasets.config import PrepareConfig
from dasktrain.datasets.dataset import Dataset, open_dataset
from dasktrain.datasets.errors import DatasetError, SourceError
from dasktrain.datasets.format import FORMAT_VERSION, chunk_rows_for, row_bytes
from dasktrain.datasets.remote import StagedPrefix, check_output_url
from dasktrain.datasets.sources import Source, SourceOptions, get_source
from dasktrain.datasets.sources.base import BlockReader
from dasktrain.datasets.splits import SplitPlan
from dasktrain.datasets.stats import Moments, Summary, merge_all, summary_of

__all__ = ["TASK_BYTES", "plan_tasks", "prepare"]

logger = logging.getLogger(__name__)


#: Work per task: one task writes consecutive chunks up to about this many bytes (~100 ms
#: of reading, summarising and compressing), so that the scheduler's and workers' cost per
#: task stays small next to the work (a 4 MiB chunk alone is ~10 ms of it).
TASK_BYTES = 32 * 2**20


def plan_tasks(num_chunks: int, chunk_bytes: int, parallelism: int,
               task_bytes: int = TASK_BYTES) -> list[range]:
    """Group chunks ``0 .. num_chunks - 1`` into tasks of consecutive chunks.

    Each task gets about ``task_bytes`` of chunks, but there are at least ``parallelism``
    tasks (while there are chunks enough) and, where the chunks allow, a multiple of it,
    group sizes differing by at most one: no slot waits idle for a last, lone task.
    """
    if num_chunks <= 0:
        return []
    per_task = max(1, task_bytes // max(chunk_bytes, 1))
    parallelism = max(1, parallelism)
    tasks = -(-num_chunks // per_task)
    tasks = min(num_chunks, -(-tasks // parallelism) * parallelism)
    size, extra = divmod(num_chunks, tasks)
    groups, first = [], 0
    for t in range(tasks):
        last = first + size + (t < extra)
        groups.append(range(first, last))
        first = last
    return groups


def _compressors(name: str) -> Any:
    if name == "zstd":
        return zarr.codecs.ZstdCodec(level=3, checksum=True)
    if name == "blosc":
        return zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
    return None


def _create_arrays(group: zarr.Group, source: Source, num_samples: int, chunk_rows: int,
                   compression: str) -> dict[str, zarr.Array]:
    return {
        name: group.create_array(
            name, shape=(num_samples, *spec.sample_shape), dtype=spec.dtype,
            chunks=(min(chunk_rows, max(num_samples, 1)), *spec.sample_shape),
            compressors=_compressors(compression), fill_value=0,
            # Every chunk is stored, zeros too: a chunk that is not there is then damage,
            # never a chunk of fill values (see dasktrain.datasets.chunks).
            config={"write_empty_chunks": True},
        )
        for name, spec in source.specs.items()
    }


# -- tasks (run on workers) -------------------------------------------------------------------
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


def _all_finite(summary: Summary) -> bool:
    # Integer arrays (class counts) cannot hold NaN or infinities.
    return not isinstance(summary, Moments) or summary.finite


def _write_rows(out: dict[str, zarr.Array], reader: BlockReader | None, require_finite: bool,
                ranges: list[tuple[int, int]], *blocks: np.ndarray
                ) -> tuple[dict[str, Summary], Written] | None:
    """One pass: write the source's rows as they are, chunk by chunk (``ranges``, with the
    source's blocks of each chunk in ``blocks`` where there is no reader), returning the
    statistics of all of them and the chunks stored.

    With ``require_finite``, a chunk holding NaN or infinities is not written and None is
    returned: the caller then falls back to the cleaning (two-pass) build. The statistics
    are computed first because they tell that for free.
    """
    names = list(out)
    stored, log = record_writes(out)  # out stays: _still_wanted looks at its store
    total: dict[str, Summary] | None = None
    for k, (start, stop) in enumerate(ranges):
        _still_wanted(out)  # per chunk: an abandoned build stops within one chunk's time
        rows = _rows(names, reader, start, stop, blocks[k * len(names):(k + 1) * len(names)])
        summaries = {name: summary_of(block) for name, block in rows.items()}
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


def _stage_chunks(scratch: dict[str, zarr.Array], fit_split: int, fit_name: str | None,
                  clean: bool, reader: BlockReader | None, ranges: list[tuple[int, int]],
                  plan: SplitPlan | None, *blocks: np.ndarray
                  ) -> list[tuple[np.ndarray, Moments | None]]:
    """First pass, chunk by chunk (``ranges``; the source's blocks of each in ``blocks``
    where there is no reader): drop non-finite rows, group the rest by split into the
    scratch arrays, and return per chunk the rows of each split and the moments of the
    rows normalisation is fitted on."""
    names = list(scratch)
    staged = []
    for k, (start, stop) in enumerate(ranges):
        _still_wanted(scratch)
        named = _rows(names, reader, start, stop, blocks[k * len(names):(k + 1) * len(names)])
        n = stop - start
        keep = _finite_rows(named) if clean else np.ones(n, dtype=bool)
        ids = plan.assign(start, stop) if plan is not None else np.zeros(n, dtype=np.int8)
        rows = np.flatnonzero(keep)
        rows = rows[np.argsort(ids[rows], kind="stable")]  # grouped by split, order kept
        grouped = {name: block[rows] for name, block in named.items()}
        _write_together(scratch, slice(start, start + len(rows)), grouped)
        counts = np.bincount(ids[rows], minlength=len(plan.names) if plan else 1)
        fit = None
        if fit_name is not None:
            # The rows of a split are a contiguous run of the grouped rows: a view, no copy.
            first = int(counts[:fit_split].sum())
            fit = Moments.of(grouped[fit_name][first : first + int(counts[fit_split])])
        staged.append((counts, fit))
    return staged


def _write_chunks(out: dict[str, zarr.Array], sources: list[Any], norm: dict[str, tuple],
                  chunks: list[tuple[int, list[tuple[int, int]]]]
                  ) -> tuple[dict[str, Summary], Written]:
    """Second pass: write output chunks, each ``(start, pieces)``: its rows gathered from
    the scratch arrays ``sources`` by ``pieces`` (row ranges) and normalised. Returns the
    statistics of all of them and the chunks stored."""
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
        summaries = {name: summary_of(block) for name, block in blocks.items()}
        total = summaries if total is None else {
            name: total[name].merge(summaries[name]) for name in summaries}
    assert total is not None, "a task writes at least one chunk"
    return total, log.written()


# -- orchestration (runs on the client) -------------------------------------------------------
def _layout(counts: np.ndarray, starts: list[int], chunk_rows: int) -> list[list[tuple[int, int]]]:
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


@functools.cache
def _versions() -> dict[str, str | None]:
    # Read once per process: looking packages up costs milliseconds per build.
    versions = {}
    for package in ("dasktrain", "dask", "distributed", "zarr", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _provenance(source: str, src: Source, config: PrepareConfig) -> dict[str, Any]:
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.name != "overwrite"}
    return {
        "source": os.fspath(source),
        "source_details": src.provenance,
        "options": options,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": dict(_versions()),
    }


def _is_dataset(path: Path | str, storage_options: StorageOptions | None = None) -> bool:
    try:
        open_dataset(path, storage_options=storage_options)
    except (DatasetError, OSError):
        return False
    return True


def _parallelism(client: Client) -> int:
    """Tasks the cluster runs at once (its worker threads), at least one."""
    return max(1, sum(client.nthreads().values()))


def _tuned(task: Any, *args: Any) -> Any:
    """``task(*args)`` in a worker whose allocator thresholds are set (see
    :mod:`dasktrain._malloc`): chunk-sized buffers are then reused, not mapped afresh."""
    tune_allocator()
    return task(*args)


def _run(client: Client, task: Any, args: list[tuple], blocks: list[list] | None, desc: str,
         progress: bool) -> list:
    """Run ``task(*args[t], *blocks[t])`` for every t and gather the results in order.

    Without source blocks (the task reads its rows itself) the tasks are submitted as they
    are, in one message: no graph to build and optimise first (milliseconds a build).
    """
    task = functools.partial(_tuned, task)
    if blocks is None:
        futures = client.map(task, *zip(*args, strict=True), pure=False)
    else:
        futures = client.compute([dask.delayed(task, pure=False)(*a, *b)
                                  for a, b in zip(args, blocks, strict=True)])
    return gather_with_progress(client, futures, desc, progress)


def _group_blocks(reader: BlockReader | None, blocks: list, groups: list[range]
                  ) -> list[list] | None:
    """Per task, the source's delayed blocks of its chunks (array by array within a chunk),
    or None where the tasks read their rows themselves."""
    if reader is not None:
        return None
    return [[b[i] for i in group for b in blocks] for group in groups]


def _write_direct(client: Client, src: Source, root: zarr.Group, reader: BlockReader | None,
                  blocks: list, starts: list[int], lengths: list[int], chunk_rows: int,
                  config: PrepareConfig, progress: bool) -> list | None:
    """One pass: source chunk i becomes output chunk i. A source that may hold NaN/inf is
    checked chunk by chunk; if any chunk does, the arrays are dropped and None returned."""
    out = _create_arrays(root, src, src.num_samples, chunk_rows, config.compression)
    # Bound once, in a partial: dask would otherwise walk the arrays and the reader in the
    # arguments of every task, looking for collections (milliseconds per task).
    write = functools.partial(_write_rows, out, reader, not src.known_finite)
    chunk_bytes = chunk_rows * row_bytes([(s.dtype, s.sample_shape) for s in src.specs.values()])
    groups = plan_tasks(len(starts), chunk_bytes, _parallelism(client))
    results = _run(client, write,
                   [([(starts[i], starts[i] + lengths[i]) for i in group],) for group in groups],
                   _group_blocks(reader, blocks, groups), "writing", progress)
    if all(r is not None for r in results):
        return results
    logger.info("source holds NaN or infinite values: cleaning in two passes")
    for name in out:
        del root[name]
    return None


def _write_staged(client: Client, source: str, src: Source, root: zarr.Group,
                  reader: BlockReader | None, blocks: list,
                  starts: list[int], lengths: list[int], chunk_rows: int, scratch_store: StoreLike,
                  plan: SplitPlan | None, config: PrepareConfig, progress: bool
                  ) -> tuple[list, np.ndarray, dict | None]:
    """Two passes through a scratch Zarr: clean and group rows by split, then write."""
    specs = src.specs
    names = list(specs)
    scratch_root = zarr.open_group(scratch_store, mode="w")
    scratch = {
        name: scratch_root.create_array(
            name, shape=(src.num_samples, *spec.sample_shape), dtype=spec.dtype,
            chunks=(chunk_rows, *spec.sample_shape), compressors=None, fill_value=0,
            # Chunk files side by side, not a directory each: fewer to make and remove.
            chunk_key_encoding={"name": "default", "separator": "."})
        for name, spec in specs.items()
    }
    features = [n for n in names if specs[n].role == "features"]
    fit_name = features[0] if config.normalize and features else None
    stage = functools.partial(_stage_chunks, scratch, 0, fit_name, not src.known_finite, reader)
    chunk_bytes = chunk_rows * row_bytes([(s.dtype, s.sample_shape) for s in specs.values()])
    parallelism = _parallelism(client)
    groups = plan_tasks(len(starts), chunk_bytes, parallelism)
    args = []
    for group in groups:
        first, last = group[0], group[-1]
        args.append(([(starts[i], starts[i] + lengths[i]) for i in group],
                     plan.slice_for(starts[first], starts[last] + lengths[last]) if plan
                     else None))
    staged = [chunk for task in _run(client, stage, args, _group_blocks(reader, blocks, groups),
                                     "staging", progress) for chunk in task]
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
    norm, normalization = {}, None
    if fit_name is not None:
        fit = merge_all([m for _, m in staged])
        # A constant feature is divided by 1, not by a std of 0 (or of rounding noise): it
        # becomes 0, which the preparation warns about.
        constant = fit.constant
        std = np.where((fit.std > 0) & ~constant, fit.std, 1.0)
        norm[fit_name] = (fit.mean.astype(np.float32), std.astype(np.float32))
        normalization = {fit_name: {
            "mean": fit.mean.tolist(), "std": std.tolist(), "count": fit.count,
            "fitted_on": plan.names[0] if plan else "all",
            "constant": np.flatnonzero(constant).tolist()}}
    out = _create_arrays(root, src, num_samples, chunk_rows, config.compression)
    scratch_list = [scratch[n] for n in names]
    write = functools.partial(_write_chunks, out, scratch_list, norm)
    layout = _layout(counts, starts, chunk_rows)
    results = _run(client, write, [([(j * chunk_rows, layout[j]) for j in group],)
                                   for group in plan_tasks(len(layout), chunk_bytes, parallelism)],
                   None, "writing", progress)
    return results, counts, normalization


def _build(client: Client, source: str, src: Source, root: zarr.Group, scratch_store: StoreLike,
           config: PrepareConfig, progress: bool) -> dict[str, Any]:
    specs = src.specs
    chunk_rows = config.chunk_rows or chunk_rows_for(
        row_bytes([(s.dtype, s.sample_shape) for s in specs.values()]), config.chunk_size)
    arrays = src.to_dask(chunk_rows)
    chunk_rows = min(chunk_rows, src.num_samples)
    names = list(specs)
    lengths = list(arrays[names[0]].chunks[0])
    starts = list(np.cumsum((0, *lengths[:-1])).tolist())
    reader = src.block_reader()
    blocks = [] if reader is not None else [arrays[name].to_delayed().ravel() for name in names]
    plan = (SplitPlan.make(config.split, src.num_samples, config.seed) if config.split
            else None)

    results = None
    if plan is None and not config.normalize:
        results = _write_direct(client, src, root, reader, blocks, starts, lengths, chunk_rows,
                                config, progress)
    normalization, splits = None, {}
    num_samples = src.num_samples
    if results is None:
        results, counts, normalization = _write_staged(
            client, source, src, root, reader, blocks, starts, lengths, chunk_rows,
            scratch_store, plan, config, progress)
        num_samples = int(counts.sum())
        if plan is not None:
            edges = np.cumsum([0, *counts.sum(axis=0).tolist()]).tolist()
            splits = {name: [edges[k], edges[k + 1]] for k, name in enumerate(plan.names)}
    return {
        "format_version": FORMAT_VERSION,
        # New for every build, even of the same source to the same place: task keys of the
        # dataset's readers include it (Dataset.identity), so they never name an older build.
        "dataset_id": uuid.uuid4().hex,
        "num_samples": num_samples,
        "chunk_rows": chunk_rows,
        "arrays": {n: {"role": specs[n].role, "dtype": str(specs[n].dtype),
                       "shape": [num_samples, *specs[n].sample_shape]} for n in names},
        "stats": {name: merge_all([r[name] for r, _ in results]).to_json() for name in names},
        "normalization": normalization,
        "splits": splits,
        "labels": src.labels,
        "rows_dropped_nonfinite": src.num_samples - num_samples,
        "provenance": _provenance(source, src, config),
        MANIFEST_KEY: manifest_of([written for _, written in results],
                                  dict.fromkeys(names, -(-num_samples // chunk_rows))),
    }


def prepare(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    client: Client | None = None,
    scheduler: str | None = None,
    progress: bool = True,
    storage_options: StorageOptions | None = None,
    config: PrepareConfig | None = None,
    **options: Any,
) -> Dataset:
    """Build a dasktrain dataset at ``out`` from ``source`` with a Dask graph.

    Parameters
    ----------
    source
        A built-in name (``digits``, ``parabola``, ``regression``, ``classification``) or a
        path: ``.npy``/``.npz`` file, CSV or Parquet file, or a directory of them.
    out
        Local directory of the new dataset, or an fsspec URL (``s3://bucket/digits.zarr``,
        ``gs://...``); either must be storage every worker can reach.
    client, scheduler
        Run on this client or on the cluster at this address; by default on the client
        made in this process, else on the process's embedded LocalCluster.
    progress
        Show a progress bar per pass.
    storage_options
        Passed to fsspec for a URL ``out`` (credentials, ``endpoint_url``...); they travel
        with the tasks, so workers use them too.
    config, **options
        A :class:`PrepareConfig`, or its fields as keywords (``split="train=0.9,val=0.1"``,
        ``normalize=True``, ``chunk_rows=8192``, ``samples=...``, ``overwrite=True``...).

    Returns
    -------
    Dataset
        The new dataset, opened.

    Raises
    ------
    SourceError
        The source is missing, empty, not numeric or inconsistent.
    FileExistsError
        ``out`` exists and ``overwrite`` is not set.

    Warns
    -----
    CleaningWarning
        Rows with NaN, infinite or (tabular) missing values were dropped, or ``normalize``
        turned features constant on the fitted split into zeros; with the counts.

    Notes
    -----
    A local dataset is built in a hidden sibling of ``out`` and renamed into place at the
    end: a failed or interrupted run leaves nothing at ``out`` and never damages what was
    there. At a URL the arrays are written under a prefix of the build's own and the group
    metadata that makes it a dataset is written last, in one PUT (see
    :mod:`dasktrain.datasets.remote`).
    """
    if config is not None and options:
        raise TypeError("give either config= or keyword options, not both")
    config = config or PrepareConfig(**options)
    text = os.fspath(out)
    staged: StagedDirectory | StagedPrefix
    if is_url(text):
        target = strip_url(text)
        check_output_url(target, config.overwrite, storage_options,
                         lambda url: _is_dataset(url, storage_options))
        staged = StagedPrefix(target, storage_options, config.overwrite)
    else:
        target = Path(local_path(text)).absolute()
        check_output_path(target, config.overwrite, _is_dataset)
        staged = StagedDirectory(target)
    try:
        # The source checks its schema before a cluster starts: bad input fails fast.
        source_options = SourceOptions(
            features=config.features, target=config.target,
            encode_categorical=config.encode_categorical, samples=config.samples,
            width=config.width, classes=config.classes, noise=config.noise,
            seed=config.seed, scratch_dir=staged.source_scratch)
        src = get_source(source, source_options)
        with cluster_client(client, scheduler) as active:
            attrs = _build(active, os.fspath(source), src, staged.open_group(),
                           staged.stage_store(), config, progress)
        staged.publish(attrs)
    except BaseException:
        staged.discard()
        raise
    warn_about_cleaning(attrs)
    logger.info("prepared %s: %d samples", target, attrs["num_samples"])
    return open_dataset(target, storage_options=storage_options)
