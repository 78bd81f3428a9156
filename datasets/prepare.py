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

Here: the public :func:`prepare` and the attributes a build records. The passes are
:mod:`~dasktrain.datasets.one_pass` and :mod:`~dasktrain.datasets.two_pass`, the tasks they
run on the workers :mod:`~dasktrain.datasets.write_tasks`, and cutting work into tasks and
running them :mod:`~dasktrain.datasets.build_tasks`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from distributed import Client, KilledWorker
from zarr.storage import StoreLike

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions, is_url, local_path, strip_url
from dasktrain.datasets.atomic import StagedDirectory, check_output_path
from dasktrain.datasets.build_tasks import TASK_BYTES, plan_tasks
from dasktrain.datasets.chunks import MANIFEST_KEY, manifest_of
from dasktrain.datasets.cleaning import warn_about_cleaning
from dasktrain.datasets.config import PrepareConfig
from dasktrain.datasets.dataset import Dataset, open_dataset
from dasktrain.datasets.errors import DatasetError, PreparationFailed, SourceError
from dasktrain.datasets.format import FORMAT_VERSION, chunk_lengths, chunk_rows_for
from dasktrain.datasets.one_pass import write_direct
from dasktrain.datasets.remote import StagedPrefix, check_output_url
from dasktrain.datasets.sizes import human_bytes
from dasktrain.datasets.sources import Source, SourceOptions, get_source
from dasktrain.datasets.sources.base import source_settings
from dasktrain.datasets.sources.named import check_specs
from dasktrain.datasets.splits import SplitPlan
from dasktrain.datasets.stats import merge_all
from dasktrain.datasets.two_pass import write_staged
from dasktrain.errors import ClusterStuck

__all__ = ["TASK_BYTES", "plan_tasks", "prepare"]

logger = logging.getLogger(__name__)


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


announce: Callable[[str], None] | None = None
"""Where the line a preparation says before it writes goes, beside the log (the CLI prints
it)."""


def _expected(src: Source) -> str:
    """What the build will write, as known before it starts: ``1,797 samples, about 464.3
    KiB before compression``, and what the source adds (images: their size and its cost)."""
    note = getattr(src, "note", None)
    if src.num_samples < 0:  # a table's complete rows, a corpus's tokens: counted first
        said = "the samples are counted first"
    else:
        row_bytes = sum(s.sample_bytes for s in src.specs.values())
        said = (f"{src.num_samples:,} samples, about "
                f"{human_bytes(src.num_samples * row_bytes)} before compression")
    return f"{said}; {note}" if note else said


def _killed(src: Source, exc: KilledWorker) -> PreparationFailed:
    """The error of a preparation whose workers died again and again, saying the usual
    cause (a worker's memory) and what to change."""
    return PreparationFailed(
        f"the workers preparing this dataset died while running its tasks, again and again "
        f"(Dask gave up: {type(exc).__name__}); a worker killed for using more memory than "
        f"it may is the usual cause: {_memory_fix(src)}")


def _memory_fix(src: Source) -> str:
    hint = getattr(src, "memory_hint", None)
    return (hint() if hint is not None else
            "give a smaller --chunk-size (chunk_size=), or the workers more memory")


