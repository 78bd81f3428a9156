"""Throughput of dataset preparation: ``dasktrain.prepare`` on Dask versus a plain zarr loop.

What it measures
----------------
MB/s of writing one ``.npy`` source (float32 features ``x`` plus int64 labels ``y`` from a
second ``.npy``) into a Zarr v3 group with zstd (level 3, checksummed) chunks, two ways:

* **dask**: ``dasktrain.prepare(x.npy, out, target=y.npy, client=client)`` on a
  ``LocalCluster`` of ``--workers`` single-threaded worker processes. The cluster is started
  once, before any timing, and reused for every repeat: start-up is not measured. Everything
  ``prepare`` does is measured: its NaN/inf check of every value, the exact per-feature
  statistics that ``verify`` compares, the atomic publish (build in a hidden directory,
  rename into place, replacing the previous run's output) and opening the finished dataset.
* **baseline**: what a user would otherwise write, a single-process loop that maps the same
  ``.npy`` files (``np.load(mmap_mode="r")``) and assigns them chunk by chunk into arrays made
  with ``zarr.open_group(...).create_array(...)``, same chunks and same codec.

The rows come first with ``prepare``'s default settings (its default chunk size, 4 MiB of
rows: the baseline writes the same chunks), then with ``--chunk-rows`` (default 8192, 1 MiB)
given to both sides. Each comes twice: the same work on both sides (the outputs are compared
value for value), and ``prepare`` also splitting (``train=0.9,val=0.1``) and normalising
against the same plain loop (so the dask side does more work there). MB/s counts the
uncompressed bytes of ``x`` + ``y`` over the wall time of one run; each cell is the median of
``--repeats`` runs, interleaved, after one unmeasured warm-up run of each. Data lives in a
temporary directory removed at exit.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/prepare.py
    .venv/bin/python benchmarks/prepare.py --rows 400000 --width 32 --repeats 5 --workers 2
    .venv/bin/python benchmarks/prepare.py --quick     # seconds: rough figures
"""

from __future__ import annotations

import os

# Before numpy is imported here and before the worker processes start (they inherit it).
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import logging
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zarr
from distributed import Client, LocalCluster

import dasktrain
from dasktrain._cluster import NO_DASHBOARD, start_local_cluster
from dasktrain.cli.bench import (
    Ratio,
    interleaved_medians,
    parse_with_quick,
    ratio_of,
    write_ratios,
)
from dasktrain.datasets.format import chunk_rows_for

CHUNK_ROWS = 8192
MORE_WORK = {"split": "train=0.9,val=0.1", "normalize": True}
QUICK = {"rows": 60_000, "repeats": 1}


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


