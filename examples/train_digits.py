"""Train a digit classifier with two model replicas on a Dask cluster, in sync and async mode.

Run after ``dasktrain prepare digits data/digits.zarr --split train=0.8,val=0.2 --normalize``:

    .venv/bin/python examples/train_digits.py data/digits.zarr [--scheduler tcp://host:8786]

Without ``--scheduler`` the embedded LocalCluster (127.0.0.1, one worker process per core)
is started.
"""

from __future__ import annotations

import argparse

import torch

import dasktrain as dt
from dasktrain._cluster import cluster_client


def classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", default="data/digits.zarr")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--scheduler", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = dt.open_dataset(args.dataset)
    with cluster_client(scheduler=args.scheduler) as client:
        for mode in ("sync", "async"):
            trainer = dt.Trainer(classifier, torch.nn.functional.cross_entropy,
                                 dt.optim.sgd(0.05, momentum=0.9), mode=mode,
                                 workers=args.workers, batch_size=args.batch_size,
                                 progress=False)
            history = trainer.fit(data.split("train"), epochs=args.epochs,
                                  validation=data.split("val"), client=client)
            for record in history.epochs:
                print(f"{mode:5s} epoch {record['epoch']}: "
                      f"val loss {record['validation']['loss']:.4f} "
                      f"val accuracy {record['validation']['accuracy']:.3f} "
                      f"{record['samples_per_s']:.0f} samples/s "
                      f"data stall {record['stall']:.1%}")
            s = history.summary()
            print(f"{mode:5s} done: {s['updates']} updates, final train loss "
                  f"{s['final_loss']:.4f}, {s['samples_per_s']:.0f} samples/s, staleness "
                  f"mean {s['mean_staleness']:.2f} max {s['max_staleness']}, "
                  f"{s['refused_gradients']} refused gradients")


if __name__ == "__main__":
    main()
