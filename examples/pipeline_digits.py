"""Feed a small torch model from the digits dataset through dasktrain's pipeline.

Run after ``dasktrain prepare digits data/digits.zarr --split train=0.8,val=0.2 --normalize``:

    .venv/bin/python examples/pipeline_digits.py data/digits.zarr

The pipeline uses the embedded LocalCluster (127.0.0.1), since no client is given.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import dasktrain as dt


def jitter(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Augmentation that runs on the Dask workers, reproducible from (seed, epoch, block)."""
    noise = rng.standard_normal(arrays["x"].shape).astype(np.float32)
    arrays["x"] = arrays["x"] + 0.05 * noise
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", default="data/digits.zarr")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds = dt.open_dataset(args.dataset)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with dt.Pipeline(ds.split("train"), batch_size=64, seed=0, transform=jitter,
                     block_rows=512) as train, \
            dt.Pipeline(ds.split("val"), batch_size=128, shuffle=False) as val:
        for epoch in range(args.epochs):
            model.train()
            losses = []
            for x, y in train:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            model.eval()
            with torch.no_grad():
                correct = sum((model(x).argmax(1) == y).sum().item() for x, y in val)
            stats = train.stats.summary()
            print(f"epoch {epoch}: loss {np.mean(losses):.3f}  val accuracy "
                  f"{correct / len(ds.split('val')):.3f}  {stats['samples_per_s']:,.0f} samples/s "
                  f"stall {stats['stall']:.1%}")


if __name__ == "__main__":
    main()
