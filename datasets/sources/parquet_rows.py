"""Rows of Parquet files read by the preparing tasks themselves, row group by row group.

Through ``dask.dataframe`` a table is read twice (once to count its complete rows, once to
write them), each partition becomes a frame, a frame without its missing rows and a block,
and the block is cut into chunks that wait in the workers' memory for the task that writes
them: at 100 M rows a preparing worker peaked at 1.6 GB, growing with the table (W13 in
docs/benchmarks.md). A table whose chosen columns hold no missing values (the files' own
statistics say so, without reading the data) needs none of that: the number of rows is
in the footers, and each task reads the rows it writes from the row groups that hold them,
one row group at a time.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dasktrain.datasets.sources.base import ArraySpec

__all__ = ["ParquetRows", "parquet_rows"]


def _without_nulls(metadata: pq.FileMetaData, columns: Sequence[str]) -> bool:
    """Whether the footer says that ``columns`` hold no missing value in any row group
    (False where it cannot say: a column missing, or statistics not written)."""
    names = metadata.schema.names
    if any(c not in names for c in columns):
        return False
    positions = [names.index(c) for c in columns]
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for position in positions:
            stats = group.column(position).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return False
    return True


def parquet_rows(files: Sequence[Path], arrays: dict[str, tuple[Sequence[str], ArraySpec]]
                 ) -> ParquetRows | None:
    """A reader of ``arrays`` (``{name: (its columns, its spec)}``) from ``files``, or None
    where the footers do not show every chosen column free of missing values (the table is
    then read through ``dask.dataframe``, which drops those rows)."""
    chosen = {name: (tuple(cols), spec) for name, (cols, spec) in arrays.items()}
    columns = _columns(chosen)
    pieces: list[tuple[str, int, int]] = []
    for file in files:
        metadata = pq.ParquetFile(file).metadata
        if not _without_nulls(metadata, columns):
            return None
        pieces += [(str(file), g, metadata.row_group(g).num_rows)
                   for g in range(metadata.num_row_groups) if metadata.row_group(g).num_rows]
    return ParquetRows(pieces, chosen) if pieces else None


def _columns(arrays: dict[str, tuple[tuple[str, ...], ArraySpec]]) -> list[str]:
    """The columns ``arrays`` read, each once, in order."""
    return list(dict.fromkeys(c for cols, _ in arrays.values() for c in cols))


def _concatenate(pieces: list[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class ParquetRows:
    """``reader(start, stop)``: the rows ``start .. stop`` of every array, from the row
    groups ``pieces`` (``(file, row group, rows)`` in the table's order).

    Each thread keeps the last row group it decoded, so the consecutive chunks of a task
    decode each row group once; :meth:`release` lets it go at the task's end. A thread
    holds one decoded row group (its uncompressed size: 68 MB for 1 M rows of 17 float32
    columns), whatever the size of the table. Decoding a row group whole takes the least
    memory pyarrow offers: its batch reader held 4x the row group's size, decoding 4 MiB at
    a time.
    """

    def __init__(self, pieces: list[tuple[str, int, int]],
                 arrays: dict[str, tuple[tuple[str, ...], ArraySpec]]) -> None:
        self.pieces = pieces
        self.arrays = arrays
        self.columns = _columns(arrays)
        self.starts = np.cumsum([0, *(rows for _, _, rows in pieces)]).tolist()
        self._local = threading.local()

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    @property
    def largest_piece(self) -> int:
        """Rows of the largest row group: a task reading fewer rows than this decodes the
        row groups it shares with its neighbours once more each."""
        return max(rows for _, _, rows in self.pieces)

    def __call__(self, start: int, stop: int) -> dict[str, np.ndarray]:
        parts: list[pa.Table] = []
        k = bisect.bisect_right(self.starts, start) - 1
        while k < len(self.pieces) and self.starts[k] < stop:
            begin = max(start - self.starts[k], 0)
            end = min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(self._piece(k).slice(begin, end - begin))
            k += 1
        # Column by column: files may differ in a column's type (int64 in one, float64 in
        # the next), which numpy promotes where concatenating tables would refuse.
        columns = {c: _concatenate([part.column(c).to_numpy() for part in parts])
                   for c in self.columns}
        return {name: (np.stack([columns[c] for c in cols], axis=1) if spec.sample_shape
                       else columns[cols[0]]).astype(spec.dtype, copy=False)
                for name, (cols, spec) in self.arrays.items()}

    def _piece(self, k: int) -> pa.Table:
        held = getattr(self._local, "held", None)
        if held is not None and held[0] == k:
            return held[1]
        self._local.held = None  # the previous one goes before the next is read
        file, group, _ = self.pieces[k]
        # One thread: Dask's threads are the parallelism, and pyarrow's own pool would
        # oversubscribe them (and is one more pool to outlive a fork).
        table = pq.ParquetFile(file).read_row_group(group, columns=self.columns,
                                                    use_threads=False)
        self._local.held = (k, table)
        return table

    def release(self) -> None:
        """Let go of the row group this thread holds (a task's chunks are all read)."""
        self._local.held = None

    def __getstate__(self) -> dict[str, Any]:
        return {"pieces": self.pieces, "arrays": self.arrays}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["pieces"], state["arrays"])  # type: ignore[misc]
