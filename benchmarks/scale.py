"""W13, the cost curve: does time grow linearly with the data, and memory not at all?

Three kinds of data, each at several sizes; every point runs in a process of its own (this
script with ``--point``) on an embedded LocalCluster of 2 worker processes (2 threads each,
``--memory-limit``, default 3 GiB, each) on 127.0.0.1. The data is generated beforehand,
untimed, into ``--dir`` (a scratch folder removed at the end unless ``--keep``):

* **rows** (default 1 M, 10 M, 100 M rows): Parquet files of 1 M rows each, 16 float32
  features and a float32 label (68 bytes a row: 6.8 GB at 100 M, more than the workers'
  memory together). Measured: ``prepare`` (``--target label``), ``verify``, the epoch
  plan's time and memory in the driver (the plan of work claimed on demand, as the fit's
  driver makes it), and one epoch of an MLP 16 -> 32 -> 1 in ``async`` (work claimed on
  demand, the default), 2 trainer workers x batches of ``--batch`` rows.
* **images** (default 20 k, 200 k; 1 M with ``--sizes``): JPEG folders of 96 x 96 images
  in 10 class folders (benchmarks/images.py's generator, ~8 KB each). Measured: ``prepare``
  (encoded storage: the JPEG bytes), ``verify``, and one epoch of a small CNN (3 convolutions,
  64 x 64 random resized crops and flips made by the workers) through the images pipeline.
* **text** (default 10, 100, 1,000 MB): copies of the Python standard library's ``.py``
  files, byte tokenizer, sequences of 256. Measured: ``prepare`` and ``verify``, and a fixed
  part of an epoch (the first 2,048 sequences) of a tiny causal transformer: text's
  training cost grows with the tokens trained on, not with the corpus prepared.

Per point: the time of each step, the first batch's wait (the longest over the trainer
workers), and the peak resident memory of the driver (which runs the scheduler too), of the
holder's worker and of the other worker: the operating system's own peak of each process
(``VmHWM``; not ``ru_maxrss``, which carries the peak of the process that started it),
the workers restarted after preparing so that their peaks are the epoch's.

The report, per kind: time per unit of data at each size after the fixed start cost (a
least-squares line through the points: the intercept is the fixed cost, reported apart),
with the goal that the largest is within 15 % of the smallest; peak memory per process
(goal: within 10 % or 100 MB across sizes, whichever is larger); and the first batch's
wait (goal: independent of size).

Run: ``.venv/bin/python benchmarks/scale.py`` (rows, then images, then text; ``--kinds``
some of them; ``--sizes`` for one kind; about an hour on 2 cores, most of it the 100 M
rows and 200 k images); ``--quick``: small sizes of each kind, a check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

KINDS = ("rows", "images", "text")
SIZES = {"rows": [1_000_000, 10_000_000, 100_000_000], "images": [20_000, 200_000],
         "text": [10, 100, 1_000]}
UNITS = {"rows": "M rows", "images": "k images", "text": "MB"}
PER_UNIT = {"rows": 1e6, "images": 1e3, "text": 1.0}
QUICK = {"sizes_rows": [20_000, 80_000], "sizes_images": [300, 1_200],
         "sizes_text": [1, 4], "batch": 512, "text_sequences": 256}
FILE_ROWS = 1_000_000
WIDTH = 16
SEQ_LEN = 256
GOAL_TIME, GOAL_MEMORY = 0.15, 0.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dasktrain.cli.bench import parse_with_quick

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    for kind in KINDS:
        parser.add_argument(f"--sizes-{kind}", type=float, nargs="+", default=SIZES[kind],
                            help=f"sizes of {kind} (default {SIZES[kind]})")
    parser.add_argument("--batch", type=int, default=4096,
                        help="rows per trainer worker per step, rows (default 4096)")
    parser.add_argument("--text-sequences", type=int, default=2048)
    parser.add_argument("--memory-limit", default="3GiB")
    parser.add_argument("--dir", help="where the data is generated (default: a temporary "
                                      "folder)")
    parser.add_argument("--keep", action="store_true", help="keep --dir's data")
    parser.add_argument("--point", nargs=2, metavar=("KIND", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parse_with_quick(parser, argv, QUICK, "seconds, not an hour: small sizes")


# -- the data, generated untimed ----------------------------------------------------------
def make_rows(folder: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weights = rng.normal(size=WIDTH).astype(np.float32)
    for index, start in enumerate(range(0, rows, FILE_ROWS)):
        n = min(FILE_ROWS, rows - start)
        x = rng.standard_normal((n, WIDTH), dtype=np.float32)
        label = np.tanh(x @ weights / 4) + rng.normal(0, 0.1, n).astype(np.float32)
        table = pa.table({**{f"f{j}": x[:, j] for j in range(WIDTH)},
                          "label": label.astype(np.float32)})
        pq.write_table(table, folder / f"part-{index:04d}.parquet", compression="snappy")


def make_images(folder: Path, count: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from images import make_folder

    make_folder(folder, count)


def make_text(folder: Path, megabytes: float) -> None:
    """Copies of the standard library's ``.py`` files, under numbered folders, until
    ``megabytes`` MB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    budget, copy = int(megabytes * 1e6), 0
    while budget > 0:
        for source in files:
            data = source.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            data = data[:budget]
            target = folder / f"copy{copy:03d}" / source.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            budget -= len(data)
            if budget <= 0:
                break
        copy += 1


