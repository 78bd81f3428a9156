"""Cutting a build into tasks and running them on the cluster: how many chunks a task
writes, the output arrays the tasks write into, and the run of one pass's tasks."""

from __future__ import annotations

import functools
from typing import Any

import dask
import zarr
from distributed import Client

from dasktrain._malloc import tune_allocator
from dasktrain._progress import gather_with_progress
from dasktrain.datasets.format import create_sample_array
from dasktrain.datasets.sources import Source
from dasktrain.datasets.sources.base import BlockReader

__all__ = [
    "TASK_BYTES",
    "create_arrays",
    "group_blocks",
    "plan_tasks",
    "pooled_arrays",
    "run_tasks",
    "source_task_bytes",
    "task_reader",
    "task_slots",
]


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


def create_arrays(group: zarr.Group, source: Source, num_samples: int, chunk_rows: int,
                  compression: str) -> dict[str, zarr.Array]:
    """The output arrays of a build, one per array of the source, chunked by rows."""
    return {
        name: create_sample_array(
            group, name, shape=(num_samples, *spec.sample_shape), dtype=spec.dtype,
            chunks=(min(chunk_rows, max(num_samples, 1)), *spec.sample_shape),
            compressors=_compressors(compression), fill_value=0,
            # Every chunk is stored, zeros too: a chunk that is not there is then damage,
            # never a chunk of fill values (see dasktrain.datasets.chunks).
            config={"write_empty_chunks": True},
        )
        for name, spec in source.specs.items()
    }


def source_task_bytes(source: Source, chunk_rows: int, chunk_bytes: int) -> int:
    """Bytes a reading task covers: :data:`TASK_BYTES`, or more where the source decodes
    pieces larger than that (``task_rows``: a Parquet row group), so that each piece is
    decoded about once, not once by each of the several tasks it would feed."""
    rows = getattr(source, "task_rows", 0)
    return max(TASK_BYTES, -(-rows // max(chunk_rows, 1)) * chunk_bytes)


def task_reader(reader: BlockReader | None, ranges: list[tuple[int, int]]
                ) -> BlockReader | None:
    """The reader a task carries for its chunks' rows (``ranges``, consecutive): where the
    source can narrow it (``for_rows``), one that holds what those rows need only; a
    folder's reader would otherwise carry every file's name into every task."""
    narrow = getattr(reader, "for_rows", None)
    if narrow is None:
        return reader
    return narrow(ranges[0][0], ranges[-1][1])


def pooled_arrays(source: Source) -> tuple[str, ...]:
    """The arrays whose statistics are of all their values as one feature (token ids)."""
    return tuple(name for name, spec in source.specs.items() if spec.pooled)


def task_slots(client: Client) -> int:
    """Tasks the cluster runs at once (its worker threads), at least one."""
    return max(1, sum(client.nthreads().values()))


def _tuned(task: Any, *args: Any) -> Any:
    """``task(*args)`` in a worker whose allocator thresholds are set (see
    :mod:`dasktrain._malloc`): chunk-sized buffers are then reused, not mapped afresh."""
    tune_allocator()
    return task(*args)


def run_tasks(client: Client, task: Any, args: list[tuple], blocks: list[list] | None,
              desc: str, progress: bool) -> list:
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


def group_blocks(reader: BlockReader | None, blocks: list, groups: list[range]
                 ) -> list[list] | None:
    """Per task, the source's delayed blocks of its chunks (array by array within a chunk),
    or None where the tasks read their rows themselves."""
    if reader is not None:
        return None
    return [[b[i] for i in group for b in blocks] for group in groups]
