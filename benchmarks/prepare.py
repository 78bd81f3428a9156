"""Throughput of dataset preparation: ``dasktrain.prepare`` on Dask versus a plain zarr loop.

What it measures
----------------
MB/s of writing one ``.npy`` source (float32 features ``x`` plus int64 labels ``y`` from a
second ``.npy``) into a Zarr v3 group with zstd (level 3, checksummed) chunks of
``--chunk-rows`` rows, two ways:

* **dask**: ``dasktrain.prepare(x.npy, out, target=y.npy, chunk_rows=..., client=client)`` on a
  ``LocalCluster`` of ``--workers`` single-threaded worker processes. The cluster is started
  once, before any timing, and reused for every repeat: start-up is not measured. Everything
  ``prepare`` does is measured (for ``.npy`` sources that includes its NaN/inf screening and
  its two passes, stage then write, and opening the finished dataset).
* **baseline**: what a user would otherwise write, a single-process loop that maps the same
  ``.npy`` files (``np.load(mmap_mode="r")``) and assigns them chunk by chunk into arrays made
  with ``zarr.open_group(...).create_array(...)``, same chunks and same codec.

Two rows are reported: the same work on both sides, and a row where ``prepare`` also splits
(``train=0.9,val=0.1``) and normalises, against the same plain loop (so the dask side does
more work there). MB/s counts the uncompressed bytes of ``x`` + ``y`` over the wall time of
one run; each cell is the median of ``--repeats`` runs, after one unmeasured warm-up run of
each path. Data lives in a temporary directory removed at exit.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/prepare.py
    .venv/bin/python benchmarks/prepare.py --rows 400000 --width 32 --repeats 5 --workers 2
"""

from __future__ import annotations

import os

# Before numpy is imported here and before the worker processes start (they inherit it).
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import logging
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zarr
from distributed import Client, LocalCluster

import dasktrain

CHUNK_ROWS = 8192
MORE_WORK = {"split": "train=0.9,val=0.1", "normalize": True}


def make_source(directory: Path, rows: int, width: int, seed: int = 0) -> tuple[Path, Path]:
    """Write ``x.npy`` (float32, rows x width) and ``y.npy`` (int64 labels) into ``directory``."""
    rng = np.random.default_rng(seed)
    x_path, y_path = directory / "x.npy", directory / "y.npy"
    x = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.float32, shape=(rows, width))
    step = 65536
    for a in range(0, rows, step):
        b = min(a + step, rows)
        x[a:b] = rng.standard_normal((b - a, width), dtype=np.float32)
    x.flush()
    del x
    np.save(y_path, rng.integers(0, 10, size=rows, dtype=np.int64))
    return x_path, y_path


def baseline_write(x_path: Path, y_path: Path, out: Path, chunk_rows: int) -> None:
    """The plain single-process loop: mmap the .npy files, write x and y chunk by chunk."""
    x = np.load(x_path, mmap_mode="r")
    y = np.load(y_path, mmap_mode="r")
    group = zarr.open_group(str(out), mode="w")
    arrays = {
        name: group.create_array(
            name, shape=src.shape, chunks=(chunk_rows, *src.shape[1:]), dtype=src.dtype,
            compressors=zarr.codecs.ZstdCodec(level=3, checksum=True),
        )
        for name, src in (("x", x), ("y", y))
    }
    n = len(x)
    for a in range(0, n, chunk_rows):
        b = min(a + chunk_rows, n)
        arrays["x"][a:b] = np.asarray(x[a:b])
        arrays["y"][a:b] = np.asarray(y[a:b])


