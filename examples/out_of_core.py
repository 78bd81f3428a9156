"""Train on a dataset several times larger than the workers' memory, streamed while training.

A synthetic regression dataset (default 2.6 GiB: 2,800,000 rows x 250 float32 features) is
prepared on a LocalCluster whose workers may each use only ``--memory-limit`` (default
800 MB, so the dataset is ~3.5x one worker's limit and larger than the whole cluster's
memory), then a model is trained on it for one epoch in ``sync`` mode while the pipeline
streams blocks from disk. A watcher samples every worker's memory twice a second; at the
end the example prints the workers' peak memory next to their limit and the data-stall
fraction of the epoch (the share of time the model waited for data):

    .venv/bin/python examples/out_of_core.py [--rows 2800000] [--memory-limit 800MB]

``--rows 60000`` runs in seconds (what the smoke test does).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch
from dask.utils import format_bytes, parse_bytes
from distributed import Client

import dasktrain as dt
from dasktrain._cluster import cluster_client

WIDTH = 250


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target.reshape(output.shape))


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class PeakMemory:
    """Samples every worker's resident memory in a background thread until stopped."""

    def __init__(self, client: Client, every: float = 0.5) -> None:
        self.client = client
        self.every = every
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            try:
                sizes = self.client.run(_rss, wait=True, on_error="return")
            except Exception:  # a sample missed while the cluster is busy: try again
                continue
            for worker, size in sizes.items():
                if isinstance(size, int):
                    self.peak[worker] = max(self.peak.get(worker, 0), size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_800_000)
    parser.add_argument("--memory-limit", default="800MB", help="per worker process; a "
                        "trainer worker needs ~0.5 GB (torch, the model, its blocks)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--batch-size", type=int, default=512, help="per trainer worker")
    parser.add_argument("--dir", default=None, help="where to write the dataset "
                                                    "(default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    limit = parse_bytes(args.memory_limit)
    size = args.rows * (WIDTH + 1) * 4
    print(f"dataset: {args.rows:,} rows x {WIDTH} features = {format_bytes(size)}; "
          f"memory limit {format_bytes(limit)} per worker x {args.workers} workers "
          f"({size / limit:.1f}x one worker's limit)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, \
            cluster_client(n_workers=args.workers, memory_limit=limit) as client:
        started = time.perf_counter()
        data = dt.prepare("regression", os.path.join(tmp, "big.zarr"), client=client,
                          samples=args.rows, width=WIDTH, noise=0.1, progress=False)
        print(f"prepared in {time.perf_counter() - started:.1f} s "
              f"({data.chunk_rows:,} rows per chunk)")
        trainer = dt.Trainer(model, mse, dt.optim.adam(1e-3), mode="sync",
                             workers=args.workers, batch_size=args.batch_size,
                             progress=False)
        with PeakMemory(client) as memory:
            history = trainer.fit(data, epochs=1, client=client)
        epoch = history.epochs[-1]
        print(f"trained 1 epoch in {epoch['wall_s']:.1f} s: {epoch['samples_per_s']:,.0f} "
              f"samples/s, loss {history.loss[0]:.3f} -> {history.loss[-1]:.3f}")
        print(f"data stall: {epoch['stall']:.1%} of the epoch")
        for worker, peak in sorted(memory.peak.items()):
            print(f"peak memory {worker}: {format_bytes(peak)} of {format_bytes(limit)} "
                  f"({peak / limit:.0%})")


if __name__ == "__main__":
    main()
