"""W4, whole training runs: samples/s of a steady ``sync`` epoch against PyTorch DDP.

What a user compares. MLPs 32 -> W -> W -> W -> 1 (ReLU) for W = 512 (542,721 parameters,
2.2 MB) and W = 1024 (2,134,017, 8.5 MB), the same initial weights on both sides, MSE loss,
SGD lr 0.01, on ``regression`` data (100,000 x 32 float32, prepared once with
``dt.prepare`` into a temporary directory), 2 worker processes x batches of 256 (global
512), one torch thread per process. Measured side by side in one run, the two alternating:

* dasktrain: ``dt.Trainer(model, mse_loss, dt.optim.sgd(0.01), mode="sync", workers=2,
  batch_size=256)`` fitting the dataset for ``--epochs`` epochs on a LocalCluster of 2
  single-threaded worker processes on 127.0.0.1, the data read through the pipeline, every
  setting at its default; samples/s of an epoch as its History records it
  (``history.epochs[i]["samples_per_s"]``: the driver's wall time of the epoch);
* baseline: ``DistributedDataParallel`` over gloo on 127.0.0.1, 2 spawned processes, the
  whole dataset already in memory as tensors (DDP's best case); every epoch a permutation
  of the rows, shared by both ranks, cut into global batches of 512, of which each rank
  takes its half; an epoch is timed from a barrier to the slower rank's last step.

The first epoch of each side warms up (process start, imports, first connections) and is
not counted: the figure of a repeat is the median samples/s of its later epochs, and the
table gives the median over ``--repeats``. Once, at the first size, both sides' models
after their first epoch are evaluated on the same 4,096 rows, to show that the two train
the same thing (the losses differ a little: the two draw their batches in different
orders).

Run: ``.venv/bin/python benchmarks/e2e.py`` (``--hidden 512 1024 --epochs 3 --repeats
3``; ``--quick``: the small model, 20,000 rows, 2 epochs, once). ``dasktrain bench`` runs it
among the others.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from distributed import Client, LocalCluster
from torch.nn.parallel import DistributedDataParallel

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import (
    Ratio,
    baseline_environment,
    parse_with_quick,
    ratio_of,
    write_ratios,
)

FEATURES, WORKERS, BATCH, LR = 32, 2, 256, 0.01
PROBE_ROWS = 4096
# shared/benchmarks.md, W4: samples/s of a steady epoch, as a ratio to DDP's.
GOAL = "≥ 1.1x"
WHOLE = 1 << 62  # bucket_bytes larger than any model: one bucket, ready when backward ends
QUICK = {"hidden": [512], "rows": 20_000, "epochs": 2, "repeats": 1}


def mlp(width: int) -> torch.nn.Module:
    """32 -> width -> width -> width -> 1, the same initial weights at every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1))


