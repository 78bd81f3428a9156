"""Train on an existing Dask cluster: prepare (or open) a dataset on shared storage, fit with
checkpoints, save the model.

Start the cluster (see start_scheduler.sh and start_workers.sh), then from any machine that
reaches the scheduler and the shared storage:

    python examples/cluster/train.py --scheduler tcp://SCHEDULER:8786 --shared /mnt/shared/dt

Over TLS (make_certs.sh, and the scripts started with TLS_DIR=certs):

    python examples/cluster/train.py --scheduler tls://SCHEDULER:8786 --shared /mnt/shared/dt \\
        --tls-ca-file certs/ca.pem --tls-cert certs/cert.pem --tls-key certs/key.pem

The workers read the dataset's chunks themselves, so ``--shared`` must be the same path on
every worker and on this machine (an NFS mount, say). Checkpoints and the model are written
by this script's process; on shared storage a run can be resumed from another machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from distributed import Client, Security

import dasktrain as dt

FEATURES = 16


def regressor() -> torch.nn.Module:
    """The model: called once on the parameter holder, which every replica starts from."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def connect(args: argparse.Namespace) -> Client:
    """A client of the cluster at ``--scheduler``, over TLS when certificates are given."""
    security = None
    if args.tls_ca_file:
        # The client presents a certificate of the cluster's CA too: TLS in Dask is mutual.
        security = Security(tls_ca_file=args.tls_ca_file, tls_client_cert=args.tls_cert,
                            tls_client_key=args.tls_key, require_encryption=True)
    return Client(args.scheduler, security=security, timeout="30s")


def dataset(path: Path, samples: int, client: Client) -> dt.Dataset:
    """The dataset at ``path``, prepared there first if nothing is there yet (atomic: an
    interrupted preparation leaves nothing behind, and the next run starts again)."""
    if path.exists():
        return dt.open_dataset(path)
    return dt.prepare("regression", path, client=client, samples=samples, width=FEATURES,
                      split="train=0.9,val=0.1", normalize=True, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", required=True,
                        help="address of the cluster's scheduler, tcp://HOST:8786")
    parser.add_argument("--shared", type=Path, default=Path("shared"),
                        help="directory every worker and this machine see at the same path")
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="model replicas")
    parser.add_argument("--batch-size", type=int, default=64, help="per replica")
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--holder-worker", metavar="ADDRESS",
                        help="worker to hold the parameters (default: the one with most memory)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint of an earlier run")
    parser.add_argument("--tls-ca-file", help="CA certificate (PEM) of a TLS cluster")
    parser.add_argument("--tls-cert", help="this client's certificate (PEM)")
    parser.add_argument("--tls-key", help="this client's private key (PEM)")
    args = parser.parse_args()
    if bool(args.tls_ca_file) != bool(args.tls_cert):
        parser.error("TLS needs both --tls-ca-file and --tls-cert (and usually --tls-key)")
    torch.set_num_threads(1)
    runs = args.shared / "runs" / "regression"

    with connect(args) as client:
        data = dataset(args.shared / "regression.zarr", args.samples, client)
        trainer = dt.Trainer(regressor, torch.nn.functional.mse_loss, dt.optim.adam(3e-3),
                             mode=args.mode,
                             workers=args.workers, batch_size=args.batch_size,
                             holder_worker=args.holder_worker, progress=False)
        history = trainer.fit(data.split("train"), epochs=args.epochs,
                              validation=data.split("val"), client=client,
                              checkpoint=runs / "checkpoint",
                              resume=runs / "checkpoint" if args.resume else None)
    for record in history.epochs:
        print(f"epoch {record['epoch']}: val loss {record['validation']['loss']:.4f}, "
              f"{record['samples_per_s']:.0f} samples/s, data stall {record['stall']:.1%}")
    print(f"train loss {history.loss[0]:.4f} at the first update, {history.loss[-1]:.4f} at "
          f"the last")
    print(f"saved the model to {trainer.save(runs / 'model.pt')}")


if __name__ == "__main__":
    main()
