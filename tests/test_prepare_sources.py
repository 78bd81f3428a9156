"""Round trips: every source through prepare() on a real cluster into Zarr on disk, and back."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import dasktrain as dt
from dasktrain.datasets.sources.synthetic import SyntheticSource
from tests.common.builders import write_npy_pair, write_table


def _load(ds: dt.Dataset) -> tuple[np.ndarray, np.ndarray | None]:
    y = ds.y
    return ds.x.compute(), None if y is None else y.compute()


def _prepare(client, source, out, **options) -> dt.Dataset:
    ds = dt.prepare(source, out, client=client, progress=False, **options)
    report = dt.verify(ds, client=client, progress=False)
    assert report.ok, report.problems
    return ds


def test_npy_round_trip_many_chunks(client, tmp_path):
    xp, yp, x, y = write_npy_pair(tmp_path, rows=1003, width=5)
    ds = _prepare(client, xp, tmp_path / "out.zarr", target=str(yp), chunk_rows=100)
    gx, gy = _load(ds)
    np.testing.assert_array_equal(gx, x)
    np.testing.assert_array_equal(gy, y)
    assert ds.zarr_array("x").chunks == (100, 5)
    assert len(ds) == 1003 and ds.attrs["chunk_rows"] == 100
    assert ds.attrs["arrays"]["y"] == {"role": "targets", "dtype": "int64", "shape": [1003]}
    np.testing.assert_allclose(ds.attrs["stats"]["x"]["mean"], x.mean(0), rtol=1e-5, atol=1e-6)
    assert ds.attrs["stats"]["y"]["class_counts"] == np.bincount(y).tolist()


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_round_trip(client, tmp_path, compressed):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((300, 2, 3)).astype(np.float64)
    y = rng.standard_normal(300)
    (np.savez_compressed if compressed else np.savez)(tmp_path / "d.npz", features=x, labels=y)
    ds = _prepare(client, tmp_path / "d.npz", tmp_path / "out.zarr", chunk_rows=64)
    gx, gy = _load(ds)
    np.testing.assert_array_equal(gx, x.astype(np.float32))
    np.testing.assert_array_equal(gy, y.astype(np.float32))
    assert ds.attrs["provenance"]["source_details"]["features"] == "features"
    # The inflated copy of a compressed member is scratch, gone after the build.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "out.zarr"]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_table_round_trip(client, tmp_path, suffix):
    df = write_table(tmp_path / f"t{suffix}", rows=500)
    ds = _prepare(client, tmp_path / f"t{suffix}", tmp_path / "out.zarr", target="label",
                  features="a,c", chunk_rows=128)
    gx, gy = _load(ds)
    np.testing.assert_allclose(gx, df[["a", "c"]].to_numpy(np.float32))
    np.testing.assert_array_equal(gy, df["label"].to_numpy())
    assert gy.dtype == np.int64


def test_directory_of_csv_files_in_order(client, tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    frames = [write_table(folder / f"part-{i}.csv", rows=150, seed=i) for i in range(3)]
    ds = _prepare(client, folder, tmp_path / "out.zarr", target="label", chunk_rows=64)
    whole = pd.concat(frames)
    gx, gy = _load(ds)
    np.testing.assert_allclose(gx, whole[["a", "b", "c"]].to_numpy(np.float32))
    np.testing.assert_array_equal(gy, whole["label"].to_numpy())


def test_categorical_columns_encoded_when_asked(client, tmp_path):
    df = pd.DataFrame({"size": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                       "colour": ["red", "blue", "red", None, "green", "blue"],
                       "kind": ["cat", "dog", "dog", "cat", "bird", "cat"]})
    df.to_csv(tmp_path / "t.csv", index=False)
    ds = _prepare(client, tmp_path / "t.csv", tmp_path / "out.zarr", target="kind",
                  encode_categorical=True)
    gx, gy = _load(ds)
    # The row with a missing colour is dropped; codes follow sorted distinct values.
    np.testing.assert_array_equal(gx[:, 0], [1, 2, 3, 5, 6])
    np.testing.assert_array_equal(gx[:, 1], [2, 0, 2, 1, 0])
    assert ds.attrs["labels"]["y"] == ["bird", "cat", "dog"]
    np.testing.assert_array_equal(gy, [1, 2, 2, 0, 1])
    assert ds.attrs["provenance"]["source_details"]["rows_dropped_missing"] == 1


def test_digits(client, tmp_path):
    from sklearn.datasets import load_digits

    ds = _prepare(client, "digits", tmp_path / "digits.zarr")
    gx, gy = _load(ds)
    bunch = load_digits()
    np.testing.assert_array_equal(gx, bunch.data.astype(np.float32))
    np.testing.assert_array_equal(gy, bunch.target)
    assert ds.attrs["labels"]["y"] == [str(i) for i in range(10)]


def test_parabola_is_y_equals_x_squared(client, tmp_path):
    ds = _prepare(client, "parabola", tmp_path / "p.zarr")
    gx, gy = _load(ds)
    assert gx.shape == (50, 1) and gy.shape == (50, 1)
    np.testing.assert_allclose(gx[:, 0], np.linspace(-1, 1, 50), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gy, gx**2, rtol=1e-6)


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_synthetic_independent_of_chunking(client, tmp_path, kind):
    a = _prepare(client, kind, tmp_path / "a.zarr", samples=9000, width=4, chunk_rows=1000)
    b = _prepare(client, kind, tmp_path / "b.zarr", samples=9000, width=4, chunk_rows=4500)
    ax, ay = _load(a)
    bx, by = _load(b)
    np.testing.assert_array_equal(ax, bx)
    np.testing.assert_array_equal(ay, by)
    c = _prepare(client, kind, tmp_path / "c.zarr", samples=9000, width=4, seed=1)
    assert not np.array_equal(_load(c)[0], ax)
    if kind == "classification":
        assert ay.dtype == np.int64 and set(np.unique(ay)) == {0, 1}


def test_splits_exact_disjoint_and_deterministic(client, tmp_path):
    xp, yp, x, _y = write_npy_pair(tmp_path, rows=1000, width=3)
    spec = "train=0.7,val=0.2,test=0.1"
    ds = _prepare(client, xp, tmp_path / "s.zarr", target=str(yp), split=spec, seed=5,
                  chunk_rows=64)
    assert ds.splits == {"train": (0, 700), "val": (700, 900), "test": (900, 1000)}
    rows = {tuple(r) for r in x.tolist()}
    seen = []
    for name in ("train", "val", "test"):
        part = ds.split(name)
        seen.extend(tuple(r) for r in part.x.compute().tolist())
    assert len(seen) == 1000 and set(seen) == rows  # every sample once, in exactly one split
    again = _prepare(client, xp, tmp_path / "s2.zarr", target=str(yp), split=spec, seed=5,
                     chunk_rows=300)
    np.testing.assert_array_equal(again.x.compute(), ds.x.compute())
    other = _prepare(client, xp, tmp_path / "s3.zarr", target=str(yp), split=spec, seed=6)
    assert not np.array_equal(other.split("val").x.compute(), ds.split("val").x.compute())
    with pytest.raises(KeyError, match="no split 'holdout'"):
        ds.split("holdout")


def test_normalize_fits_on_train_only(client, tmp_path):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2000, 4)) * [1, 5, 0.1, 0] + [3, -2, 100, 7]).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    ds = _prepare(client, tmp_path / "x.npy", tmp_path / "n.zarr", normalize=True,
                  split="train=0.75,val=0.25", chunk_rows=256)
    train = ds.split("train").x.compute()
    np.testing.assert_allclose(train.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(train.std(0)[:3], 1, rtol=1e-4)
    assert np.all(train[:, 3] == 0)  # a constant feature is centred, not divided by zero
    norm = ds.attrs["normalization"]["x"]
    assert norm["fitted_on"] == "train" and norm["count"] == 1500
    raw_train = x[np.isin(x[:, 0], train[:, 0] * norm["std"][0] + norm["mean"][0])]
    assert len(raw_train) <= 1500


def test_nonfinite_rows_are_dropped_and_counted(client, tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    x[[3, 11], 1] = np.nan
    x[7, 0] = np.inf
    np.save(tmp_path / "x.npy", x)
    ds = _prepare(client, tmp_path / "x.npy", tmp_path / "f.zarr", chunk_rows=4)
    keep = np.isfinite(x).all(axis=1)
    np.testing.assert_array_equal(ds.x.compute(), x[keep])
    assert ds.attrs["rows_dropped_nonfinite"] == 3


def test_open_dataset_through_url(client, tmp_path):
    ds = _prepare(client, "parabola", tmp_path / "p.zarr")
    via_url = dt.open_dataset(f"file://{tmp_path / 'p.zarr'}")
    np.testing.assert_array_equal(via_url.x.compute(), ds.x.compute())


def test_generator_rows_match_recipe():
    from dasktrain.datasets.sources import SourceOptions

    src = SyntheticSource("regression", SourceOptions(samples=10_000, width=3, seed=4))
    whole = src.to_dask(10_000)["x"].compute()
    parts = src.to_dask(777)["x"].compute()
    np.testing.assert_array_equal(whole, parts)
