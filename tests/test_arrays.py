"""Arrays read in place (``dt.open_arrays``): windows over named dimensions of a real Zarr
store, an in-memory xarray Dataset and dask arrays, through the real pipeline and trainer
on a real cluster."""

from __future__ import annotations

import collections
import json
import shutil
import threading
import time

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr

import dasktrain as dt
from tests.common.object_storage import s3_server  # noqa: F401  (the s3 fixture)
from tests.common.training import mse

T, LEVELS, LAT, LON = 40, 2, 12, 20
WINDOW = {"lat": 4, "lon": 5}


def _field(seed: int = 0) -> xr.Dataset:
    """A small reanalysis-shaped dataset; ``cell`` says where each value lies (time, lat,
    lon), so that a window's first value names its sample."""
    rng = np.random.default_rng(seed)
    cell = np.arange(T * LAT * LON, dtype=np.int64).reshape(T, LAT, LON)
    return xr.Dataset(
        {"t": (("time", "level", "lat", "lon"),
               rng.standard_normal((T, LEVELS, LAT, LON)).astype(np.float32)),
         "u": (("time", "lat", "lon"), rng.standard_normal((T, LAT, LON)).astype(np.float32)),
         "cell": (("time", "lat", "lon"), cell),
         "land": (("lat", "lon"), (rng.random((LAT, LON)) > 0.5).astype(np.float32))},
        coords={"time": pd.date_range("2017-12-01", periods=T, freq="D"),
                "lat": np.linspace(60, -60, LAT), "lon": np.arange(LON) * 2.0})


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """The field in a Zarr store chunked along time (7 steps a chunk), read-only after."""
    path = str(tmp_path_factory.mktemp("arrays") / "field.zarr")
    data = _field()
    data.to_zarr(path, mode="w", consolidated=False,
                 encoding={name: {"chunks": (7, *data[name].shape[1:])}
                           for name in ("t", "u", "cell")})
    return path


