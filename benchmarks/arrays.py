"""W12, windows from a store: training samples cut out of a Zarr store in place, against
the loaders people write by hand.

The store (generated into a scratch folder, removed after unless ``--keep``): ``--vars``
float32 variables on (time, level, lat, lon), ``--levels`` levels, ``--steps`` steps on a
``--lat`` x ``--lon`` grid (default 4 x 2 x 2,000 x 181 x 360: 4.2 GB), chunks of 24 steps
x the whole grid, zstd. Samples: patches of 64 x 64 (no overlap: 2 x 5 a step), the two
last steps of every variable and level in, the next step out; batches of 64.

Side by side, each a fresh loader's first batches, the first one included, the store's
files read once before (in the page cache, for every loader alike):

* **xbatcher** 0.4: ``BatchGenerator`` over the variables stacked into one DataArray (dask,
  the store's chunks) for the inputs and another for the targets, through
  ``xbatcher.loaders.torch.MapDataset`` and ``DataLoader(num_workers=2, shuffle=True)``:
  the recipe of xbatcher's documentation;
* **xarray + DataLoader**: a hand-written ``torch.utils.data.Dataset`` whose
  ``__getitem__`` reads one random window with ``isel`` from the store opened without dask
  (only the chunks it needs), through ``DataLoader(num_workers=2)``;
* **dasktrain**: ``dt.open_arrays`` + ``dt.Pipeline`` at their defaults, on a LocalCluster of
  2 single-threaded processes.

The baselines, which read a whole chunk of every variable for each sample, run their first
batches (``--baseline-batches``, default 5) with a consumer step of C = 0 (samples/s) and
C = 30 ms (stall: the share of the wall time spent waiting for a batch). dasktrain runs a
whole epoch at each C, a fresh pipeline each, the first batch included (the goals'
figures; at C = 30 ms the median of ``--repeats``, default 3); then the bytes its
processes read in one epoch of a run (``rchar`` of ``/proc/<pid>/io``: every read system
call, the store's files and the few messages the workers receive, and of this process,
where a pipeline without a transform reads; a pipeline's second epoch, as each epoch reads
the next one's first groups ahead) against the store's size; then, for comparison with
the baselines' short runs, its first ``--batches`` (default 40) at each C. Last, what the
copy it avoids costs: ``prepare`` of the same windows (time and bytes written), from a
numpy array of them.

Run: ``.venv/bin/python benchmarks/arrays.py`` (the store takes about a minute to write on 2
cores; ``--quick``: a 40-step store on a 96 x 192 grid, a few batches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import dask
import dask.array as da
import numpy as np
import pandas as pd
import psutil
import torch
import xarray as xr
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios

PATCH, BATCH, CHUNK, STEP_MS = 64, 64, 24, 30.0
QUICK = {"steps": 40, "lat": 96, "lon": 192, "batches": 8, "baseline_batches": 2,
         "repeats": 1}


# -- the store -----------------------------------------------------------------------------
def make_store(path: Path, variables: int, levels: int, steps: int, lat: int, lon: int
               ) -> int:
    """Write the store with Dask (chunks of 24 steps), return its size on disk in bytes."""
    from zarr.codecs import ZstdCodec

    names = [f"v{k}" for k in range(variables)]
    shape, chunks = (steps, levels, lat, lon), (CHUNK, levels, lat, lon)
    rng = da.random.default_rng(0)
    data = xr.Dataset(
        {n: (("time", "level", "lat", "lon"),
             rng.standard_normal(shape, chunks=chunks, dtype=np.float32)) for n in names},
        coords={"time": pd.date_range("2000-01-01", periods=steps, freq="6h"),
                "level": np.arange(levels), "lat": np.linspace(90, -90, lat),
                "lon": np.arange(lon) * (360 / lon)})
    with dask.config.set(scheduler="threads", num_workers=2):
        data.to_zarr(path, mode="w", consolidated=False,
                     encoding={n: {"chunks": chunks, "compressors": [ZstdCodec(level=1)]}
                               for n in names})
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warm(path: Path) -> None:
    """Read every file of the store once, so that each loader reads from the page cache:
    the figures are the loaders', not the disk's (a run after another's ``prepare`` of the
    copy, which writes twice the store, finds little of it cached)."""
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                while f.read(1 << 24):
                    pass


def variables_of(path: Path) -> list[str]:
    return sorted(xr.open_zarr(path, chunks=None, consolidated=False).data_vars)


# -- the loaders ---------------------------------------------------------------------------
def xbatcher_loader(path: Path) -> Iterable[Any]:
    import xbatcher
    from xbatcher.loaders.torch import MapDataset

    data = xr.open_zarr(path, consolidated=False)  # dask, the store's chunks
    stacked = data.to_array("variable").transpose("time", "variable", "level", "lat", "lon")
    steps = stacked.sizes["time"]
    window = {"lat": PATCH, "lon": PATCH}
    inputs = xbatcher.BatchGenerator(stacked.isel(time=slice(0, steps - 1)),
                                     input_dims={"time": 2, **window},
                                     input_overlap={"time": 1})
    targets = xbatcher.BatchGenerator(stacked.isel(time=slice(2, steps)),
                                      input_dims={"time": 1, **window})
    dataset = MapDataset(inputs, targets)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2,
                                       generator=torch.Generator().manual_seed(0))


class RandomWindows(torch.utils.data.Dataset):
    """What a user writes by hand: a random 64 x 64 window of two steps and the next one,
    read with ``isel`` from the store opened without dask."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: xr.Dataset | None = None
        opened = xr.open_zarr(path, chunks=None, consolidated=False)
        self.names = sorted(opened.data_vars)
        self.sizes = dict(opened.sizes)
        self.per_step = (self.sizes["lat"] // PATCH) * (self.sizes["lon"] // PATCH)

    def __len__(self) -> int:
        return (self.sizes["time"] - 2) * self.per_step

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data is None:  # opened in each loader process
            self.data = xr.open_zarr(self.path, chunks=None, consolidated=False)
        t, place = divmod(index, self.per_step)
        y0, x0 = divmod(place, self.sizes["lon"] // PATCH)
        where = {"lat": slice(y0 * PATCH, (y0 + 1) * PATCH),
                 "lon": slice(x0 * PATCH, (x0 + 1) * PATCH)}
        x = np.stack([self.data[n].isel(time=slice(t, t + 2), **where).values
                      for n in self.names])
        y = np.stack([self.data[n].isel(time=t + 2, **where).values for n in self.names])
        return torch.from_numpy(x.reshape(-1, PATCH, PATCH)), torch.from_numpy(
            y.reshape(-1, PATCH, PATCH))


def xarray_loader(path: Path) -> Iterable[Any]:
    return torch.utils.data.DataLoader(RandomWindows(path), batch_size=BATCH, shuffle=True,
                                       num_workers=2,
                                       generator=torch.Generator().manual_seed(0))


def in_place(path: Path) -> dt.ArrayDataset:
    names = variables_of(path)
    return dt.open_arrays(path, window={"lat": PATCH, "lon": PATCH}, inputs=names,
                          targets=names, input_steps=2, lead=1, stack=True)


# -- measuring -----------------------------------------------------------------------------
def timed(make: Callable[[], Iterable[Any]], batches: int, step_ms: float
          ) -> tuple[float, float, int, float]:
    """``(samples/s, stall, samples, seconds to the first batch)`` of a fresh loader's
    first ``batches`` batches (0: all of them), its construction and first batch included;
    the consumer sleeps ``step_ms`` after each batch, as a training step would take that
    long."""
    start = time.perf_counter()
    waited, samples, count, first = 0.0, 0, 0, 0.0
    loader = make()
    iterator = iter(loader)
    while batches == 0 or count < batches:
        asked = time.perf_counter()
        try:
            x, _ = next(iterator)
        except StopIteration:
            break
        waited += time.perf_counter() - asked
        first = first or time.perf_counter() - start
        samples += len(x)
        count += 1
        if step_ms:
            time.sleep(step_ms / 1000)
    wall = time.perf_counter() - start
    del iterator
    if hasattr(loader, "close"):  # a pipeline reads the next epoch's first units ahead
        loader.close()
    return samples / wall, waited / wall, samples, first


def epoch_reads(client: Client, make: Callable[[], dt.Pipeline]) -> int:
    """Bytes one epoch reads in a run of several: a pipeline's second epoch (its first
    read the second's first groups ahead, as its last batches went)."""
    pipeline = make()
    for _ in pipeline:
        pass
    before = reads(client)
    for _ in pipeline:
        pass
    read = reads(client) - before
    pipeline.close()
    return read


def reads(client: Client) -> int:
    """Bytes read so far (``rchar``) by the cluster's worker processes and this one (a
    pipeline without a transform reads in the consumer's process, in threads)."""
    here = psutil.Process().io_counters().read_chars
    return here + sum(client.run(lambda: psutil.Process().io_counters().read_chars).values())


def prepare_cost(ds: dt.ArrayDataset, client: Client, out: Path) -> tuple[float, int, float]:
    """``(seconds, bytes written, seconds to cut the windows)`` of writing every window
    of ``ds`` as a prepared dataset: the second copy that reading in place avoids."""
    cut = time.perf_counter()
    x = np.lib.format.open_memmap(out / "x.npy", mode="w+", dtype=np.float32,
                                  shape=ds.zarr_array("x").shape)
    y = np.lib.format.open_memmap(out / "y.npy", mode="w+", dtype=np.float32,
                                  shape=ds.zarr_array("y").shape)
    for a in range(0, len(ds), ds.chunk_rows):
        b = min(a + ds.chunk_rows, len(ds))
        x[a:b], y[a:b] = ds.zarr_array("x")[a:b], ds.zarr_array("y")[a:b]
    del x, y
    cut = time.perf_counter() - cut
    start = time.perf_counter()
    dt.prepare(out / "x.npy", out / "copy.zarr", client=client, target=str(out / "y.npy"),
               progress=False, overwrite=True)
    seconds = time.perf_counter() - start
    written = sum(f.stat().st_size for f in (out / "copy.zarr").rglob("*") if f.is_file())
    shutil.rmtree(out / "copy.zarr")  # only the store is worth keeping for a rerun
    for name in ("x.npy", "y.npy"):
        (out / name).unlink()
    return seconds, written, cut


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vars", type=int, default=4)
    parser.add_argument("--levels", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lat", type=int, default=181)
    parser.add_argument("--lon", type=int, default=360)
    parser.add_argument("--batches", type=int, default=40,
                        help="dasktrain's batches per C")
    parser.add_argument("--baseline-batches", type=int, default=5,
                        help="the baselines' batches per C (they read a chunk per sample)")
    parser.add_argument("--dir", help="scratch folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the store for a rerun")
    parser.add_argument("--repeats", type=int, default=3,
                        help="dasktrain's whole epochs at C = 30 ms (the median's stall)")
    parser.add_argument("--no-prepare", action="store_true", help="skip the copy's cost")
    args = parse_with_quick(parser, argv, QUICK, "a 40-step store, 8 batches: the plumbing")
    torch.set_num_threads(1)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="w12-"))
    scratch.mkdir(parents=True, exist_ok=True)
    store = scratch / "store.zarr"
    try:
        start = time.perf_counter()
        if store.exists():
            size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
        else:
            size = make_store(store, args.vars, args.levels, args.steps, args.lat, args.lon)
        warm(store)
        print(f"store: {args.vars} variables x {args.levels} levels x {args.steps} steps x "
              f"{args.lat} x {args.lon} float32, chunks of {CHUNK} steps, zstd: "
              f"{size / 1e9:.2f} GB on disk ({time.perf_counter() - start:.0f} s)")
        rows = run(store, size, args, scratch)
        if args.ratios_json:
            write_ratios(args.ratios_json, rows)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def run(store: Path, size: int, args: argparse.Namespace, scratch: Path) -> list[Ratio]:
    results: dict[tuple[str, float], tuple[float, float]] = {}
    loaders = {"xbatcher 0.4": lambda: xbatcher_loader(store),
               "xarray + DataLoader": lambda: xarray_loader(store)}
    for name, make in loaders.items():
        for step in (0.0, STEP_MS):
            rate, stall, _, _ = timed(make, args.baseline_batches, step)
            results[name, step] = rate, stall
            print(f"  {name:<22} C = {step:>4.0f} ms: {rate:8,.0f} samples/s, stall "
                  f"{100 * stall:5.1f} %", flush=True)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      **NO_DASHBOARD) as cluster, Client(cluster) as client:
        ds = in_place(store)
        client.run(lambda: __import__("dasktrain.pipeline.tasks"))  # not in the reads below
        # Whole epochs first, each a fresh pipeline, the first batch included.
        rate, stall, samples, first = timed(
            lambda: dt.Pipeline(in_place(store), batch_size=BATCH, seed=1, client=client),
            0, 0.0)
        results["dasktrain", 0.0] = rate, stall
        print(f"  dasktrain in place, one whole epoch: {samples:,} samples at "
              f"{rate:,.0f} samples/s (the first batch at {first:.2f} s)", flush=True)
        # Its stall is a few tenths of a second in ten: the median of --repeats epochs.
        paced = [timed(lambda seed=seed: dt.Pipeline(in_place(store), batch_size=BATCH,
                                                     seed=seed, client=client), 0, STEP_MS)
                 for seed in range(2, 2 + args.repeats)]
        rate, stall = statistics.median(r[0] for r in paced), statistics.median(r[1] for r in paced)
        results["dasktrain", STEP_MS] = rate, stall
        print(f"  dasktrain in place, one whole epoch at C = {STEP_MS:.0f} ms: "
              f"{rate:,.0f} samples/s, stall {100 * stall:.1f} % (median of {len(paced)}: "
              + ", ".join(f"{100 * r[1]:.1f} %" for r in paced) + "; the first batch at "
              + ", ".join(f"{r[3]:.2f}" for r in paced) + " s; the step alone allows "
              f"{1000 * BATCH / STEP_MS:,.0f} samples/s)", flush=True)
        read = epoch_reads(client, lambda: dt.Pipeline(in_place(store), batch_size=BATCH,
                                                       seed=3, client=client))
        print(f"  dasktrain in place, one epoch's reads: {read / 1e9:.2f} GB, "
              f"{read / size:.2f}x the store", flush=True)
        for step in (0.0, STEP_MS):
            rate, stall, _, _ = timed(lambda: dt.Pipeline(in_place(store), batch_size=BATCH,
                                                       client=client), args.batches, step)
            print(f"  dasktrain in place, first {args.batches} batches "
                  f"C = {step:>4.0f} ms: {rate:8,.0f} samples/s, stall {100 * stall:5.1f} %",
                  flush=True)
        sample_bytes = (ds.zarr_array("x").dtype.itemsize *
                        (np.prod(ds.zarr_array("x").shape) + np.prod(ds.zarr_array("y").shape)))
        if not args.no_prepare:
            seconds, written, cut = prepare_cost(ds, client, scratch)
            print(f"  the copy avoided: cutting the windows {cut:.0f} s, prepare {seconds:.0f} s"
                  f", {written / 1e9:.2f} GB written ({sample_bytes / 1e9:.2f} GB of samples,"
                  f" {written / size:.2f}x the store)")
    best = max(results["xbatcher 0.4", 0.0][0], results["xarray + DataLoader", 0.0][0])
    ours, ours_stall = results["dasktrain", 0.0][0], results["dasktrain", STEP_MS][1]
    return [
        Ratio(workload="W12 windows from a store, C = 0 (samples/s)", ours=f"{ours:,.0f}",
              baseline=f"{best:,.0f} (the better of xbatcher and xarray + DataLoader)",
              ratio=ratio_of(ours, best), goal="≥ 3x"),
        Ratio(workload="W12 stall, C = 30 ms", ours=f"{100 * ours_stall:.1f}%",
              baseline=f"{100 * results['xarray + DataLoader', STEP_MS][1]:.1f}% "
                       "(xarray + DataLoader)",
              ratio=ratio_of(ours_stall, results["xarray + DataLoader", STEP_MS][1]),
              goal="≤ 5 % stall"),
        Ratio(workload="W12 bytes read per epoch / store size", ours=f"{read / size:.2f}x",
              baseline="1.00x (the store once)", ratio=read / size, goal="≤ 1.5x"),
    ]


if __name__ == "__main__":
    main()
