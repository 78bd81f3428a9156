"""The one-pass build: chunks grouped into tasks, exact statistics taken while writing, and
the NaN/inf check that sends a source to the cleaning build."""

from __future__ import annotations

import numpy as np
import pytest

import dasktrain as dt
from dasktrain.datasets.prepare import plan_tasks
from tests.common.builders import write_table


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 13, 49, 100, 1000])
@pytest.mark.parametrize("parallelism", [1, 2, 3, 8])
@pytest.mark.parametrize("chunk_bytes", [1, 2**20, 4 * 2**20, 64 * 2**20])
def test_task_plan_covers_every_chunk_once_in_balanced_groups(num_chunks, parallelism,
                                                              chunk_bytes):
    task_bytes = 32 * 2**20
    groups = plan_tasks(num_chunks, chunk_bytes, parallelism, task_bytes)
    assert [c for g in groups for c in g] == list(range(num_chunks))  # in order, once each
    sizes = [len(g) for g in groups]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    # Every slot gets work while there are chunks enough, and none waits for a last task.
    assert len(groups) == num_chunks or len(groups) % parallelism == 0
    assert len(groups) >= min(num_chunks, parallelism)
    # About task_bytes each: never more than that (unless one chunk is bigger), and no more
    # tasks than the balancing needs.
    per_task = max(1, task_bytes // chunk_bytes)
    assert max(sizes) <= per_task
    assert len(groups) < -(-num_chunks // per_task) + parallelism


def test_plan_of_nothing_is_empty():
    assert plan_tasks(0, 2**20, 2) == []


def test_statistics_taken_while_writing_equal_numpy_exactly(client, tmp_path):
    # Far from zero, where a sum of squares in one pass would lose the variance; 37 chunks
    # of uneven last size, grouped several to a task.
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3_001, 6)) * [1e-3, 1, 10, 1e3, 1, 1] + [1e4, 0, -5, 7, 1e6, 0]
         ).astype(np.float32)
    y = rng.integers(0, 7, size=len(x))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    ds = dt.prepare(tmp_path / "x.npy", tmp_path / "d.zarr", client=client, progress=False,
                    target=str(tmp_path / "y.npy"), chunk_rows=82)
    assert ds.attrs["rows_dropped_nonfinite"] == 0 and ds.attrs["splits"] == {}
    exact = x.astype(np.float64)
    stats = ds.attrs["stats"]
    assert stats["x"]["count"] == len(x)
    np.testing.assert_allclose(stats["x"]["mean"], exact.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats["x"]["std"], exact.std(0), rtol=1e-9)
    np.testing.assert_array_equal(stats["x"]["min"], exact.min(0))
    np.testing.assert_array_equal(stats["x"]["max"], exact.max(0))
    assert stats["y"]["class_counts"] == np.bincount(y).tolist()
    np.testing.assert_array_equal(ds.x.compute(), x)
    assert dt.verify(ds, client=client, progress=False).ok


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_value_in_a_late_chunk_of_a_task_sends_the_build_to_cleaning(
        client, tmp_path, bad):
    x = np.arange(2_000, dtype=np.float32).reshape(1_000, 2)
    x[997, 1] = bad  # the last chunk of the last task
    np.save(tmp_path / "x.npy", x)
    ds = dt.prepare(tmp_path / "x.npy", tmp_path / "d.zarr", client=client, progress=False,
                    chunk_rows=10)
    keep = np.ones(len(x), dtype=bool)
    keep[997] = False
    np.testing.assert_array_equal(ds.x.compute(), x[keep])
    assert ds.attrs["rows_dropped_nonfinite"] == 1
    np.testing.assert_allclose(ds.attrs["stats"]["x"]["mean"], x[keep].astype(np.float64).mean(0),
                               rtol=1e-12)
    assert sorted(ds.group.array_keys()) == ["x"]
    assert dt.verify(ds, client=client, progress=False).ok


def test_a_table_read_through_dask_is_grouped_the_same(client, tmp_path):
    # Tables have no block reader: a task gets the blocks of all its chunks from Dask.
    df = write_table(tmp_path / "t.csv", rows=503)
    ds = dt.prepare(tmp_path / "t.csv", tmp_path / "t.zarr", client=client, progress=False,
                    target="label", chunk_rows=20)
    np.testing.assert_allclose(ds.x.compute(), df[["a", "b", "c"]].to_numpy(np.float32))
    np.testing.assert_array_equal(ds.y.compute(), df["label"].to_numpy())
    assert dt.verify(ds, client=client, progress=False).ok