def _windows_by_hand(data: xr.Dataset, steps: int, lead: int, stride: dict[str, int]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's stacked inputs (t's steps and levels, u's steps, land) and target (t
    at the last step + lead), time-major, windows row-major: what the docs promise."""
    t, u, land = data.t.values, data.u.values, data.land.values
    xs, ys = [], []
    for first in range(T - steps - lead + 1):
        for y0 in range(0, LAT - WINDOW["lat"] + 1, stride["lat"]):
            for x0 in range(0, LON - WINDOW["lon"] + 1, stride["lon"]):
                win = (slice(y0, y0 + WINDOW["lat"]), slice(x0, x0 + WINDOW["lon"]))
                inputs = [t[first:first + steps].reshape(-1, *t.shape[2:])[(..., *win)],
                          u[first:first + steps][(..., *win)], land[win][None]]
                xs.append(np.concatenate(inputs))
                ys.append(t[first + steps - 1 + lead][(..., *win)])
    return np.stack(xs), np.stack(ys)


def _stacked(source, **options) -> dt.ArrayDataset:
    return dt.open_arrays(source, window=WINDOW, inputs=["t", "u"], static=["land"],
                          targets=["t"], input_steps=2, lead=1, stack=True, **options)


def _cells(source, **options) -> dt.ArrayDataset:
    """Samples named by their first cell: input ``cell``, target ``cell`` one step on."""
    return dt.open_arrays(source, window=WINDOW, inputs=["cell"], targets=["cell"], lead=1,
                          stack=True, **options)


def _ids(pipe: dt.Pipeline) -> list[np.ndarray]:
    return [x[:, 0, 0, 0].numpy() for x, _ in pipe]


# -- the samples -------------------------------------------------------------------------
@pytest.mark.parametrize("stride", [WINDOW, {"lat": 2, "lon": 3}], ids=["tiled", "overlap"])
def test_every_sample_is_the_window_the_docs_describe(store, stride):
    ds = _stacked(store, stride=stride)
    want_x, want_y = _windows_by_hand(_field(), steps=2, lead=1, stride=stride)
    assert len(ds) == len(want_x)
    # Blocks of two chunks of 7 steps: a sample also reads the step after its own.
    assert ds.chunk_rows == 14 * ds.geometry.per_step
    np.testing.assert_array_equal(ds.zarr_array("x")[0:len(ds)], want_x)
    np.testing.assert_array_equal(ds.zarr_array("y")[0:len(ds)], want_y)
    # Any range reads the same samples as the whole, across chunk boundaries.
    np.testing.assert_array_equal(ds.zarr_array("x")[37:151], want_x[37:151])
    # Written to rows given in any order (a shuffled group's places, as the pipeline
    # reads), each sample lands in its row, the steps cut at either end included.
    rows = np.random.default_rng(0).permutation(151 - 37)
    out = np.full((len(rows), *want_x.shape[1:]), np.nan, dtype=np.float32)
    ds.zarr_array("x").read_into(out, 37, 151, rows)
    np.testing.assert_array_equal(out[rows], want_x[37:151])


def test_a_store_a_dataset_in_memory_and_dask_arrays_give_the_same_samples(store):
    data = _field()
    from_store = _stacked(store).zarr_array("x")[0:200]
    in_memory = _stacked(data).zarr_array("x")[0:200]
    arrays = {n: da.from_array(data[n].values, chunks=5) for n in ("t", "u", "land")}
    dims = {n: data[n].dims for n in arrays}
    from_dask = _stacked(arrays, dims=dims).zarr_array("x")[0:200]
    np.testing.assert_array_equal(in_memory, from_store)
    np.testing.assert_array_equal(from_dask, from_store)


def test_unstacked_arrays_are_one_per_variable_and_a_target_input_gets_its_own_name(store):
    ds = dt.open_arrays(store, window=WINDOW, inputs=["t", "u"], static=["land"],
                        targets=["t"], input_steps=3, lead=2)
    assert ds.roles == {"t": "features", "u": "features", "land": "features",
                        "t_target": "targets"}
    assert ds.zarr_array("t").shape[1:] == (3, LEVELS, 4, 5)
    assert ds.zarr_array("u").shape[1:] == (3, 4, 5)
    assert ds.zarr_array("t_target").shape[1:] == (LEVELS, 4, 5)
    # The first sample: inputs at steps 0..2, target at 2 + 2.
    data = _field()
    np.testing.assert_array_equal(ds.zarr_array("t_target")[0:1][0],
                                  data.t.values[4, :, :4, :5])
    np.testing.assert_array_equal(ds.zarr_array("u")[0:1][0], data.u.values[0:3, :4, :5])


def test_in_place_batches_equal_prepared_batches_bit_for_bit(client, store, tmp_path):
    ds = _stacked(store)
    x, y = _windows_by_hand(_field(), steps=2, lead=1, stride=WINDOW)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    prepared = dt.prepare(tmp_path / "x.npy", tmp_path / "copy.zarr", client=client,
                          target=str(tmp_path / "y.npy"), chunk_rows=50, progress=False)
    common = {"batch_size": 16, "seed": 3, "block_rows": ds.chunk_rows, "shuffle_blocks": 2,
              "client": client}
    for (xa, ya), (xb, yb) in zip(dt.Pipeline(ds, **common), dt.Pipeline(prepared, **common),
                                  strict=True):
        assert xa.dtype == xb.dtype == torch.float32
        np.testing.assert_array_equal(xa.numpy(), xb.numpy())
        np.testing.assert_array_equal(ya.numpy(), yb.numpy())


# -- exactly once --------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_window_once_an_epoch_whatever_the_world_size(client, store, world_size):
    ds = _cells(store)
    # The windows' first cells, by hand: each sample's time, lat and lon corner.
    want = sorted(t * LAT * LON + y0 * LON + x0 for t in range(T - 1)
                  for y0 in range(0, LAT - 3, 4) for x0 in range(0, LON - 4, 5))
    common = {"batch_size": 10, "seed": 5, "client": client}
    single = _ids(dt.Pipeline(ds, **common))
    ranks = [_ids(dt.Pipeline(ds, rank=r, world_size=world_size, **common))
             for r in range(world_size)]
    seen = np.concatenate([b for rank in ranks for b in rank])
    assert sorted(seen.tolist()) == want
    assert sorted(np.concatenate(single).tolist()) == want
    assert np.concatenate(single).tolist() != want  # shuffled


def test_a_pipeline_resumed_mid_epoch_yields_the_rest_of_the_epoch(client, store):
    ds = _cells(store)
    common = {"batch_size": 12, "seed": 9, "client": client}
    whole = _ids(dt.Pipeline(ds, **common))
    first = dt.Pipeline(ds, **common)
    it = iter(first)
    head = [next(it)[0][:, 0, 0, 0].numpy() for _ in range(7)]
    state = first.state_dict()
    del it
    again = dt.Pipeline(ds, **common)
    again.load_state_dict(state)
    rest = _ids(again)
    assert [b.tolist() for b in head + rest] == [b.tolist() for b in whole]


def _read_threads() -> set[threading.Thread]:
    """The pipelines' read threads alive in this process. A test counts those it started:
    an earlier test's pipeline left open keeps its idle readers until it is collected."""
    return {t for t in threading.enumerate() if t.name.startswith("dasktrain-read")}