def _arrays(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset at ``path`` in memory: features (N, 32) and targets (N, 1)."""
    ds = dt.open_dataset(path)
    x = ds.zarr_array(ds.features_name)[:]
    y = ds.zarr_array(ds.targets_name)[:]
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def _steady(rates: list[float]) -> float:
    """The figure of one run: the median samples/s of the epochs after the first."""
    return statistics.median(rates[1:])


# -- dasktrain ---------------------------------------------------------------------------
def dasktrain_run(client: Client, data: dt.Dataset, width: int, epochs: int,
                  **options: Any) -> tuple[list[float], dict[str, Any], dict[str, torch.Tensor]]:
    """Fit ``epochs`` epochs in ``sync`` mode: samples/s per epoch, the last epoch's record
    and the parameters after the first epoch."""
    after_first: dict[str, torch.Tensor] = {}

    def keep_first(trainer: dt.Trainer, record: dict[str, Any]) -> None:
        # Runs between epochs, outside the epoch's timed wall.
        if record["epoch"] == 0:
            after_first.update({k: v.detach().clone()
                                for k, v in trainer.model.state_dict().items()})

    trainer = dt.Trainer(functools.partial(mlp, width), torch.nn.functional.mse_loss,
                         dt.optim.sgd(LR), mode="sync", workers=WORKERS, batch_size=BATCH,
                         progress=False, **options)
    history = trainer.fit(data, epochs=epochs, client=client, callbacks=[keep_first])
    return [e["samples_per_s"] for e in history.epochs], history.epochs[-1], after_first


# -- DDP ---------------------------------------------------------------------------------
def _ddp_process(rank: int, port: int, path: str, width: int, epochs: int, out) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                  world_size=WORKERS)
    x, y = _arrays(path)
    rows = len(x)
    model = DistributedDataParallel(mlp(width))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(0)  # the same permutations on both ranks
    rates, after_first = [], None
    for epoch in range(epochs):
        torch_dist.barrier()
        started = time.perf_counter()
        permutation = torch.randperm(rows, generator=order)
        xs, ys = x[permutation], y[permutation]
        for start in range(0, rows, BATCH * WORKERS):
            stop = min(start + BATCH * WORKERS, rows)
            # This rank's half of the global batch (of a short last one too).
            half = -(-(stop - start) // WORKERS)
            lo, hi = start + rank * half, min(start + (rank + 1) * half, stop)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xs[lo:hi]), ys[lo:hi])
            loss.backward()
            optimizer.step()
        wall = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        torch_dist.all_reduce(wall, op=torch_dist.ReduceOp.MAX)  # the slower rank's
        rates.append(rows / wall.item())
        if epoch == 0:
            # As numpy: a tensor would travel as shared memory this process frees at exit.
            after_first = {k: v.detach().numpy().copy()
                           for k, v in model.module.state_dict().items()}
    torch_dist.destroy_process_group()
    if rank == 0:
        out.put((rates, after_first))


def ddp_run(path: str, width: int, epochs: int
            ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train with DDP over gloo in 2 spawned processes: samples/s per epoch and the
    parameters after the first epoch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_process, args=(r, port, path, width, epochs, out))
             for r in range(WORKERS)]
    with baseline_environment():
        for p in procs:
            p.start()
    try:
        rates, after_first = out.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a DDP process failed: exit codes {[p.exitcode for p in procs]}")
    return rates, {k: torch.from_numpy(v) for k, v in after_first.items()}


def probe_loss(width: int, state: dict[str, torch.Tensor] | None, x: torch.Tensor,
               y: torch.Tensor) -> float:
    """MSE on the probe rows of the model with parameters ``state`` (initial if None)."""
    model = mlp(width)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


# -- the run -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024],
                        help="hidden widths of the MLPs (default 512 1024)")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per run, the first one a warm-up (default 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole-gradient", action="store_true",
                        help="also run dasktrain with the gradient sent in one piece after "
                             "backward (bucket_bytes larger than the model): what the "
                             "buckets sent during backward gain")
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: the small model, 20,000 rows, 2 epochs, "
                            "once (rough figures)")
    if args.epochs < 2:
        parser.error(f"--epochs must be at least 2 (the first is a warm-up), got {args.epochs}")
    if args.rows < BATCH * WORKERS:
        parser.error(f"--rows must be at least one global batch ({BATCH * WORKERS}), "
                     f"got {args.rows}")
    if args.rows % (BATCH * WORKERS) == 1:
        parser.error("--rows leaves a last global batch of 1 row, which one of the DDP "
                     "ranks could not share")
    return args


def _describe(width: int) -> tuple[str, int]:
    parameters = sum(p.numel() for p in mlp(width).parameters())
    return (f"32→{width}→{width}→{width}→1 ({parameters / 1e6:.2f} M parameters, "
            f"{parameters * 4 / 1e6:.1f} MB)"), parameters


def ratios(rows: list[tuple]) -> list[Ratio]:
    """The summary rows: per model, our steady samples/s against DDP's."""
    return [Ratio(workload=f"W4 whole run, MLP {parameters / 1e6:.2f} M parameters, sync, "
                           f"2 workers (samples/s)",
                  ours=f"{a:,.0f}", baseline=f"{b:,.0f} (DDP over gloo, data in memory)",
                  ratio=ratio_of(a, b), goal=GOAL)
            for _, parameters, a, b, _ in rows]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rows, notes, check = [], [], None
    one_piece: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dasktrain-w4-") as tmp, \
            LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                         host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        path = str(Path(tmp) / "regression.zarr")
        data = dt.prepare("regression", path, client=client, samples=args.rows,
                          width=FEATURES, progress=False)
        probe_x, probe_y = (a[:PROBE_ROWS] for a in _arrays(path))
        for width in args.hidden:
            label, parameters = _describe(width)
            ours, theirs, whole = [], [], []
            last: dict[str, Any] = {}
            for repeat in range(args.repeats):
                rates, last, ours_first = dasktrain_run(client, data, width, args.epochs)
                ours.append(_steady(rates))
                if args.whole_gradient:
                    whole_rates, *_ = dasktrain_run(client, data, width, args.epochs,
                                                    bucket_bytes=WHOLE)
                    whole.append(_steady(whole_rates))
                    print(f"{label}, repeat {repeat + 1}: gradient in one piece "
                          f"{', '.join(f'{r:,.0f}' for r in whole_rates)}", flush=True)
                ddp_rates, ddp_first = ddp_run(path, width, args.epochs)
                theirs.append(_steady(ddp_rates))
                print(f"{label}, repeat {repeat + 1}: dasktrain "
                      f"{', '.join(f'{r:,.0f}' for r in rates)} samples/s by epoch; DDP "
                      f"{', '.join(f'{r:,.0f}' for r in ddp_rates)}", flush=True)
                if check is None:
                    check = (width, probe_loss(width, None, probe_x, probe_y),
                             probe_loss(width, ours_first, probe_x, probe_y),
                             probe_loss(width, ddp_first, probe_x, probe_y))
            a, b = statistics.median(ours), statistics.median(theirs)
            rows.append((label, parameters, a, b, last))
            if whole:
                one_piece.append(statistics.median(whole))
            notes.append(f"{width}: stall {last['stall']:.1%}, exchange "
                         f"{'+'.join(f'{k} x{v}' for k, v in last['exchange_via'].items())}")
    print("\n| model | dasktrain `sync` (samples/s) | DDP, gloo, data in memory (samples/s) "
          "| ratio | goal |")
    print("|---|---:|---:|---:|---|")
    for label, _, a, b, _ in rows:
        print(f"| {label} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x | {GOAL} |")
    if one_piece:
        print("\n| model | gradient in buckets during backward (default) | in one piece "
              "after backward | buckets gain |")
        print("|---|---:|---:|---:|")
        for (label, _, a, _, _), c in zip(rows, one_piece, strict=True):
            print(f"| {label} | {a:,.0f} | {c:,.0f} | {a / c:.2f}x |")
    width, initial, ours_loss, ddp_loss = check
    print(f"\nSame training: MSE on the first {PROBE_ROWS:,} rows after one epoch, hidden "
          f"{width}: dasktrain {ours_loss:.4f}, DDP {ddp_loss:.4f} (initial {initial:.4f}).")
    print(f"(2 workers x batch {BATCH}, {args.rows:,} rows; steady epoch = median of epochs "
          f"2..{args.epochs}, medians of {args.repeats} repeats; dasktrain's last epoch by "
          f"hidden width: {'; '.join(notes)}; {os.cpu_count()} cores; torch "
          f"{torch.__version__})")
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(rows))


if __name__ == "__main__":
    main()
