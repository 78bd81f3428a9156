from __future__ import annotations

import pytest
import torch
from distributed import Client, LocalCluster

import dasktrain as dt

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def client():
    """One real-process cluster for the whole session: two single-threaded workers."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


@pytest.fixture(scope="session")
def regression(client, tmp_path_factory):
    """A small regression dataset (320 rows x 4 features, chunks of 80), read only; modules
    that need another size define their own ``regression``."""
    out = tmp_path_factory.mktemp("regression") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=320, width=4, chunk_rows=80,
                      seed=5, progress=False)