def test_a_pipeline_closed_early_leaves_no_read_running_and_the_next_reads_every_window(
        client, store):
    ds = _cells(store)
    before = _read_threads()
    first = dt.Pipeline(ds, batch_size=8, seed=4, client=client, prefetch=8)
    next(iter(first))  # groups are read ahead of it, most not begun
    first.close()
    assert not _read_threads() - before
    # Reads that never ran were given up: a pipeline of the same epoch does not wait for
    # them, and serves every window once.
    ids = np.concatenate(_ids(dt.Pipeline(ds, batch_size=8, seed=4, client=client)))
    want = ds.zarr_array("x")[0:len(ds)][:, 0, 0, 0]
    assert sorted(ids.tolist()) == sorted(want.tolist())


def test_closing_while_groups_are_read_ahead_returns_promptly(client):
    """A slow store: when the first batch comes, the next groups are being read, one after
    another, and more wait their turn. Closing then lets the reads under way end, cancels
    the others, and leaves no read thread; it does not wait out a read's bound (minutes)."""
    data = _field()

    def slowly(block: np.ndarray) -> np.ndarray:
        time.sleep(0.05)  # a slow store: each chunk takes this long to come
        return block

    cell = da.from_array(data.cell.values, chunks=(7, LAT, LON)).map_blocks(slowly)
    ds = dt.open_arrays({"cell": cell}, dims={"cell": ("time", "lat", "lon")}, window=WINDOW,
                        inputs=["cell"], targets=["cell"], lead=1, stack=True)
    before = _read_threads()
    pipe = dt.Pipeline(ds, batch_size=8, seed=1, client=client, prefetch=8)
    next(iter(pipe))
    start = time.monotonic()
    pipe.close()
    assert time.monotonic() - start < 30
    assert not _read_threads() - before


