"""W1, the data-stall workload: does the training loop ever wait for data?

Data: 200,192 rows x 32 float32 features + int64 labels (782 batches of 256) in Zarr, chunks of
8,192 rows, zstd. Each batch of 256 costs C ms of CPU to transform (a calibrated busy loop of
small numpy matmuls). The consumer's step is a simulated accelerator: ``time.sleep(0.020)``
(releases the CPU) plus a real tiny MLP (32->64->10) forward/backward.

Measured side by side in one run, medians of ``--repeats``:

1. stall (time waiting for the next batch / epoch wall time, first batch included) and
   samples/s of dasktrain.Pipeline with its default settings (and, given ``--block-rows``,
   ``--task-rows`` or ``--prefetch``, with those beside it), the same loop loading
   synchronously, and a torch
   DataLoader with the same number of (persistent) worker processes reading the same Zarr
   chunks: the first and the second epoch of a fresh loader (medians over ``--repeats``
   fresh loaders), as a training run sees them when it starts and from then on;
2. read efficiency: the pipeline (default settings) with an identity transform and no step,
   against a plain sequential zarr read of the same arrays in one process.

Run: ``.venv/bin/python benchmarks/pipeline.py`` (``--costs 5 30 --repeats 3``; ``--quick``:
C = 5 on 8,192 rows, once). ``dasktrain bench`` runs it among the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import zarr
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios

ROWS, WIDTH, CHUNK, BATCH, STEP_S = 200_192, 32, 8_192, 256, 0.020
_MAT = np.random.default_rng(0).standard_normal((48, 48))
# shared/benchmarks.md, W1: the stall to reach from the first epoch, per transform cost C.
GOALS = {5.0: "≤ 2 % stall", 30.0: "≤ 5 % stall"}
QUICK = {"costs": [5.0], "repeats": 1, "rows": 8_192}


def _spin(iterations: int) -> None:
    m = _MAT
    for _ in range(iterations):
        m = np.tanh(m @ _MAT)


def calibrate() -> float:
    """Busy-loop iterations per millisecond on this machine (best of a few tries)."""
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        _spin(2000)
        best = max(best, 2000 / ((time.perf_counter() - start) * 1e3))
    return best


class CostlyTransform:
    """C ms of CPU per 256 rows, then a real (cheap) normalisation of the features."""

    def __init__(self, ms_per_batch: float, per_ms: float) -> None:
        self.ms_per_batch, self.per_ms = ms_per_batch, per_ms

    def work(self, rows: int) -> None:
        _spin(round(self.per_ms * self.ms_per_batch * rows / BATCH))

    def __call__(self, arrays: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
        self.work(len(arrays["x"]))
        arrays["x"] = (arrays["x"] * 0.5).astype(np.float32)
        return arrays


def make_data(directory: Path, client: Client, rows: int = ROWS) -> dt.Dataset:
    rng = np.random.default_rng(0)
    np.save(directory / "x.npy", rng.standard_normal((rows, WIDTH), dtype=np.float32))
    np.save(directory / "y.npy", rng.integers(0, 10, rows))
    return dt.prepare(directory / "x.npy", directory / "w1.zarr", client=client,
                      target=str(directory / "y.npy"), chunk_rows=CHUNK, progress=False)


def train_loop(batches: Iterable, step: bool = True) -> tuple[float, float, int]:
    """Run one epoch; return (stall fraction, samples/s, samples)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    waited, samples = 0.0, 0
    start = time.perf_counter()
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t0
        samples += len(x)
        if step:
            time.sleep(STEP_S)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    wall = time.perf_counter() - start
    return waited / wall, samples / wall, samples


def sync_batches(path: Path, transform: CostlyTransform, seed: int) -> Iterator:
    """The same loop loading synchronously: read a chunk, transform, cut batches."""
    group = zarr.open_group(str(path), mode="r")
    x, y = group["x"], group["y"]
    order = np.random.default_rng(seed).permutation(-(-x.shape[0] // CHUNK))
    for c in order:
        xs, ys = x[c * CHUNK:(c + 1) * CHUNK], y[c * CHUNK:(c + 1) * CHUNK]
        for a in range(0, len(xs), BATCH):
            arrays = transform({"x": xs[a:a + BATCH], "y": ys[a:a + BATCH]}, None)
            yield torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])


