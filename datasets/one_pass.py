"""The one-pass build: source chunk i becomes output chunk i, written as it is read, with
its statistics (which also tell whether every value is finite) computed on the way."""

from __future__ import annotations

import functools
import logging

import zarr
from distributed import Client

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
from dasktrain.datasets.sources import Source
from dasktrain.datasets.sources.base import BlockReader
from dasktrain.datasets.write_tasks import write_rows

__all__ = ["write_direct"]

logger = logging.getLogger(__name__)


def write_direct(client: Client, src: Source, root: zarr.Group, reader: BlockReader | None,
                 blocks: list, starts: list[int], lengths: list[int], chunk_rows: int,
                 config: PrepareConfig, progress: bool) -> list | None:
    """One pass: source chunk i becomes output chunk i. A source that may hold NaN/inf is
    checked chunk by chunk; if any chunk does, the arrays are dropped and None returned."""
    out = create_arrays(root, src, src.num_samples, chunk_rows, config.compression)
    # The arrays bound once, in a partial: dask would otherwise walk them in the arguments
    # of every task, looking for collections (milliseconds per task). The reader goes with
    # each task: what it carries may be its rows' share only (task_reader).
    write = functools.partial(write_rows, out, not src.known_finite,
                              pooled=pooled_arrays(src))
    chunk_bytes = chunk_rows * sum(s.sample_bytes for s in src.specs.values())
    groups = plan_tasks(len(starts), chunk_bytes, task_slots(client),
                        source_task_bytes(src, chunk_rows, chunk_bytes))
    ranges = [[(starts[i], starts[i] + lengths[i]) for i in group] for group in groups]
    results = run_tasks(client, write,
                        [(task_reader(reader, r), r) for r in ranges],
                        group_blocks(reader, blocks, groups), "writing", progress)
    if all(r is not None for r in results):
        return results
    logger.info("source holds NaN or infinite values: cleaning in two passes")
    for name in out:
        del root[name]
    return None
