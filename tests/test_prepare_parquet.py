"""Parquet read by the preparing tasks themselves (datasets/sources/parquet_rows.py): the
same rows as the table, whatever its files and row groups; missing values still dropped;
no dask.dataframe graph; and a worker's memory that does not grow with the table."""

from __future__ import annotations

import os
from pathlib import Path

import dask
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client, LocalCluster, get_task_stream

import dasktrain as dt
from dasktrain._memory import peak_resident

WIDTH = 6


def _table(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({f"f{j}": rng.standard_normal(rows).astype(np.float32)
                          for j in range(WIDTH)})
    frame["label"] = rng.integers(0, 5, rows)
    return frame


def _write(folder: Path, frames: list[pd.DataFrame], row_group: int) -> pd.DataFrame:
    """Files of ``frames`` in ``folder`` (names in the table's order), row groups of at
    most ``row_group`` rows; the whole table. A NaN stays a value (pandas' own conversion
    would store it as missing); pandas' missing values (``pd.NA``) are stored missing."""
    folder.mkdir()
    for k, frame in enumerate(frames):
        table = pa.table({c: pa.array(frame[c], from_pandas=isinstance(
            frame[c].dtype, pd.api.extensions.ExtensionDtype)) for c in frame.columns})
        pq.write_table(table, folder / f"part-{k:03d}.parquet", row_group_size=row_group)
    return pd.concat(frames, ignore_index=True)


def _prepare(client: Client, source: Path, out: Path, **options) -> dt.Dataset:
    ds = dt.prepare(source, out, client=client, progress=False, target="label", **options)
    assert dt.verify(ds, client=client, progress=False).ok
    return ds


@pytest.mark.parametrize(("row_group", "chunk_rows"), [(70, 128), (1_000, 96)])
def test_rows_across_files_and_row_groups_are_the_tables(client, tmp_path, row_group,
                                                         chunk_rows):
    # Row groups smaller than a chunk (a chunk gathers several, across files) and larger
    # (a task's chunks slice one); files of different lengths, one of a single row.
    frames = [_table(rows, seed) for seed, rows in enumerate([1_000, 1, 613, 2_050])]
    table = _write(tmp_path / "t", frames, row_group)
    with get_task_stream(client) as stream:
        ds = _prepare(client, tmp_path / "t", tmp_path / "out.zarr", chunk_rows=chunk_rows)
    np.testing.assert_array_equal(ds.x.compute(),
                                  table[[f"f{j}" for j in range(WIDTH)]].to_numpy())
    np.testing.assert_array_equal(ds.y.compute(), table["label"].to_numpy())
    assert ds.attrs["arrays"]["y"]["dtype"] == "int64"
    assert ds.attrs["stats"]["y"]["class_counts"] == np.bincount(table["label"]).tolist()
    assert ds.attrs["provenance"]["source_details"]["rows_dropped_missing"] == 0
    # The tasks read the files themselves: no frame, no rechunking, nothing read twice.
    prefixes = {str(task["key"]).split("-")[0].strip("('") for task in stream.data}
    assert not any("parquet" in p or "rechunk" in p or "dropna" in p for p in prefixes), \
        prefixes


def test_missing_values_are_still_dropped_and_nan_counted_as_non_finite(client, tmp_path):
    frame = _table(300, 7)
    frame.loc[[3, 100], "f1"] = np.nan  # NaN is a value: the rows go as non-finite
    _write(tmp_path / "nan", [frame], 64)
    ds = _prepare(client, tmp_path / "nan", tmp_path / "nan.zarr", chunk_rows=50)
    assert len(ds) == 298 and ds.attrs["rows_dropped_nonfinite"] == 2
    np.testing.assert_array_equal(ds.y.compute(), frame["label"].drop([3, 100]).to_numpy())

    nulls = _table(300, 8).astype({"f2": "Float32"})
    nulls.loc[[0, 299], "f2"] = pd.NA  # missing: the footer counts them, the frame drops them
    _write(tmp_path / "null", [nulls], 64)
    ds = _prepare(client, tmp_path / "null", tmp_path / "null.zarr", chunk_rows=50)
    assert len(ds) == 298
    assert ds.attrs["provenance"]["source_details"]["rows_dropped_missing"] == 2
    np.testing.assert_array_equal(ds.y.compute(), nulls["label"].iloc[1:299].to_numpy())


@pytest.mark.timeout(300)
def test_a_table_larger_than_the_worker_prepares_in_the_memory_of_a_small_one(tmp_path):
    """One worker of 2 threads limited to 800 MiB prepares 64 files of 17 MB of Parquet
    (1.3x its limit) within the goal's 100 MB of its peak for 8 of them (~440 MiB, its
    modules ~185 of it; it rose ~75 MiB, its own peak, VmHWM): read
    through a frame, the chunks waiting for their writing task raised a worker's peak with
    the table (1.6 GB at 100 M rows), and paused this worker on the 8 files already."""
    rows, width = 250_000, 16
    rng = np.random.default_rng(0)
    one = pa.table({**{f"f{j}": rng.standard_normal(rows, dtype=np.float32)
                       for j in range(width)},
                    "label": rng.standard_normal(rows, dtype=np.float32)})
    for name, files in (("small", 8), ("large", 64)):
        (tmp_path / name).mkdir()
        for k in range(files):
            pq.write_table(one, tmp_path / name / f"part-{k:03d}.parquet")
    spawned = {"distributed.worker.multiprocessing-method": "spawn"}
    limit = 800 * 2**20
    with dask.config.set(spawned), \
            LocalCluster(n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1",
                         dashboard_address=None, memory_limit=limit) as cluster, \
            Client(cluster) as client:
        pid_before = client.run(os.getpid)
        dt.prepare(tmp_path / "small", tmp_path / "small.zarr", client=client,
                   progress=False, target="label")
        (small_peak,) = client.run(peak_resident).values()
        ds = dt.prepare(tmp_path / "large", tmp_path / "large.zarr", client=client,
                        progress=False, target="label")
        (large_peak,) = client.run(peak_resident).values()
        assert client.run(os.getpid) == pid_before  # never killed and restarted
    assert len(ds) == 64 * rows and ds.x.nbytes + ds.y.nbytes > 1.25 * limit
    assert large_peak - small_peak < 96 * 2**20, (small_peak / 2**20, large_peak / 2**20)


def test_a_column_of_another_type_in_one_file_is_read_as_its_array(client, tmp_path):
    # f0 of float64 in the first file, float32 in the second: a chunk spans both.
    first, second = _table(90, 1), _table(70, 2)
    first["f0"] = first["f0"].astype(np.float64)
    table = _write(tmp_path / "t", [first, second], 40)
    ds = _prepare(client, tmp_path / "t", tmp_path / "out.zarr", chunk_rows=64)
    np.testing.assert_array_equal(
        ds.x.compute(), table[[f"f{j}" for j in range(WIDTH)]].to_numpy(np.float32))