def _build(client: Client, source: str, src: Source, root: zarr.Group, scratch_store: StoreLike,
           config: PrepareConfig, progress: bool) -> dict[str, Any]:
    specs = src.specs
    row_bytes = sum(s.sample_bytes for s in specs.values())
    # A source may round the rows of a chunk (images: whole pieces of the pipeline's work)
    rows_for = getattr(src, "chunk_rows_for", chunk_rows_for)
    chunk_rows = config.chunk_rows or rows_for(row_bytes, config.chunk_size)
    scan = getattr(src, "scan", None)
    if scan is not None:  # a pass before the rows are known (a text corpus: its tokens)
        scan(client, progress)
    names = list(specs)
    reader = src.block_reader()
    if reader is not None:  # the tasks read their rows themselves: no Dask arrays to build
        lengths = list(chunk_lengths(src.num_samples, chunk_rows))
        blocks = []
    else:
        arrays = src.to_dask(chunk_rows)
        lengths = list(arrays[names[0]].chunks[0])
        blocks = [arrays[name].to_delayed().ravel() for name in names]
    chunk_rows = min(chunk_rows, src.num_samples)
    starts = list(np.cumsum((0, *lengths[:-1])).tolist())
    plan = (SplitPlan.make(config.split, src.num_samples, config.seed) if config.split
            else None)

    results = None
    if plan is None and not config.normalize:
        results = write_direct(client, src, root, reader, blocks, starts, lengths, chunk_rows,
                               config, progress)
    normalization, splits = None, {}
    num_samples = src.num_samples
    if results is None:
        results, counts, normalization = write_staged(
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
        # What a source adds (a token dataset: its tokenizer and packing, under "text").
        **getattr(src, "attributes", {}),
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
        ``arrays=["image", "metadata", "label:targets"]`` writes several named arrays (the
        members of an ``.npz``, column groups of a table ``"meta=a,b"``), each with its role.

    Returns
    -------
    Dataset
        The new dataset, opened.

    Raises
    ------
    SourceError
        The source is missing, empty, not numeric or inconsistent.
    OutputExistsError
        ``out`` exists and ``overwrite`` is not set, or is no dasktrain dataset; or another
        preparation published a dataset there while this one ran (without ``overwrite``;
        with it, the preparation that publishes last wins). It is a ``FileExistsError``.

    Warns
    -----
    CleaningWarning
        Rows with NaN, infinite or (tabular) missing values were dropped, or ``normalize``
        turned features constant on the fitted split into zeros; with the counts.

    Notes
    -----
    A local dataset is built in a hidden sibling of ``out`` and renamed into place at the
    end: a failed or interrupted run leaves nothing at ``out`` and never damages what was
    there. The rename never replaces a dataset it did not mean to (see
    :mod:`dasktrain.datasets.atomic`). At a URL the arrays are written under a prefix of
    the build's own and the group metadata that makes it a dataset is written last, in
    one PUT, under a lock object that one publish at a time holds (see
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
        staged = StagedDirectory(target, config.overwrite, _is_dataset)
    try:
        # The source checks its schema before a cluster starts: bad input fails fast.
        source_options = SourceOptions(**source_settings(config),
                                       scratch_dir=staged.source_scratch)
        src = get_source(source, source_options)
        integers = [f"{n!r} ({s.dtype})" for n, s in src.specs.items()
                    if s.role == "features" and s.dtype.kind in "biuO"]
        if config.normalize and integers:
            raise SourceError(f"normalize standardises float features; {', '.join(integers)} "
                              "holds integers or bytes (tokens, pixels, encoded images): "
                              "leave out --normalize")
        check_specs(os.fspath(source), src.specs, src.provenance, config.arrays)
        said = f"preparing {target} from {os.fspath(source)}: {_expected(src)}"
        logger.info("%s", said)
        if announce is not None:
            announce(said)
        with cluster_client(client, scheduler) as active:
            try:
                attrs = _build(active, os.fspath(source), src, staged.open_group(),
                               staged.stage_store(), config, progress)
            except KilledWorker as exc:
                raise _killed(src, exc) from exc
            except ClusterStuck as exc:
                raise PreparationFailed(f"preparing {target}: {exc}; for this source: "
                                        f"{_memory_fix(src)}") from exc
        staged.publish(attrs)
    except Exception as exc:
        # A build at a URL that another preparation's publish retired fails in its tasks,
        # which only see it gone: say what happened instead.
        retired = staged.retired_error() if isinstance(staged, StagedPrefix) else None
        staged.discard()
        if retired is not None:
            raise retired from exc
        raise
    except BaseException:
        staged.discard()
        raise
    warn_about_cleaning(attrs)
    logger.info("prepared %s: %d samples", target, attrs["num_samples"])
    return open_dataset(target, storage_options=storage_options)