class _Forecast(torch.nn.Module):
    """A tiny convolutional forecaster: 7 input channels to the 2 levels of ``t``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(7, 2, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _forecast() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Forecast()


def test_a_fit_claims_every_window_once_and_evaluate_and_predict_read_in_place(client,
                                                                                store):
    ds = _stacked(store, splits={"train": (None, "2017-12-31"), "val": ("2018-01-01", None)})
    train, val = ds.split("train"), ds.split("val")
    trainer = dt.Trainer(_forecast, mse, dt.optim.sgd(0.01), mode="async", workers=2,
                         batch_size=16, progress=False, torch_threads=1)
    history = trainer.fit(train, epochs=2, client=client, validation=val)
    assert [e["samples"] for e in history.epochs] == [len(train), len(train)]
    validated = history.epochs[-1]["validation"]["loss"]
    assert np.isfinite(validated)
    assert trainer.evaluate(val, client=client)["loss"] == pytest.approx(validated, rel=1e-5)
    predicted = trainer.predict(val, client=client)
    assert predicted.shape == (len(val), LEVELS, 4, 5)


# -- splits by coordinate ------------------------------------------------------------------
def test_a_split_holds_the_samples_whose_every_step_lies_in_its_range(store):
    ds = _cells(store, splits={"dec": (None, "2017-12-31"), "jan": ("2018-01-01",
                                                                  "2018-01-09")})
    per_step = ds.geometry.per_step
    # December: 31 days; a sample's input at day d and its target at d + 1 both in it.
    assert ds.splits["dec"] == (0, 30 * per_step)
    assert ds.splits["jan"] == (31 * per_step, 39 * per_step)
    jan = ds.split("jan")
    first = jan.zarr_array("x")[jan.start:jan.start + 1][0, 0, 0, 0]
    assert first == 31 * LAT * LON
    assert len(jan) == 8 * per_step


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"window": {"lat": 13, "lon": 5}}, "window of 13 along 'lat' is larger than the "
                                        "dimension, which has 12"),
    ({"inputs": ["t", "v"]}, "no variable 'v' in"),
    ({"window": {"lat": 4, "depth": 2}}, "no dimension 'depth'"),
    ({"static": ["u"]}, "variable 'u' of .* is given as static but has dimension 'time'"),
    ({"inputs": ["land"]}, "variable 'land' of .* is given as input but has no dimension "
                           "'time'"),
    ({"splits": {"val": ("2019-01-01", "2019-12-31")}}, "split 'val' .* selects no sample"),
    ({"splits": {"val": ("2018-01-05", "2018-01-05")}, "lead": 1}, r"spans 1 step\(s\), and "
                                                                 "a sample needs 2"),
    ({"lead": 40}, "'time' has 40 steps: too few for 1 input step"),
    ({"stride": {"level": 1}}, r"stride names dimension\(s\) \['level'\]"),
])
def test_bad_input_is_named(store, options, message):
    given = {"window": WINDOW, "inputs": ["t"], "targets": ["u"], **options}
    with pytest.raises(dt.DatasetError, match=message):
        dt.open_arrays(store, **given)


def test_a_coordinate_out_of_order_is_named():
    data = _field()
    shuffled = data.isel(time=[0, 2, 1, *range(3, T)])
    with pytest.raises(dt.DatasetError, match=r"coordinate 'time' .* is not increasing: "
                                              r".* at index 1"):
        dt.open_arrays(shuffled, window=WINDOW, inputs=["t"])


def test_arrays_without_dimension_names_or_a_store_that_is_not_there_are_named(tmp_path):
    with pytest.raises(dt.DatasetError, match="needs dims="):
        dt.open_arrays({"t": np.zeros((3, 4, 5))}, window=WINDOW, inputs=["t"])
    with pytest.raises(dt.DatasetError, match=r"no Zarr store at .*nothing there"):
        dt.open_arrays(tmp_path / "missing.zarr", window=WINDOW, inputs=["t"])


# -- normalization -------------------------------------------------------------------------
def test_statistics_come_from_the_training_steps_once_and_are_kept(client, store, tmp_path):
    path = tmp_path / "stats.json"
    options = {"splits": {"train": (None, "2017-12-31"), "val": ("2018-01-01", None)},
               "normalize": "train", "normalize_per": ["level"], "statistics_path": path}
    ds = _stacked(store, **options)
    t = _field().t.values.astype(np.float64)
    # The train split's samples read steps 0..30 (inputs from day 0, targets to day 30).
    mean, std = t[:31].mean(axis=(0, 2, 3)), t[:31].std(axis=(0, 2, 3))
    kept = json.loads(path.read_text())
    np.testing.assert_allclose(kept["statistics"]["t"][0], mean, rtol=1e-10)
    np.testing.assert_allclose(kept["statistics"]["t"][1], std, rtol=1e-10)
    want = (t[0, :, :4, :5] - mean[:, None, None]) / std[:, None, None]
    x = ds.zarr_array("x")[0:1][0]
    assert x.dtype == np.float32
    np.testing.assert_allclose(x[:LEVELS], want, rtol=1e-5, atol=1e-6)
    # Opened again: the kept file is read, not computed again (its numbers are used).
    kept["statistics"]["t"][0] = [1.0, 2.0]
    path.write_text(json.dumps(kept))
    again = _stacked(store, **options).zarr_array("x")[0:1][0]
    np.testing.assert_allclose(again[:LEVELS], (t[0, :, :4, :5] - [[[1.0]], [[2.0]]]) /
                               std[:, None, None], rtol=1e-5, atol=1e-6)
    # A file kept for other data is refused, not replaced.
    with pytest.raises(dt.DatasetError, match=r"were computed for .* remove the file"):
        _stacked(store, **{**options, "normalize_per": []})
    assert json.loads(path.read_text())["statistics"]["t"][0] == [1.0, 2.0]


def test_given_statistics_are_used_and_bad_ones_named(store):
    stats = {"t": (1.0, 2.0), "u": (0.0, 1.0), "land": (0.5, 0.5)}
    ds = _stacked(store, normalize=stats)
    t = _field().t.values
    np.testing.assert_allclose(ds.zarr_array("y")[0:1][0], (t[2, :, :4, :5] - 1.0) / 2.0,
                               rtol=1e-6)
    with pytest.raises(dt.DatasetError, match=r"normalize gives no .* for variable 'u'"):
        _stacked(store, normalize={"t": (0, 1), "land": (0, 1)})
    with pytest.raises(dt.DatasetError, match=r"normalize\['t'\]: .* std finite and > 0"):
        _stacked(store, normalize={**stats, "t": (0.0, 0.0)})
    with pytest.raises(dt.DatasetError, match="normalize='train' names no split"):
        _stacked(store, normalize="train")


# -- missing values ------------------------------------------------------------------------
def test_nan_is_named_where_it_is_filled_when_asked_and_counted(client, tmp_path):
    data = _field()
    data["u"][10, 5, 7] = np.nan
    data["u"][20, 0, 0] = np.nan
    path = str(tmp_path / "holes.zarr")
    data.to_zarr(path, mode="w", consolidated=False)
    ds = dt.open_arrays(path, window=WINDOW, inputs=["u"], targets=["t"], stack=True)
    assert ds.count_nan() == {"t": 0, "u": 2}
    per_step = ds.geometry.per_step
    with pytest.raises(dt.DatasetError, match=r"variable 'u' has 1 NaN value\(s\) in sample "
                                              r"\d+ at time index 10 \(lat 4:8, lon 5:10\)"):
        ds.zarr_array("x")[10 * per_step:11 * per_step]
    # Through the pipeline: the read fails with the same words, and nothing is delivered
    # as a success.
    with pytest.raises(dt.PipelineError, match="variable 'u' has 1 NaN"):
        for _ in dt.Pipeline(ds, batch_size=16, client=client):
            pass
    filled = dt.open_arrays(path, window=WINDOW, inputs=["u"], targets=["t"], stack=True,
                            nan="fill", fill_value=-9.0)
    x = filled.zarr_array("x")[10 * per_step:11 * per_step]
    assert np.count_nonzero(x == -9.0) == 1 and np.isfinite(x).all()


# -- object storage ------------------------------------------------------------------------
def test_a_store_on_s3_is_read_in_place_by_the_workers(client, s3, store):
    """The workers reach the bucket only through the storage options that travel with the
    tasks (they were started before the server)."""
    url = s3.url("field.zarr")
    data = _field()
    data.to_zarr(url, mode="w", consolidated=False, storage_options=s3.options,
                 encoding={name: {"chunks": (7, *data[name].shape[1:])}
                           for name in ("t", "u", "cell")})
    remote = _stacked(url, storage_options=s3.options,
                      splits={"train": (None, "2017-12-31")}, normalize="train")
    local = _stacked(store, splits={"train": (None, "2017-12-31")}, normalize="train")
    common = {"batch_size": 16, "seed": 4, "client": client}
    for (xa, ya), (xb, yb) in zip(dt.Pipeline(remote.split("train"), **common),
                                  dt.Pipeline(local.split("train"), **common), strict=True):
        np.testing.assert_array_equal(xa.numpy(), xb.numpy())
        np.testing.assert_array_equal(ya.numpy(), yb.numpy())


def test_verify_lists_the_chunks_missing_from_the_store(store, tmp_path):
    """Zarr reads a missing chunk as the fill value; verify names it instead."""
    copy = tmp_path / "holed.zarr"
    shutil.copytree(store, copy)
    (copy / "u" / "c" / "2" / "0" / "0").unlink()  # u's steps 14:21
    report = dt.verify(_stacked(str(copy)), progress=False)
    assert not report.ok
    assert report.problems == ["variable 'u' chunk (2, 0, 0) (time 14:21) is missing from "
                               "the store: Zarr reads it as the fill value np.float32(nan)"]
    assert dt.verify(_stacked(store), progress=False).ok
    in_memory = dt.verify(_stacked(_field()), progress=False)
    assert in_memory.ok and "no chunks to look for" in in_memory.notes[0]


# -- what is read ------------------------------------------------------------------------
_COMPUTED: collections.Counter = collections.Counter()


def _counted_block(block: np.ndarray, block_info=None) -> np.ndarray:
    """A chunk of the source, made when read, and counted (the pipeline reads in this
    process: a dataset without a transform is read by the consumer's threads)."""
    _COMPUTED[block_info[None]["chunk-location"]] += 1
    return block


def test_an_epoch_reads_each_chunk_at_most_twice_and_the_store_at_most_one_and_a_half_times(
        client):
    data = _field()
    arrays = {n: da.from_array(data[n].values, chunks=(7, -1, -1, -1)[:data[n].ndim])
              .map_blocks(_counted_block, dtype=data[n].dtype) for n in ("t", "u")}
    ds = dt.open_arrays(arrays, dims={n: data[n].dims for n in arrays}, window=WINDOW,
                        inputs=["t", "u"], targets=["t"], lead=1, stack=True)
    chunks = -(-T // 7)  # 6 chunks of up to 7 steps, per variable
    _COMPUTED.clear()
    scheduler = dask.config.get("scheduler", None)
    # One epoch's reads alone: no head start on the next one.
    seen = sum(len(x) for x, _ in dt.Pipeline(ds, batch_size=8, seed=2, client=client,
                                                prefetch_next_epoch=False))
    assert seen == len(ds)
    # Blocks of two chunks (a sample reads the step after its own): each block reads its
    # two and the first of the next; both variables, both arrays (x and y share t).
    assert max(_COMPUTED.values()) <= 2
    assert sum(_COMPUTED.values()) <= 1.5 * 2 * chunks, _COMPUTED
    # The read threads computed the chunks with a scheduler of their own: Dask's for
    # this process is as it was (a cluster's futures still compute).
    assert dask.config.get("scheduler", None) == scheduler
    assert client.submit(sum, [1, 2]).result() == 3
    assert da.ones(4, chunks=2).sum().compute() == 4