class ZarrChunks(torch.utils.data.IterableDataset):
    """What a DataLoader user writes for chunked Zarr: workers split shuffled chunks."""

    def __init__(self, path: Path, transform: CostlyTransform, seed: int) -> None:
        self.path, self.transform, self.seed = str(path), transform, seed

    def __iter__(self) -> Iterator:
        info = torch.utils.data.get_worker_info()
        wid, n = (info.id, info.num_workers) if info else (0, 1)
        group = zarr.open_group(self.path, mode="r")
        x, y = group["x"], group["y"]
        order = np.random.default_rng(self.seed).permutation(-(-x.shape[0] // CHUNK))
        for c in order[wid::n]:
            xs, ys = x[c * CHUNK:(c + 1) * CHUNK], y[c * CHUNK:(c + 1) * CHUNK]
            for a in range(0, len(xs), BATCH):
                arrays = self.transform({"x": xs[a:a + BATCH], "y": ys[a:a + BATCH]}, None)
                yield torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])


def dataloader(path: Path, transform: CostlyTransform, workers: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ZarrChunks(path, transform, 0), batch_size=None,
                                       num_workers=workers, prefetch_factor=4,
                                       persistent_workers=True)


def median_of(results: list[tuple]) -> tuple:
    return tuple(statistics.median(r[i] for r in results) for i in range(len(results[0])))


def settle(client: Client, timeout: float = 60.0) -> None:
    """Wait until the cluster runs nothing: a closed pipeline's head start on an epoch that
    never comes still finishes the block tasks already running, and the next fresh loader
    should start on idle workers."""
    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.05)


def epochs(repeats: int, make: Callable[[], Iterable], client: Client, step: bool = True
           ) -> tuple[tuple, tuple]:
    """Medians over ``repeats`` fresh loaders of (their first epoch, their second epoch):
    what a training run sees when it starts, and from then on."""
    first, second = [], []
    for _ in range(repeats):
        settle(client)
        loader = make()
        first.append(train_loop(loader, step))
        second.append(train_loop(loader, step))
        if hasattr(loader, "close"):
            loader.close()
        del loader  # a DataLoader's persistent worker processes stop with it
    return median_of(first), median_of(second)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", type=float, nargs="+", default=[5.0, 30.0],
                        help="transform cost C in ms per batch of 256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=ROWS,
                        help=f"rows of the dataset (default {ROWS:,}, the workload's)")
    parser.add_argument("--block-rows", type=int,
                        help="also measure a pipeline with these block rows")
    parser.add_argument("--task-rows", type=int,
                        help="also measure a pipeline with these task rows")
    parser.add_argument("--prefetch", type=int,
                        help="also measure a pipeline with this prefetch")
    parser.add_argument("--direct", action=argparse.BooleanOptionalAction, default=False,
                        help="fetch batches straight from the workers, not via the scheduler "
                             "(default: as a plain Client does)")
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: C = 5 on 8,192 rows, once (rough figures)")
    return args


