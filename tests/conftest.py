from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

import dask
import pytest
import torch
from distributed import Client, LocalCluster
from distributed.utils import get_mp_context

import dasktrain as dt

torch.set_num_threads(1)

# The clusters the tests start fork their worker processes from a server that has imported
# torch and dasktrain once (as distributed's own suite does, with fewer modules), instead of
# spawning each and importing them again: a killed worker is back in a fraction of a second,
# and starting clusters no longer takes most of the suite's time. Commands run as
# subprocesses (the CLI, examples, benchmarks) start theirs as a user's would.
dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
get_mp_context()  # sets distributed's own preload list first; ours replaces it
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["distributed", "numpy", "pandas", "zarr", "dask.array", "torch", "dasktrain"])
# pyarrow (pandas and dasktrain import it) starts jemalloc's background thread as it loads.
# A process forked while another thread runs inherits that thread's locks but not the
# thread: the server starts with it off, so each worker is forked from one thread alone.
_jemalloc_conf = os.environ.get("JE_ARROW_MALLOC_CONF")
os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
try:
    multiprocessing.forkserver.ensure_running()
finally:  # the tests' own processes and subprocesses keep pyarrow's setting
    if _jemalloc_conf is None:
        del os.environ["JE_ARROW_MALLOC_CONF"]
    else:
        os.environ["JE_ARROW_MALLOC_CONF"] = _jemalloc_conf


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


# The heaviest modules, heaviest first (by their time in a full run on 2 cores, 2026-11-30). The
# suite's processes take whole modules in collection order; with these first, the last
# modules handed out are short ones, and no process waits alone on a long one at the end.
HEAVIEST = ["test_bench_e2e", "test_doc_blocks", "test_examples", "test_cli", "test_chaos",
            "test_bench", "test_cluster_scripts", "test_trainer_messages", "test_bench_arrays",
            "test_embedded_cluster", "test_dynamic_work", "test_elastic",
            "test_object_storage", "test_bench_scale", "test_cli_train",
            "test_prepare_failures", "test_hosts", "test_bench_soak", "test_images",
            "test_trainer_failures", "test_prepare_parquet"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: order kept
