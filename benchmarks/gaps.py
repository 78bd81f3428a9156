"""Between-epoch gaps: how long a trainer worker trains nothing from one epoch to the next,
in an elastic fit (``workers=(2, 3)``) against the same fit on a fixed two workers.

What it measures
----------------
The digits demo's fit (``examples/digits.toml``: the MLP 64 -> 128 -> 10, SGD with
momentum 0.9, batch 32 per worker, validation after every epoch) on the LocalCluster that
``dt.Trainer`` starts for a new user (2 cores here: two workers), in ``sync`` and
``async``, with ``workers=(2, 3)`` (the run follows the cluster) and with ``workers=2``.
A gap is the History's ``gap_s`` of each worker in each epoch after the first: from the
worker's last batch of the epoch before to its first of this one (the boundary's snapshot,
validation and checkpoint happen meanwhile, on the driver). Printed: the median and the
largest gap over every worker and epoch; the ratio is the
elastic fit's median against the fixed fit's. Goal: an elastic fit's median gap ≤ 5 ms.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/gaps.py               # ~20 s on 2 cores
    .venv/bin/python benchmarks/gaps.py --quick       # 5 epochs: rough figures
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import dasktrain as dt
from dasktrain.cli.bench import Ratio, parse_with_quick, write_ratios

GOAL_MS = 5.0


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(1) == target).float().mean()


def gaps_ms(history: dt.History) -> list[float]:
    """Every worker's gap before each epoch after the first, in ms."""
    return [w["gap_s"] * 1000 for record in history.epochs[1:]
            for w in record["per_worker"] if w.get("gap_s") is not None]


def one_fit(data: dt.Dataset, mode: str, workers: int | tuple[int, int], epochs: int
            ) -> dict[str, float]:
    trainer = dt.Trainer(mlp, torch.nn.functional.cross_entropy,
                         dt.optim.sgd(0.05, momentum=0.9), mode=mode, workers=workers,
                         batch_size=32, metrics={"accuracy": accuracy}, progress=False)
    history = trainer.fit(data.split("train"), epochs=epochs, validation=data.split("val"))
    gaps = gaps_ms(history)
    return {"median": statistics.median(gaps), "max": max(gaps)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    args = parse_with_quick(parser, argv, {"epochs": 5}, "5 epochs: rough figures")
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        data = dt.prepare("digits", Path(scratch) / "digits.zarr",
                          split="train=0.8,val=0.2", normalize=True, progress=False)
        for mode in args.modes:
            elastic = one_fit(data, mode, (2, 3), args.epochs)
            fixed = one_fit(data, mode, 2, args.epochs)
            for name, figures in (("workers=(2, 3)", elastic), ("workers=2", fixed)):
                print(f"{mode:5s} {name:15s} gap median {figures['median']:5.1f} ms, "
                      f"max {figures['max']:5.1f} ms", flush=True)
            rows.append(Ratio(
                workload=f"between-epoch gap, digits, {mode}, workers=(2, 3) (ms, median)",
                ours=f"{elastic['median']:.1f}", baseline=f"{fixed['median']:.1f} (workers=2)",
                ratio=elastic["median"] / fixed["median"], goal=f"≤ {GOAL_MS:g} ms"))
    if args.ratios_json:
        write_ratios(args.ratios_json, rows)


if __name__ == "__main__":
    main()
