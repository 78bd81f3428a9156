"""Forecast the next step of a reanalysis-like field, trained from its Zarr store in place.

The script

1. generates an ERA5-like store (``--out``/era.zarr, unless it is there): four variables
   (``t``, ``z``, ``u``, ``v``) on (time, level, lat, lon), 6-hourly, with a climatology
   that depends on latitude, a seasonal and a diurnal cycle, and weather-like anomalies
   that drift east by two grid points a step and slowly decay while new ones grow, so the
   next step is predictable from the last two, but not equal to the last;
2. opens it with ``dt.open_arrays``: windows of 32 x 32 grid points, the last two steps of
   every variable and level as inputs, the next step as the target, split by date (the
   first 80 % of the steps train, the rest validate), normalized per variable and level
   with statistics computed once over the training steps with Dask and kept beside the
   store; nothing is copied;
3. trains a small convolutional network that predicts the change from the last step
   (``sync``, Adam, ``--workers`` replicas), and compares its validation error with
   persistence (the next step equals the last), the forecast to beat.

Run::

    .venv/bin/python examples/forecast.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import xarray as xr
from distributed import Client

import dasktrain as dt
from dasktrain._cluster import start_local_cluster

VARIABLES = ("t", "z", "u", "v")
LEVELS = (850, 500)
DRIFT = 2  # grid points east per step
WINDOW = 32


def generate(path: Path, steps: int, lat: int, lon: int, seed: int = 0) -> None:
    """Write the synthetic reanalysis (float32, chunks of 24 steps x the whole grid)."""
    rng = np.random.default_rng(seed)
    times = pd.date_range("2016-01-01", periods=steps, freq="6h")
    lats = np.linspace(80, -80, lat)
    lons = np.arange(lon) * (360 / lon)
    day = (times - times[0]).total_seconds().to_numpy() / 86400
    season = np.sin(2 * np.pi * day / 365.25)[:, None, None]
    hours = times.hour.to_numpy()[:, None, None] + lons[None, None, :] / 15
    diurnal = np.cos(2 * np.pi * hours / 24) * np.cos(np.radians(lats))[None, :, None]
    # Anomalies: last step's, carried east and decaying, plus fresh smooth noise.
    anomaly = np.zeros((steps, lat, lon), dtype=np.float64)
    field = np.zeros((lat, lon))
    ky = np.fft.fftfreq(lat)[:, None]
    kx = np.fft.fftfreq(lon)[None, :]
    smooth = np.exp(-(ky ** 2 + kx ** 2) / (2 * 0.04 ** 2))
    for k in range(steps):
        noise = np.fft.ifft2(np.fft.fft2(rng.standard_normal((lat, lon))) * smooth).real
        field = 0.97 * np.roll(field, DRIFT, axis=1) + 2.0 * noise
        anomaly[k] = field
    anomaly /= anomaly.std()
    base = np.cos(np.radians(lats))[None, :, None]
    data = {}
    for v, name in enumerate(VARIABLES):
        levels = []
        for j, _ in enumerate(LEVELS):
            scale = 1.0 + 0.5 * j + 0.2 * v
            values = (10 * base * (1 + 0.1 * v) + 3 * season * base + diurnal * (1 - 0.4 * j)
                      + scale * np.roll(anomaly, v * 3, axis=2))
            levels.append(values.astype(np.float32))
        data[name] = (("time", "level", "lat", "lon"), np.stack(levels, axis=1))
    store = xr.Dataset(data, coords={"time": times, "level": list(LEVELS), "lat": lats,
                                     "lon": lons})
    tmp = path.with_name(path.name + ".writing")
    store.to_zarr(tmp, mode="w", consolidated=False,
                  encoding={n: {"chunks": (24, len(LEVELS), lat, lon)} for n in VARIABLES})
    tmp.rename(path)


class Forecaster(torch.nn.Module):
    """The last step plus a learned change: two 3 x 3 convolutions with a GELU between,
    from the inputs' channels (variables x levels x 2 steps) to the target's."""

    def __init__(self, channels_in: int, channels_out: int, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.channels_out = channels_out
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(channels_in, hidden, 5, padding=2), torch.nn.GELU(),
            torch.nn.Conv2d(hidden, channels_out, 5, padding=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x.view(x.shape[0], -1, 2, *x.shape[2:])[:, :, 1]  # (variable, level) at t
        return last + self.net(x)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target.reshape(output.shape))


def persistence_mse(ds: dt.ArrayDataset) -> float:
    """Mean squared error of "the next step equals the last" over ``ds`` (normalized)."""
    x = ds.zarr_array("x")[ds.start:ds.stop]
    y = ds.zarr_array("y")[ds.start:ds.stop]
    last = x.reshape(len(x), -1, 2, *x.shape[2:])[:, :, 1]
    return float(np.mean((last - y.reshape(last.shape)) ** 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/forecast", help="the store and statistics")
    parser.add_argument("--steps", type=int, default=1460, help="6-hourly steps (a year)")
    parser.add_argument("--lat", type=int, default=48)
    parser.add_argument("--lon", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "era.zarr"
    start = time.perf_counter()
    if not store.exists():
        generate(store, args.steps, args.lat, args.lon)
        print(f"generated {store}: {len(VARIABLES)} variables x {len(LEVELS)} levels x "
              f"{args.steps} steps x {args.lat} x {args.lon} in "
              f"{time.perf_counter() - start:.1f} s")
    times = xr.open_zarr(store, chunks=None, consolidated=False).time.to_index()
    cut = times[int(0.8 * len(times))]

    with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
        ds = dt.open_arrays(
            store, window={"lat": WINDOW, "lon": WINDOW}, inputs=list(VARIABLES),
            targets=list(VARIABLES), input_steps=2, lead=1, stack=True,
            splits={"train": (None, cut - pd.Timedelta("6h")), "val": (cut, None)},
            normalize="train", normalize_per=["level"],
            statistics_path=out / "era-statistics.json")
        train, val = ds.split("train"), ds.split("val")
        channels_in, channels_out = ds.zarr_array("x").shape[1], ds.zarr_array("y").shape[1]
        print(f"windows of {WINDOW} x {WINDOW}: {len(train):,} train and {len(val):,} "
              f"validation samples of {channels_in} channels -> {channels_out}, read in place "
              f"from {store.name}")
        trainer = dt.Trainer(functools.partial(Forecaster, channels_in, channels_out), mse,
                             dt.optim.adam(args.lr), mode="sync", workers=args.workers,
                             batch_size=args.batch_size, progress=not args.no_progress,
                             torch_threads=1)
        history = trainer.fit(train, epochs=args.epochs, validation=val, client=client)
        for k, epoch in enumerate(history.epochs):
            print(f"epoch {k}: train loss {epoch['train']['loss']:.4f}, validation mse "
                  f"{epoch['validation']['loss']:.4f}")
        summary = history.summary()
        print(f"trained {summary['updates']} updates in {summary['wall_time_s']:.0f} s, "
              f"{summary['samples_per_s']:,.0f} samples/s, data stall "
              f"{100 * summary.get('data_stall', 0.0):.1f} %")
        model = history.epochs[-1]["validation"]["loss"]
        baseline = persistence_mse(val)
        print(f"validation mse: model {model:.4f}, persistence {baseline:.4f} "
              f"({model / baseline:.2f}x persistence's)")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