def dask_write(client: Client, x_path: Path, y_path: Path, out: Path, chunk_rows: int,
               **opts: object) -> None:
    dasktrain.prepare(x_path, out, client=client, progress=False, overwrite=True,
                      chunk_rows=chunk_rows, target=str(y_path), **opts)


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def check_same(baseline_out: Path, dask_out: Path) -> None:
    """The plain dask output must hold exactly what the baseline wrote (same work)."""
    base = zarr.open_group(str(baseline_out), mode="r")
    ours = zarr.open_group(str(dask_out), mode="r")
    for name in ("x", "y"):
        a, b = base[name], ours[name]
        if a.shape != b.shape or a.chunks != b.chunks or a.dtype != b.dtype:
            raise AssertionError(
                f"{name}: baseline {a.shape}/{a.chunks}/{a.dtype} vs "
                f"dask {b.shape}/{b.chunks}/{b.dtype}")
        if not np.array_equal(a[:], b[:]):
            raise AssertionError(f"{name}: dask output differs from the baseline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000, help="samples (default 400000)")
    parser.add_argument("--width", type=int, default=32, help="features (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="Dask workers (default 2)")
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS,
                        help=f"rows per chunk (default {CHUNK_ROWS})")
    args = parser.parse_args(argv)
    for flag in ("rows", "width", "repeats", "workers", "chunk_rows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dasktrain-bench-") as tmp:
        root = Path(tmp)
        x_path, y_path = make_source(root, args.rows, args.width)
        mb = args.rows * (args.width * 4 + 8) / 1e6  # uncompressed x (float32) + y (int64)
        base_out, plain_out, more_out = root / "baseline", root / "plain", root / "more"

        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          host="127.0.0.1", dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
            client.wait_for_workers(args.workers)
            runs: dict[str, Callable[[], None]] = {
                "baseline": lambda: baseline_write(x_path, y_path, base_out, args.chunk_rows),
                "plain": lambda: dask_write(client, x_path, y_path, plain_out, args.chunk_rows),
                "more": lambda: dask_write(client, x_path, y_path, more_out, args.chunk_rows,
                                           **MORE_WORK),
            }
            # Warm-up (imports on workers, page cache); a path that fails is reported, not
            # timed, and the others still run.
            failed: dict[str, str] = {}
            for name, run in runs.items():
                try:
                    run()
                except Exception as exc:
                    if name == "baseline":
                        raise
                    traceback.print_exc()
                    failed[name] = f"{type(exc).__name__}: {exc}"
            if "plain" not in failed:
                check_same(base_out, plain_out)
            times: dict[str, list[float]] = {name: [] for name in runs if name not in failed}
            for _ in range(args.repeats):  # interleaved so drift hits every path alike
                for name in times:
                    times[name].append(timed(runs[name]))

    med = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: mb / t for name, t in med.items()}
    print(f"prepare throughput: {args.rows} rows x {args.width} float32 features + int64 "
          f"labels = {mb:.1f} MB uncompressed, chunk_rows={args.chunk_rows}, zstd level 3; "
          f"median of {args.repeats} runs")
    print(f"dask: LocalCluster {args.workers} worker process(es) x 1 thread (start-up not "
          f"timed); baseline: 1 process; {os.cpu_count()} CPU(s), Python "
          f"{platform.python_version()}, zarr {zarr.__version__}, numpy {np.__version__}")
    print()
    print("| workload | dask MB/s | baseline MB/s | dask / baseline |")
    print("|---|---:|---:|---:|")
    rows = [
        ("same output: .npy x + y labels -> zarr", "plain"),
        ("dask does more: + split=train=0.9,val=0.1, normalize=True "
         "(baseline: same plain loop)", "more"),
    ]
    base = f"{rate['baseline']:.1f} ({med['baseline']:.2f} s)"
    for label, name in rows:
        if name in failed:
            print(f"| {label} | FAILED: {failed[name]} | {base} | - |")
        else:
            print(f"| {label} | {rate[name]:.1f} ({med[name]:.2f} s) | {base} | "
                  f"{rate[name] / rate['baseline']:.2f}x |")
    print()
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"total wall time: {time.perf_counter() - wall:.1f} s (incl. data generation, "
          f"cluster start-up, warm-up)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
