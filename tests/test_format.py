"""Pure parts of the format: sizes, chunking, split plans and mergeable statistics."""

from __future__ import annotations

import numpy as np
import pytest

from dasktrain.datasets.format import chunk_rows_for, parse_size
from dasktrain.datasets.splits import SplitPlan, parse_splits
from dasktrain.datasets.stats import Moments, merge_all, summary_of


@pytest.mark.parametrize(("text", "expected"), [("4MiB", 4 * 2**20), ("8 MB", 8_000_000),
                                                ("1024", 1024), (512, 512), ("1.5KiB", 1536)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "0", "4 parsecs"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_chunk_rows_for_targets_bytes():
    assert chunk_rows_for(32 * 4 + 8, 8192 * (32 * 4 + 8)) == 8192
    assert chunk_rows_for(10**9, 4) == 1


@pytest.mark.parametrize(("spec", "message"), [
    ("train=0.9,val=0.2", "sum to"), ("train", "cannot read"), ("train=x", "not a number"),
    ("train=0.5,train=0.5", "twice"), ("train=1.5", r"\(0, 1\]"), ("my split=1", "plain name"),
])
def test_parse_splits_refuses(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_splits(spec)


@pytest.mark.parametrize("n", [1, 7, 65_535, 65_537, 200_001])
def test_split_plan_exact_sizes_and_chunking_independent(n):
    fractions = parse_splits("train=0.7,val=0.2,test=0.1")
    plan = SplitPlan.make(fractions, n, seed=3)
    whole = plan.assign(0, n)
    counts = np.bincount(whole, minlength=3)
    assert counts.sum() == n
    assert dict(zip(plan.names, counts.tolist(), strict=True)) == plan.sizes
    for name, frac in fractions.items():
        assert abs(plan.sizes[name] - frac * n) < 1
    # Any row range, from the slice of the plan a task is given, agrees with the whole.
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 1))
        assert np.array_equal(plan.slice_for(a, b).assign(a, b), whole[a:b])


def test_split_plan_depends_on_seed():
    fractions = {"train": 0.5, "val": 0.5}
    a = SplitPlan.make(fractions, 1000, seed=0).assign(0, 1000)
    assert np.array_equal(a, SplitPlan.make(fractions, 1000, seed=0).assign(0, 1000))
    assert not np.array_equal(a, SplitPlan.make(fractions, 1000, seed=1).assign(0, 1000))


def test_statistics_merge_equals_numpy():
    rng = np.random.default_rng(0)
    data = rng.standard_normal((1000, 3)) * [1, 10, 100] + [5, -5, 1e4]
    parts = [summary_of(data[a:b]) for a, b in [(0, 1), (1, 400), (400, 400), (400, 1000)]]
    merged = merge_all(parts)
    assert merged.count == 1000
    np.testing.assert_allclose(merged.mean, data.mean(0), rtol=1e-12)
    np.testing.assert_allclose(merged.std, data.std(0), rtol=1e-10)
    np.testing.assert_array_equal(merged.minimum, data.min(0))
    np.testing.assert_array_equal(merged.maximum, data.max(0))


@pytest.mark.parametrize("shape", [(1,), (3, 5), (517, 3), (30_841, 32), (700, 8, 8), (9, 600)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_moments_of_one_block_equal_numpy_in_float64(shape, dtype):
    # Far from zero, where a one-pass sum of squares would lose the variance.
    data = (np.random.default_rng(1).standard_normal(shape) * 5 + 1e4).astype(dtype)
    found = Moments.of(data)
    exact = data.reshape(len(data), -1).astype(np.float64)
    assert found.count == len(data) and found.mean.shape == data.shape[1:]
    np.testing.assert_allclose(found.mean.ravel(), exact.mean(0), rtol=1e-13)
    np.testing.assert_allclose(found.std.ravel(), exact.std(0), rtol=1e-9)
    np.testing.assert_array_equal(found.minimum.ravel(), exact.min(0))
    np.testing.assert_array_equal(found.maximum.ravel(), exact.max(0))
    assert found.finite


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_moments_tell_whether_every_value_is_finite(bad):
    data = np.random.default_rng(2).standard_normal((1000, 4)).astype(np.float32)
    data[[3, 4], 2] = np.finfo(np.float32).max  # large but finite: the float64 sum holds it
    assert Moments.of(data).finite
    data[777, 1] = bad
    assert not Moments.of(data).finite


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int16, np.int32, np.uint32])
def test_pooled_moments_of_token_ids_merge_to_those_of_all_values(dtype):
    # Token ids: one feature over every value, whatever the position; 8/16-bit ids take
    # integer sums, wider ones the float path, and both must give numpy's figures.
    info = np.iinfo(dtype)
    data = np.random.default_rng(3).integers(info.min, info.max, (600, 16), endpoint=True,
                                             dtype=dtype)
    parts = [summary_of(data[a:b], pooled=True) for a, b in [(0, 1), (1, 250), (250, 600)]]
    merged = merge_all(parts)
    exact = data.astype(np.float64).ravel()
    assert merged.pooled and merged.count == exact.size and merged.mean.shape == (1,)
    np.testing.assert_allclose(merged.mean, [exact.mean()], rtol=1e-12)
    np.testing.assert_allclose(merged.std, [exact.std()], rtol=1e-10)
    assert merged.to_json()["min"] == [exact.min()] and merged.to_json()["max"] == [exact.max()]
    assert merged.to_json()["pooled"] is True


def test_class_counts_merge():
    labels = np.array([0, 2, 2, 5, 1, 0])
    merged = merge_all([summary_of(labels[:2]), summary_of(labels[2:])])
    assert merged.to_json()["class_counts"] == np.bincount(labels).tolist()
