from __future__ import annotations

import pytest
import torch
from distributed import Client, LocalCluster

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def client():
    """One real-process cluster for the whole session: two single-threaded workers."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c
