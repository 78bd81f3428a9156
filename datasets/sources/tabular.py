"""CSV and Parquet sources (files or directories of them), read with dask.dataframe, or,
for Parquet without missing values, by the preparing tasks themselves (see
:mod:`~dasktrain.datasets.sources.parquet_rows`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.sources.base import (
    ArraySpec,
    SourceOptions,
    register_suffix,
    stored_dtype,
    suffix_of,
)
from dasktrain.datasets.sources.named import ArrayChoice, resolve_choices
from dasktrain.datasets.sources.parquet_rows import ParquetRows, parquet_rows

__all__ = ["TabularSource"]

#: Bytes of CSV one task reads.
_CSV_BLOCK = "32MiB"
#: Name of the file column the search for a bad CSV cell adds (not a user's column's name).
_FILE_COLUMN = "dasktrain-source-file"
_FIX = "encode the column with --encode-categorical or leave it out with --features"


def _read(path: Path, suffix: str) -> tuple[dd.DataFrame, list[Path], set[str]]:
    """The table, its files, and the columns of integers (CSV reads them as float64)."""
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == suffix) if path.is_dir() \
        else [path]
    if not files:
        raise SourceError(f"{path} holds no {suffix} files")
    # No explicit names: dask keys both readers on each file's version, so a file of the same
    # name elsewhere or rewritten in place never shares keys (read_csv's blocks through
    # fs.ukey, read_parquet through fs.checksum: fsspec's info, with size, mtime and inode).
    try:
        if suffix == ".csv":
            if not any(_csv_has_rows(f) for f in files):
                raise SourceError(f"{path} is empty: no data rows")
            names = [str(f) for f in files]
            df = dd.read_csv(names, blocksize=_CSV_BLOCK)
            # dask infers the types from the first rows: an integer column with a missing
            # cell further down would fail the read (its rows are dropped instead).
            integers = {c for c, t in df.dtypes.items() if pd.api.types.is_integer_dtype(t)}
            if integers:
                df = dd.read_csv(names, blocksize=_CSV_BLOCK,
                                 dtype=dict.fromkeys(integers, "float64"))
            return df, files, integers
        if not any(pq.ParquetFile(f).metadata.num_rows for f in files):
            raise SourceError(f"{path} is empty: no data rows")
        return dd.read_parquet([str(f) for f in files]), files, set()
    except SourceError:
        raise
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from exc


def _csv_has_rows(path: Path) -> bool:
    try:
        return len(pd.read_csv(path, nrows=1)) > 0
    except pd.errors.EmptyDataError:
        return False


def _is_numeric(dtype: Any) -> bool:
    return pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)


def _scan_for_text(part: pd.DataFrame, columns: list[str]
                   ) -> tuple[str, int, tuple[int, str, str] | None]:
    """A block of CSV read as text: its file, its rows, and its first cell in ``columns``
    that is not a number (row in the block, column, value), if any."""
    first = None
    for column in columns:
        text = part[column]
        bad = (pd.to_numeric(text, errors="coerce").isna() & text.notna()).to_numpy()
        if bad.any():
            row = int(bad.argmax())
            if first is None or row < first[0]:
                first = (row, column, str(text.iloc[row]))
    return (str(part[_FILE_COLUMN].iloc[0]) if len(part) else "", len(part), first)


def _find_text_cell(files: list[Path], columns: list[str]) -> tuple[str, int, str, str] | None:
    """The first cell of a number column that holds text: file, data row (from 1), column,
    value. One more pass over the files, read as text: run only once reading failed."""
    df = dd.read_csv([str(f) for f in files], blocksize=_CSV_BLOCK, usecols=columns,
                     dtype=dict.fromkeys(columns, "object"), include_path_column=_FILE_COLUMN)
    blocks = dask.compute(*[dask.delayed(_scan_for_text)(part, columns)
                            for part in df.to_delayed()])
    rows_before: dict[str, int] = {}  # blocks come in file order, a file's in row order
    for file, length, first in blocks:
        before = rows_before.get(file, 0)
        if first is not None:
            row, column, value = first
            return file, before + row + 1, column, value
        rows_before[file] = before + length
    return None


def _encode(part: pd.DataFrame, categories: dict[str, list]) -> pd.DataFrame:
    part = part.copy()
    for column, cats in categories.items():
        values = part[column].astype("string")
        codes = pd.Categorical(values, categories=cats).codes.astype("float64")
        codes[codes < 0] = np.nan  # missing values stay missing, and are dropped later
        part[column] = codes
    return part


class TabularSource:
    """Rows of a CSV or Parquet table; ``features=`` and ``target=`` pick the columns.

    Without ``features``, every column but the target is a feature. Non-numeric columns are
    refused by name unless ``encode_categorical`` is set, in which case their sorted distinct
    values become integer codes (recorded as labels). Rows with missing values in the chosen
    columns are dropped (counted in the provenance).
    """

    known_finite = False

    def __init__(self, source: str, options: SourceOptions):
        path = Path(source)
        df, self._files, integers = _read(path, suffix_of(path))
        columns = list(df.columns)
        if not columns:
            raise SourceError(f"{path} has no columns")
        if options.arrays is not None:
            groups = _named_groups(path, columns, options)
        else:
            groups = _feature_and_target(path, columns, options)
        chosen = [c for group in groups for c in group.sources]
        df = df[chosen]
        non_numeric = [c for c in chosen if not _is_numeric(df[c].dtype)]
        self.labels: dict[str, list[str]] = {}
        if non_numeric and not options.encode_categorical:
            raise SourceError(
                f"{path}: non-numeric column{'s' if len(non_numeric) > 1 else ''} "
                f"{', '.join(map(repr, non_numeric))} (dtype "
                f"{', '.join(str(df[c].dtype) for c in non_numeric)}); drop them with "
                "--features or encode them with --encode-categorical"
            )
        self._path, self._df, self._chosen, self._non_numeric = path, df, chosen, non_numeric
        self._groups = groups
        self.num_samples = -1  # known once to_dask() has counted the complete rows
        self.task_rows = 0  # rows a reading task decodes at once (see block_reader)
        self.specs = {g.name: _spec(g, df, non_numeric, integers) for g in groups}
        self.provenance = {"kind": "tabular", "path": str(path.resolve()),
                           "encoded": non_numeric,
                           "columns": {g.name: list(g.sources) for g in groups}}
        if options.arrays is None:
            self.provenance.update(features=list(groups[0].sources), target=options.target)
        else:
            self.provenance["arrays"] = {g.name: {"from": list(g.sources), "role": g.role}
                                         for g in groups}

    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        """Encode categories and count complete rows (passes over the table), then chunk."""
        try:
            return self._to_dask(chunk_rows)
        except ValueError as exc:
            # A cell further down than the rows dask inferred the column types from does
            # not fit its column: say where, in the terms of a user, not of read_csv.
            if self._files[0].suffix.lower() != ".csv" or "Mismatched dtypes" not in str(exc):
                raise
            raise self._text_cell_error() from exc

    def _text_cell_error(self) -> SourceError:
        # Booleans read as text ("True") are no numbers either: only numbers are searched.
        numbers = [c for c in self._chosen if c not in self._non_numeric
                   and not pd.api.types.is_bool_dtype(self._df[c].dtype)]
        found = _find_text_cell(self._files, numbers)
        if found is None:
            return SourceError(f"cannot read {self._path}: a cell does not fit the type of "
                               "its column, which was inferred from the first rows")
        file, row, column, value = found
        if len(value) > 40:
            value = value[:37] + "..."
        return SourceError(f"{file}: column {column!r} holds the non-numeric value {value!r} "
                           f"at data row {row:,} (about line {row + 1:,}); {_FIX}")

    def _to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        df = self._df
        if self._non_numeric:
            uniques = dd.compute(*[df[c].dropna().unique() for c in self._non_numeric])
            categories = {c: sorted(map(str, u))
                          for c, u in zip(self._non_numeric, uniques, strict=True)}
            meta = df._meta.astype({c: "float64" for c in self._non_numeric})
            df = df.map_partitions(_encode, categories, meta=meta)
            for group in self._groups:
                # The codes of a target (or other) column of categories mean its labels.
                if self.specs[group.name].sample_shape == () and group.sources[0] in categories:
                    self.labels[group.name] = categories[group.sources[0]]
        complete = df.dropna()
        # One pass counts rows read and rows kept per partition.
        read_lengths, kept_lengths = dd.compute(df.map_partitions(len),
                                                complete.map_partitions(len))
        rows_read = int(sum(read_lengths))
        parts = complete.to_dask_array(lengths=[int(n) for n in kept_lengths])
        self.num_samples = int(parts.shape[0])
        if self.num_samples == 0:
            raise SourceError(f"{self._path} is empty: {rows_read} row(s), none complete in "
                              f"columns {self._chosen}")
        self.provenance.update(rows_read=rows_read,
                               rows_dropped_missing=rows_read - self.num_samples)
        out, first = {}, 0
        for group in self._groups:
            spec, last = self.specs[group.name], first + len(group.sources)
            if spec.sample_shape:
                block = parts[:, first:last].rechunk({0: chunk_rows, 1: -1})
            else:
                block = parts[:, first].rechunk({0: chunk_rows})
            out[group.name] = block.astype(spec.dtype)
            first = last
        return out

    def block_reader(self) -> ParquetRows | None:
        """Parquet files whose chosen columns hold no missing values, and no categories to
        encode: each task reads its rows (the count is in the footers). Otherwise None: a
        chunk gathers rows from several partitions of a frame without its missing rows,
        read through :meth:`to_dask`."""
        if self._non_numeric or self._files[0].suffix.lower() == ".csv":
            return None
        reader = parquet_rows(self._files, {g.name: (g.sources, self.specs[g.name])
                                            for g in self._groups})
        if reader is None:
            return None
        self.num_samples = reader.num_rows
        self.provenance.update(rows_read=reader.num_rows, rows_dropped_missing=0)
        # A task of fewer rows than a row group decodes the groups it shares once more.
        self.task_rows = reader.largest_piece
        return reader

    def memory_hint(self) -> str:
        """What a preparing worker needs, said when one runs out of memory."""
        if not self.task_rows:
            return ("give the workers more memory, or a smaller --chunk-size (chunk_size=): "
                    "a task holds a few chunks and the partitions of the table they come from")
        row_group = self.task_rows * sum(spec.sample_bytes for spec in self.specs.values())
        return (f"each thread of a preparing worker holds one decoded row group of the Parquet "
                f"files (up to {row_group / 2**20:,.0f} MiB here): give the workers "
                "more memory or fewer threads, or write the files with smaller row groups")


def _feature_and_target(path: Path, columns: list[str], options: SourceOptions
                        ) -> list[ArrayChoice]:
    """``x`` of the feature columns and ``y`` of the target column, as ``features=`` and
    ``target=`` choose them (by default every column but the target is a feature)."""
    target = options.target
    if target is not None and target not in columns:
        raise SourceError(f"{path} has no column {target!r} (the target); columns: {columns}")
    features = options.features or [c for c in columns if c != target]
    unknown = [c for c in features if c not in columns]
    if unknown:
        raise SourceError(
            f"{path} has no column{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; columns: {columns}"
        )
    if target is not None and target in features:
        raise SourceError(f"column {target!r} cannot be both a feature and the target")
    if not features:
        raise SourceError(f"{path}: no feature columns left besides the target {target!r}")
    groups = [ArrayChoice("x", tuple(features), "features")]
    if target is not None:
        groups.append(ArrayChoice("y", (target,), "targets"))
    return groups


def _named_groups(path: Path, columns: list[str], options: SourceOptions
                  ) -> list[ArrayChoice]:
    """The column groups ``arrays=`` choose (``image=a,b,c``), each an array of its own."""
    if options.features or options.target is not None:
        raise SourceError("give either arrays= (--array) or features=/target= "
                          "(--features/--target), not both")
    return resolve_choices(options.arrays or [], columns, where=str(path), what="column",
                           one_each=False)


def _spec(group: ArrayChoice, df: dd.DataFrame, non_numeric: list[str], integers: set[str]
          ) -> ArraySpec:
    """Features are a vector per sample, even of one column; a target (or other) group of
    one column is a scalar per sample, of several a vector. Integer columns and encoded
    categories are labels (int64) where the role keeps integers; anything else float32."""
    if group.role == "features":
        return ArraySpec("features", np.dtype("float32"), (len(group.sources),))
    is_label = all(c in non_numeric or c in integers
                   or pd.api.types.is_integer_dtype(df[c].dtype) for c in group.sources)
    dtype = stored_dtype(group.role, np.dtype("int64") if is_label else np.dtype("float64"))
    return ArraySpec(group.role, dtype,
                     () if len(group.sources) == 1 else (len(group.sources),))


@register_suffix(".csv", ".parquet", ".pq")
def _tabular_source(source: str, options: SourceOptions) -> TabularSource:
    return TabularSource(source, options)