def ratios(rows: list[tuple], identity: tuple, plain: tuple) -> list[Ratio]:
    """The summary rows: per cost, stall in the first epoch and throughput from then on,
    against the DataLoader; then read efficiency against a plain zarr loop."""
    out = []
    for cost in dict.fromkeys(r[0] for r in rows):
        mine = next(r for r in rows if r[0] == cost and r[1].startswith("dasktrain"))
        loader = next(r for r in rows if r[0] == cost and r[1].startswith("torch"))
        out.append(Ratio(workload=f"W1 data stall, C = {cost:g} ms/batch, first epoch",
                         ours=f"{mine[2]:.1%}", baseline=f"{loader[2]:.1%} (DataLoader)",
                         ratio=ratio_of(mine[2], loader[2]), goal=GOALS.get(cost, "—")))
        out.append(Ratio(workload=f"W1 samples/s, C = {cost:g} ms/batch, second epoch",
                         ours=f"{mine[4]:,.0f}", baseline=f"{loader[4]:,.0f} (DataLoader)",
                         ratio=ratio_of(mine[4], loader[4])))
    out.append(Ratio(workload="W1 read, identity transform, no step (samples/s)",
                     ours=f"{identity[1]:,.0f}", baseline=f"{plain[1]:,.0f} (plain zarr loop)",
                     ratio=ratio_of(identity[1], plain[1])))
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    per_ms = calibrate()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                         host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster, direct_to_workers=args.direct) as client:
        ds = make_data(Path(tmp), client, args.rows)
        path = Path(tmp) / "w1.zarr"
        tuned = {k: v for k, v in [("block_rows", args.block_rows),
                                   ("task_rows", args.task_rows),
                                   ("prefetch", args.prefetch)] if v is not None}
        for cost in args.costs:
            transform = CostlyTransform(cost, per_ms)

            def pipeline(transform=transform, **options):
                return dt.Pipeline(ds, BATCH, seed=0, transform=transform, client=client,
                                   **options)

            with pipeline(prefetch_next_epoch=False) as warm:  # imports, first compiles
                train_loop(warm)
            mine = [("dasktrain Pipeline, default settings", epochs(args.repeats, pipeline,
                                                                    client))]
            if tuned:
                label = ", ".join(f"{k}={v}" for k, v in tuned.items())
                mine.append((f"dasktrain Pipeline, {label}",
                             epochs(args.repeats, lambda: pipeline(**tuned), client)))
            theirs = epochs(args.repeats, lambda t=transform: dataloader(path, t, args.workers),
                            client)
            synchronous = median_of([train_loop(sync_batches(path, transform, 0))
                                     for _ in range(args.repeats)])
            for name, (first, later) in [*mine,
                                         (f"torch DataLoader, num_workers={args.workers}, "
                                          "persistent workers", theirs),
                                         ("synchronous loading (no prefetch)",
                                          (synchronous, synchronous))]:
                assert first[2] == later[2] == args.rows, (name, first, later)
                rows.append((cost, name, first[0], later[0], later[1]))
        reads = [("dasktrain Pipeline, default settings", {})]
        if tuned:
            reads.append((f"dasktrain Pipeline, {label}", tuned))
        identity = [(name, epochs(args.repeats, lambda o=options: dt.Pipeline(
            ds, BATCH, seed=0, client=client, **o), client, step=False)[1])
            for name, options in reads]

        def plain_read():
            group = zarr.open_group(str(path), mode="r")
            start = time.perf_counter()
            for a in range(0, args.rows, CHUNK):
                group["x"][a:a + CHUNK]
                group["y"][a:a + CHUNK]
            return (0.0, args.rows / (time.perf_counter() - start), args.rows)

        plain = median_of([plain_read() for _ in range(args.repeats)])

    print(f"W1 data stall: {args.rows:,} rows x {WIDTH} float32 + int64 labels, chunks of "
          f"{CHUNK:,}, batches of {BATCH}, step = {STEP_S * 1e3:.0f} ms sleep + MLP; "
          f"{args.workers} worker processes; first and second epoch of a fresh loader, medians "
          f"of {args.repeats} loaders; {os.cpu_count()} CPUs")
    print()
    print("| C ms/batch | loader | stall, first epoch | stall, second epoch | samples/s (2nd) | "
          "samples/s vs DataLoader |")
    print("|---:|---|---:|---:|---:|---:|")
    for cost in args.costs:
        mine = [r for r in rows if r[0] == cost]
        loader_rate = next(r[4] for r in mine if r[1].startswith("torch"))
        for _, name, first, later, rate in mine:
            print(f"| {cost:g} | {name} | {first:.1%} | {later:.1%} | {rate:,.0f} | "
                  f"{rate / loader_rate:.2f}x |")
    print()
    print("| read efficiency (identity transform, no step) | samples/s | ratio |")
    print("|---|---:|---:|")
    print(f"| plain sequential zarr read, one process | {plain[1]:,.0f} | 1.00x |")
    for name, (_, rate, _) in identity:
        print(f"| {name} | {rate:,.0f} | {rate / plain[1]:.2f}x |")
    print()
    flags = [f"--costs {' '.join(f'{c:g}' for c in args.costs)}", f"--repeats {args.repeats}",
             f"--workers {args.workers}"]
    flags += [f"--{k.replace('_', '-')} {v}" for k, v in tuned.items()]
    if args.direct:
        flags.append("--direct")
    if args.rows != ROWS:
        flags.append(f"--rows {args.rows}")
    print("command: .venv/bin/python benchmarks/pipeline.py " + " ".join(flags))
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(rows, identity[0][1], plain))

if __name__ == "__main__":
    main()
