"""What ``prepare`` says in its own words: a bad CSV cell as one line naming column, row and
fix; dropped rows and constant features as warnings, and in ``dasktrain info``."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

import dasktrain as dt
from dasktrain.datasets.cleaning import CleaningWarning
from tests.common.builders import assert_user_error, run_cli

#: Rows enough that a cell at row 15,000 lies beyond the first bytes dask infers types from.
ROWS = 20_000


def _table(rows: int = ROWS, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"a": rng.standard_normal(rows), "b": rng.standard_normal(rows),
                         "label": rng.integers(0, 3, rows)})


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    bad = _table().astype({"b": object})
    bad.loc[15_000, "b"] = "oops"
    bad.to_csv(d / "bad.csv", index=False)
    (d / "parts").mkdir()
    _table(seed=1).to_csv(d / "parts" / "1.csv", index=False)
    second = _table(seed=2).astype({"a": object})
    second.loc[12_345, "a"] = "n/a?"
    second.to_csv(d / "parts" / "2.csv", index=False)
    missing = _table().astype({"label": object})
    missing.loc[15_000, "label"] = None
    missing.to_csv(d / "missing.csv", index=False)
    rng = np.random.default_rng(3)
    dirty = pd.DataFrame({"a": rng.standard_normal(200), "const": 2.5,
                          "b": rng.standard_normal(200), "label": rng.integers(0, 3, 200)})
    dirty.loc[3, "a"] = np.inf
    dirty.loc[7, "b"] = -np.inf
    dirty.loc[11, "a"] = np.nan
    dirty.to_csv(d / "dirty.csv", index=False)
    return d


def test_a_text_cell_in_a_number_column_is_one_line_with_column_row_and_fix(tables, tmp_path):
    out = tmp_path / "out.zarr"
    result = run_cli("prepare", str(tables / "bad.csv"), str(out), "--target", "label",
                     "--no-progress")
    assert_user_error(result, f"{tables / 'bad.csv'}: column 'b'", "'oops'", "data row 15,001",
                      "--encode-categorical", "--features")
    assert not out.exists()


def test_a_text_cell_in_a_later_file_names_that_file_and_its_row(client, tables, tmp_path):
    with pytest.raises(dt.SourceError) as raised:
        dt.prepare(tables / "parts", tmp_path / "out.zarr", client=client, progress=False,
                   target="label")
    message = str(raised.value)
    assert message.startswith(f"{tables / 'parts' / '2.csv'}: column 'a' holds the "
                              "non-numeric value 'n/a?' at data row 12,346"), message
    assert "\n" not in message
    assert not (tmp_path / "out.zarr").exists()


def test_an_integer_column_with_a_missing_cell_far_down_is_read(client, tables, tmp_path):
    with pytest.warns(CleaningWarning, match="dropped 1 of 20,000 rows: 1 with a missing cell"):
        ds = dt.prepare(tables / "missing.csv", tmp_path / "out.zarr", client=client,
                        progress=False, target="label")
    assert len(ds) == ROWS - 1
    assert ds.y.dtype == np.int64  # still class labels
    expected = _table().drop(index=15_000)["label"].to_numpy()
    np.testing.assert_array_equal(ds.y.compute(), expected)


def test_dropped_rows_and_constant_features_are_warnings_and_shown_by_info(tables, tmp_path):
    out = tmp_path / "out.zarr"
    result = run_cli("prepare", str(tables / "dirty.csv"), str(out), "--target", "label",
                     "--normalize", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [
        "dasktrain prepare: warning: dropped 3 of 200 rows: 2 with NaN or infinite values, "
        "1 with a missing cell (counted in the dataset's attributes)",
        "dasktrain prepare: warning: normalize: 1 constant feature set to 0: 'const' in 'x' "
        "(constant on the whole dataset, where the mean and std were fitted)",
    ]
    info = run_cli("info", str(out))
    assert info.returncode == 0, info.stderr
    assert ("cleaning  dropped 3 of 200 rows: 2 with NaN or infinite values, 1 with a missing "
            "cell") in info.stdout.splitlines()
    assert "normalized x (fitted on all); 1 constant feature set to 0: 'const'" in info.stdout
    ds = dt.open_dataset(out)
    assert ds.attrs["normalization"]["x"]["constant"] == [1]
    assert not ds.x[:, 1].compute().any()


def test_normalize_names_constant_features_of_the_fitted_split(client, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1_000, 5)).astype(np.float32)
    x[:, 1] = 0.1  # constant everywhere: its std is rounding noise at best
    x[:, 3] = 7.0
    x[10:20, 2] = np.nan
    np.save(tmp_path / "x.npy", x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = dt.prepare(tmp_path / "x.npy", tmp_path / "out.zarr", client=client,
                        progress=False, normalize=True, split="train=0.8,val=0.2")
    messages = [str(w.message) for w in caught if issubclass(w.category, CleaningWarning)]
    assert messages == [
        "dropped 10 of 1,000 rows: 10 with NaN or infinite values (counted in the dataset's "
        "attributes)",
        "normalize: 2 constant features set to 0: 1, 3 in 'x' (constant on split 'train', "
        "where the mean and std were fitted)",
    ]
    assert ds.attrs["normalization"]["x"]["constant"] == [1, 3]
    assert not ds.x[:, [1, 3]].compute().any()
    assert "2 constant features set to 0: 1, 3" in dt.describe(ds)


def test_a_clean_preparation_warns_about_nothing(client, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dt.prepare("regression", tmp_path / "out.zarr", client=client, progress=False,
                   samples=500, width=3, normalize=True)
    assert [w for w in caught if issubclass(w.category, CleaningWarning)] == []


def test_constant_pixels_of_image_features_are_named_by_flat_index(client, tmp_path):
    rng = np.random.default_rng(1)
    images = rng.standard_normal((300, 2, 3)).astype(np.float32)
    images[:, 1, 0] = 0.0  # flat index 3: a border pixel that is always dark
    np.save(tmp_path / "images.npy", images)
    with pytest.warns(CleaningWarning, match=r"1 constant feature set to 0: 3 in 'x'"):
        ds = dt.prepare(tmp_path / "images.npy", tmp_path / "out.zarr", client=client,
                        progress=False, normalize=True)
    assert ds.attrs["normalization"]["x"]["constant"] == [3]
    stored = ds.x.compute()
    assert stored.shape == (300, 2, 3) and not stored[:, 1, 0].any()
    np.testing.assert_allclose(stored[:, 0, 0].std(), 1.0, rtol=1e-4)
