"""Every update mode on the bundled digits: accuracy, speed, and one comparison figure.

Prepare the dataset with the CLI, then run:

    dasktrain prepare digits data/digits.zarr --split train=0.8,val=0.2 --normalize
    .venv/bin/python examples/digits.py data/digits.zarr [--out runs/digits] [--epochs 12]

A small MLP (64 -> 128 -> 10) is trained by 2 replicas in each mode — ``sync``,
``average`` (local SGD), ``soft`` (apply after the first gradient of two), ``ssp``
(bounded staleness), ``async``, and ``async`` with DC-ASGD — with the same optimizer,
global batch and epochs. It prints a table (validation accuracy, loss, updates, samples/s,
data stall, staleness) and writes to ``--out``: ``compare.png`` (every mode on the same
axes), one run report per mode (``<mode>/index.html``) and each mode's History
(``<mode>/history.json``). With ``--scheduler`` it runs on an existing cluster instead of
the embedded LocalCluster.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import dasktrain as dt

#: (label, mode, mode options): the whole family, each with options that suit 2 workers.
MODES: list[tuple[str, str, dict]] = [
    ("sync", "sync", {}),
    ("average", "average", {"average_every": 4}),
    ("soft", "soft", {"wait_for": 1}),
    ("ssp", "ssp", {"staleness_bound": 2}),
    ("async", "async", {}),
    ("async+dc", "async", {"dc_lambda": 0.04}),
]


def classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", default="data/digits.zarr")
    parser.add_argument("--out", default="runs/digits", help="figures and reports go here")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--modes", default=",".join(label for label, *_ in MODES),
                        help="comma-separated subset of the modes")
    parser.add_argument("--scheduler", default=None, help="an existing cluster's address")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wanted = args.modes.split(",")
    unknown = set(wanted) - {label for label, *_ in MODES}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    data = dt.open_dataset(args.dataset)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    client = None
    if args.scheduler:
        from distributed import Client

        client = Client(args.scheduler)
    histories: dict[str, dt.History] = {}
    print(f"{'mode':9s} {'val acc':>7s} {'val loss':>8s} {'updates':>7s} {'samples/s':>9s} "
          f"{'stall':>6s} {'staleness':>9s} {'time':>6s}")
    for label, mode, options in MODES:
        if label not in wanted:
            continue
        trainer = dt.Trainer(classifier, torch.nn.functional.cross_entropy,
                             dt.optim.sgd(0.05, momentum=0.9), mode=mode,
                             workers=args.workers, batch_size=args.batch_size,
                             progress=False, **options)
        started = time.perf_counter()
        history = trainer.fit(data.split("train"), epochs=args.epochs,
                              validation=data.split("val"), client=client)
        took = time.perf_counter() - started
        histories[label] = history
        summary = history.summary()
        last = history.epochs[-1]
        stall = sum(e["stall"] for e in history.epochs) / len(history.epochs)
        print(f"{label:9s} {last['validation']['accuracy']:7.1%} "
              f"{last['validation']['loss']:8.4f} {summary['updates']:7d} "
              f"{summary['samples_per_s']:9.0f} {stall:6.1%} "
              f"{summary['mean_staleness']:9.2f} {took:5.1f}s")
        history.save(out / label / "history.json")
        history.report(out / label)
    figure = out / "compare.png"
    dt.compare(histories, path=figure)
    print(f"comparison figure: {figure}")
    print(f"run reports: {', '.join(str(out / label / 'index.html') for label in histories)}")
    if client is not None:
        client.close()


if __name__ == "__main__":
    main()
