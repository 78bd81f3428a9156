"""How do I average minibatch gradients across P processes? With dasktrain's ``sync`` mode.

y = x^2 on N = 50 points of [-1, 1], a 1-5-1 tanh network, plain SGD at lr 1e-2:

1. trained in one process, minibatches of P x b samples;
2. trained by P workers on a Dask cluster in ``sync`` mode, b samples each per step — the
   holder averages their gradients (weighted by batch size) and takes one step, which is
   exactly the one-process step on the union of their batches: the two agree;
3. trained by P workers in ``async`` mode: every gradient is applied as it arrives, on
   parameters that may have moved on since (its staleness is recorded).

    .venv/bin/python examples/parabola.py [--workers P] [--batch-size b] [--epochs E]

A LocalCluster on 127.0.0.1 is started for the run and closed at the end.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from distributed import Client

import dasktrain as dt
from dasktrain._cluster import start_local_cluster

LR = 1e-2


def network() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initialisation for the one-process run and the holder
    return torch.nn.Sequential(torch.nn.Linear(1, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target.reshape(output.shape))


def one_process(data: dt.Dataset, batch_size: int, epochs: int, client: Client
                ) -> torch.nn.Module:
    """The textbook loop, fed the same global order of samples."""
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    pipe = dt.Pipeline(data, batch_size, seed=0, client=client)
    for _ in range(epochs):
        for x, y in pipe:
            optimizer.zero_grad()
            mse(model(x), y).backward()
            optimizer.step()
    return model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="P (default 2)")
    parser.add_argument("--batch-size", type=int, default=5, help="b, per worker (default 5)")
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    p, b = args.workers, args.batch_size
    with tempfile.TemporaryDirectory() as tmp, start_local_cluster() as cluster, \
            Client(cluster) as client:
        data = dt.prepare("parabola", Path(tmp) / "parabola.zarr", client=client,
                          progress=False)
        print(f"y = x^2 on {len(data)} points; 1-5-1 tanh network; SGD lr={LR}; "
              f"{args.epochs} epochs")

        reference = one_process(data, p * b, args.epochs, client)
        ref_loss = dt.Trainer(reference, mse, dt.optim.sgd(LR), progress=False).evaluate(
            data, client=client)["loss"]
        print(f"one process, batches of {p * b}:        final loss {ref_loss:.6f}")

        for mode in ("sync", "async"):
            trainer = dt.Trainer(network, mse, dt.optim.sgd(LR), mode=mode, workers=p,
                                 batch_size=b, progress=False)
            history = trainer.fit(data, epochs=args.epochs, client=client)
            loss = trainer.evaluate(data, client=client)["loss"]
            summary = history.summary()
            line = (f"{mode:5s}, {p} workers x {b} samples/step: final loss {loss:.6f}, "
                    f"{summary['updates']} updates, {summary['samples_per_s']:.0f} samples/s")
            if mode == "sync":
                gap = (flat(trainer.model) - flat(reference)).abs().max().item()
                line += f", max |parameter - one-process parameter| = {gap:.2e}"
                assert gap < 1e-5, f"sync should equal one process, differs by {gap}"
            else:
                line += (f", staleness mean {summary['mean_staleness']:.2f} "
                         f"max {summary['max_staleness']}")
            print(line)


if __name__ == "__main__":
    main()