MAKE = {"rows": make_rows, "images": make_images, "text": make_text}


# -- one point, in a process of its own --------------------------------------------------
def _peak(dask_worker: Any = None) -> dict[str, Any]:
    from dasktrain._memory import peak_resident
    from dasktrain.trainer.holder import ParameterHolder

    holder = dask_worker is not None and any(
        isinstance(a, ParameterHolder) for a in list(dask_worker.state.actors.values()))
    return {"peak": peak_resident(), "holder": holder}


class HolderSpotter:
    """Notes which worker holds the parameter holder while a fit runs (the workers' peaks
    are read after the fit, when the holder is gone)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.address: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.address is None and not self._stop.wait(0.1):
            try:
                found = self.client.run(_peak)
            except Exception:  # the cluster is going away
                return
            self.address = next((a for a, f in found.items() if f["holder"]), None)

    def stop(self) -> str | None:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.address


def _first_batch(history: Any) -> float:
    per_worker = history.epochs[0].get("per_worker") or []
    return max((float(w.get("first_batch_s", 0.0)) for w in per_worker), default=0.0)


def _plan(ds: Any, batch: int, transform: Any) -> tuple[float, float]:
    """The driver's plan of one epoch of work claimed on demand: seconds and MiB (after
    a first plan, untimed, has loaded what planning imports)."""
    import dasktrain as dt

    dt.Pipeline(ds, batch, transform=transform).plan(1).claim_bounds()
    tracemalloc.start()
    started = time.perf_counter()
    plan = dt.Pipeline(ds, batch, transform=transform).plan(0)
    plan.num_batches, plan.claim_bounds()
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak / 2**20


def _transform(kind: str) -> Any:
    if kind != "images":
        return None
    sys.path.insert(0, str(Path(__file__).parent))
    from images import augment

    return augment()


def _train(kind: str, ds: Any, client: Any, args: argparse.Namespace) -> Any:
    import torch

    import dasktrain as dt

    torch.manual_seed(0)
    options = {"workers": 2, "torch_threads": 1, "progress": False}
    if kind == "rows":
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1), torch.nn.Flatten(0))
        trainer = dt.Trainer(model, torch.nn.functional.mse_loss, dt.optim.adam(1e-3), mode="async",
                             batch_size=args.batch, **options)
        return trainer.fit(ds, epochs=1, client=client)
    if kind == "images":
        sys.path.insert(0, str(Path(__file__).parent))
        from images import CLASSES, augment

        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, CLASSES))
        trainer = dt.Trainer(model, torch.nn.functional.cross_entropy, dt.optim.adam(1e-3),
                             mode="async", batch_size=128, **options)
        return trainer.fit(dt.Pipeline(ds, 128, transform=augment()), epochs=1,
                           client=client)
    examples = Path(__file__).parent.parent / "examples"
    sys.path.insert(0, str(examples))
    from tiny_lm import TinyLM, next_token_loss

    # The workers started before examples/ was on this process's path.
    client.upload_file(str(examples / "tiny_lm.py"))

    model = TinyLM(257, SEQ_LEN, d_model=32, layers=1, heads=2)
    trainer = dt.Trainer(model, next_token_loss, dt.optim.adam(1e-3), mode="async", batch_size=16,
                         **options)
    part = ds._view(0, min(len(ds), args.text_sequences), "part")
    return trainer.fit(part, epochs=1, client=client)


def point(kind: str, size: float, source: Path, args: argparse.Namespace) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    import dasktrain as dt
    from dasktrain._cluster import NO_DASHBOARD, worker_malloc_settings

    out = source.parent / f"{source.name}.zarr"
    shutil.rmtree(out, ignore_errors=True)
    found: dict[str, Any] = {"kind": kind, "size": size}
    # The embedded cluster's worker environment (its allocator settings), as a user of the
    # default gets it; the nannies read it as they are made.
    with worker_malloc_settings():
        cluster = LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                               host="127.0.0.1", memory_limit=args.memory_limit, **NO_DASHBOARD)
    with cluster, Client(cluster) as client:
        options: dict[str, Any] = {"client": client, "progress": False}
        if kind == "rows":
            options["target"] = "label"
        elif kind == "images":
            options["image_storage"] = "encoded"
        else:
            options |= {"text_glob": "*.py", "seq_len": SEQ_LEN}
        started = time.perf_counter()
        ds = dt.prepare(str(source), out, **options)
        found["prepare_s"] = time.perf_counter() - started
        found["prepare_peaks"] = [p["peak"] for p in client.run(_peak).values()]
        # The driver's own peak so far, phase by phase: which of them sets it.
        found["driver_peaks"] = {"prepare": _peak()["peak"]}
        started = time.perf_counter()
        report = dt.verify(out, client=client, progress=False)
        found["verify_s"] = time.perf_counter() - started
        assert report.ok, report
        found["driver_peaks"]["verify"] = _peak()["peak"]
        found["samples"] = len(ds)
        found["plan_s"], found["plan_mib"] = _plan(ds, args.batch if kind == "rows" else 128,
                                                   _transform(kind))
        found["driver_peaks"]["plan"] = _peak()["peak"]
        client.restart()  # fresh worker processes: their peaks are the epoch's
        spotter = HolderSpotter(client)
        started = time.perf_counter()
        history = _train(kind, ds, client, args)
        found["fit_s"] = time.perf_counter() - started
        holder = spotter.stop()
        found["epoch_s"] = history.epochs[0]["wall_s"]
        found["trained"] = history.epochs[0]["samples"]
        found["first_batch_s"] = _first_batch(history)
        peaks = client.run(_peak)
        found["holder_peak"] = peaks[holder]["peak"] if holder in peaks else None
        found["other_peak"] = max((p["peak"] for a, p in peaks.items() if a != holder),
                                  default=None)
    found["driver_peak"] = _peak()["peak"]
    shutil.rmtree(out, ignore_errors=True)
    return found


# -- the report ---------------------------------------------------------------------------
def per_unit(kind: str, points: list[dict[str, Any]], key: str
             ) -> tuple[float, list[float]]:
    """The fixed cost (the intercept of a least-squares line of ``key`` against the size)
    and each point's seconds per unit of data after it."""
    sizes = np.array([p["size"] / PER_UNIT[kind] for p in points])
    times = np.array([p[key] for p in points])
    line = len(points) >= 2 and np.ptp(sizes) > 0
    fixed = max(0.0, float(np.polyfit(sizes, times, 1)[1])) if line else 0.0
    return fixed, [float((t - fixed) / s) for t, s in zip(times, sizes, strict=True)]


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def report(kind: str, points: list[dict[str, Any]]) -> list[str]:
    """Print the kind's tables; returns the goals not met."""
    unit = UNITS[kind]
    trained = "the epoch" if kind != "text" else "the fixed part of an epoch"
    print(f"\n### {kind}\n")
    print(f"| size | samples | prepare (s) | verify (s) | plan (s / MiB) | {trained} (s) | "
          f"first batch (s) | peak MiB: driver / holder's worker / other worker | peak "
          f"MiB of the workers preparing |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for p in points:
        print(f"| {p['size'] / PER_UNIT[kind]:,g} {unit} | {p['samples']:,} | "
              f"{p['prepare_s']:,.1f} | {p['verify_s']:,.1f} | {p['plan_s']:.3f} / "
              f"{p['plan_mib']:.1f} | {p['epoch_s']:,.1f} | {p['first_batch_s']:.2f} | "
              f"{_mib(p['driver_peak'])} / {_mib(p['holder_peak'])} / "
              f"{_mib(p['other_peak'])} | "
              f"{' / '.join(_mib(v) for v in sorted(p['prepare_peaks']))} |")
    missed = []
    steps = [("prepare_s", "prepare"), ("verify_s", "verify")]
    if kind != "text":
        steps.append(("epoch_s", "epoch"))
    print(f"\n| step | fixed start cost (s) | s per {unit}, smallest → largest size | "
          f"largest / smallest | goal |")
    print("|---|---:|---|---:|---|")
    for key, name in steps:
        fixed, rates = per_unit(kind, points, key)
        spread = max(rates) / min(rates) if min(rates) > 0 else float("inf")
        ok = spread <= 1 + GOAL_TIME
        if not ok:
            missed.append(f"{kind} {name}: {spread:.2f}x per unit")
        print(f"| {name} | {fixed:,.1f} | {' → '.join(f'{r:,.3g}' for r in rates)} | "
              f"{spread:.2f}x | ≤ {1 + GOAL_TIME:.2f}x: {'met' if ok else 'NOT met'} |")
    print("\n| process | peak MiB, smallest → largest size | spread | goal |")
    print("|---|---|---:|---|")
    for p in points:
        p["prepare_peak"] = max(p["prepare_peaks"])
    for key, name in (("driver_peak", "driver"), ("holder_peak", "holder's worker"),
                      ("other_peak", "other worker"), ("prepare_peak", "a worker preparing")):
        values = [p[key] for p in points if p[key] is not None]
        if not values:
            continue
        spread = max(values) - min(values)
        allowed = max(GOAL_MEMORY * min(values), 100 * 2**20)
        ok = spread <= allowed
        if not ok:
            missed.append(f"{kind} {name} memory: +{spread / 2**20:,.0f} MiB")
        print(f"| {name} | {' → '.join(_mib(v) for v in values)} | +{_mib(spread)} | "
              f"≤ 10 % or 100 MiB: {'met' if ok else 'NOT met'} |")
    waits = [p["first_batch_s"] for p in points]
    print(f"\nfirst batch's wait: {' → '.join(f'{w:.2f} s' for w in waits)} "
          f"(goal: independent of size)")
    return missed


def run_point(kind: str, size: float, source: Path, args: argparse.Namespace
              ) -> dict[str, Any]:
    """``point`` in a process of its own."""
    out = source.parent / f"{source.name}.json"
    command = [sys.executable, __file__, "--point", kind, repr(size), "--dir",
               str(source.parent), "--json", str(out), "--batch", str(args.batch),
               "--text-sequences", str(args.text_sequences),
               "--memory-limit", args.memory_limit]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.point:
        kind, size = args.point[0], float(args.point[1])
        found = point(kind, size, Path(args.dir) / f"{kind}-{size:g}", args)
        Path(args.json).write_text(json.dumps(found))
        return
    where = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dasktrain-scale-"))
    where.mkdir(parents=True, exist_ok=True)
    missed: list[str] = []
    try:
        for kind in args.kinds:
            points = []
            for size in getattr(args, f"sizes_{kind}"):
                source = where / f"{kind}-{size:g}"
                if not source.exists():
                    started = time.perf_counter()
                    MAKE[kind](source, int(size) if kind != "text" else size)
                    print(f"made {source.name} in {time.perf_counter() - started:.0f} s",
                          file=sys.stderr, flush=True)
                points.append(run_point(kind, size, source, args))
                print(f"{kind} {size:g}: {json.dumps(points[-1])}", file=sys.stderr,
                      flush=True)
                if not args.keep:
                    shutil.rmtree(source, ignore_errors=True)
            missed += report(kind, points)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(where, ignore_errors=True)
    print(f"\ngoals not met: {'; '.join(missed) if missed else 'none'} "
          f"({os.cpu_count()} CPUs, 2 workers of {args.memory_limit}, each point in a "
          f"process of its own)")
    if args.ratios_json:
        from dasktrain.cli.bench import write_ratios

        write_ratios(args.ratios_json, [])


if __name__ == "__main__":
    main()