def dask_write(client: Client, x_path: Path, y_path: Path, out: Path, **opts: object) -> None:
    dasktrain.prepare(x_path, out, client=client, progress=False, overwrite=True,
                      target=str(y_path), **opts)



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
                        help=f"rows per chunk of the rows after the defaults' (default "
                             f"{CHUNK_ROWS})")
    args = parse_with_quick(parser, argv, QUICK,
                            f"a few seconds: {QUICK['rows']:,} rows, one timed run")
    for flag in ("rows", "width", "repeats", "workers", "chunk_rows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    out = sys.stderr if args.ratios_json else sys.stdout
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dasktrain-bench-") as tmp:
        root = Path(tmp)
        x_path, y_path = make_source(root, args.rows, args.width)
        mb = args.rows * (args.width * 4 + 8) / 1e6  # uncompressed x (float32) + y (int64)
        # prepare's default chunk size, in rows of x + y: what its defaults write.
        default_rows = min(args.rows, chunk_rows_for(args.width * 4 + 8))

        def baseline(rows: int) -> Callable[[], None]:
            return lambda: baseline_write(x_path, y_path, root / f"base-{rows}", rows)

        def dask(client: Client, name: str, **opts: object) -> Callable[[], None]:
            return lambda: dask_write(client, x_path, y_path, root / name, **opts)

        # The cluster `dasktrain prepare` and `dt.prepare()` start when given none (its
        # worker count set here), then a LocalCluster with distributed's own settings.
        with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
            client.wait_for_workers(args.workers)
            tuned = {"chunk_rows": args.chunk_rows}
            med = interleaved_medians({
                "base-default": baseline(default_rows),
                "plain-default": dask(client, "plain-default"),
                "more-default": dask(client, "more-default", **MORE_WORK),
                "base-tuned": baseline(args.chunk_rows),
                "plain-tuned": dask(client, "plain-tuned", **tuned),
                "more-tuned": dask(client, "more-tuned", **tuned, **MORE_WORK),
            }, args.repeats, failed)
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          host="127.0.0.1", **NO_DASHBOARD,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
            client.wait_for_workers(args.workers)
            own = interleaved_medians({"base-own": baseline(default_rows),
                           "plain-own": dask(client, "plain-own")}, args.repeats, failed)
            med.update(own)
        for name, rows in (("default", default_rows), ("tuned", args.chunk_rows),
                           ("own", default_rows)):
            if f"plain-{name}" not in failed:
                check_same(root / f"base-{rows}", root / f"plain-{name}")

    rate = {name: mb / t for name, t in med.items()}
    print(f"prepare throughput: {args.rows} rows x {args.width} float32 features + int64 "
          f"labels = {mb:.1f} MB uncompressed, zstd level 3; median of {args.repeats} runs",
          file=out)
    print(f"dask: {args.workers} worker process(es) x 1 thread (start-up not timed); "
          f"baseline: 1 process; {os.cpu_count()} CPU(s), load average "
          f"{os.getloadavg()[0]:.1f} at the end, Python {platform.python_version()}, zarr "
          f"{zarr.__version__}, numpy {np.__version__}", file=out)
    print(file=out)
    print("| settings | workload | dask MB/s | baseline MB/s | dask / baseline |", file=out)
    print("|---|---|---:|---:|---:|", file=out)
    same = "same output: .npy x + y labels -> zarr"
    more = ("dask does more: + split=train=0.9,val=0.1, normalize=True "
            "(baseline: same plain loop)")
    defaults = f"defaults ({default_rows:,}-row = 4 MiB chunks, dasktrain's LocalCluster)"
    table = [
        (defaults, same, "plain-default", "base-default"),
        (defaults, more, "more-default", "base-default"),
        (f"--chunk-rows {args.chunk_rows:,}", same, "plain-tuned", "base-tuned"),
        (f"--chunk-rows {args.chunk_rows:,}", more, "more-tuned", "base-tuned"),
        ("defaults, on a LocalCluster with distributed's own worker settings", same,
         "plain-own", "base-own"),
    ]
    ratios = []
    for setting, label, name, base_name in table:
        base = f"{rate[base_name]:.1f} ({med[base_name]:.2f} s)"
        if name in failed:
            print(f"| {setting} | {label} | FAILED: {failed[name]} | {base} | - |", file=out)
            continue
        ratio = ratio_of(rate[name], rate[base_name])
        print(f"| {setting} | {label} | {rate[name]:.1f} ({med[name]:.2f} s) | {base} | "
              f"{ratio:.2f}x |", file=out)
        ratios.append(Ratio(
            workload=f"prepare MB/s, {label.split(':')[0]}, {setting}",
            ours=f"{rate[name]:.1f}", baseline=f"{rate[base_name]:.1f} (plain zarr loop)",
            ratio=ratio, goal="≥ 0.8x" if name == "plain-default" else "—"))
    print(file=out)
    print(f"command: {shlex.join(sys.orig_argv)}", file=out)
    print(f"total wall time: {time.perf_counter() - wall:.1f} s (incl. data generation, "
          f"cluster start-up, warm-up)", file=out)
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
