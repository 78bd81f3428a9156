from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import dask
import pytest
import torch
from distributed import Client, LocalCluster, WorkerPlugin
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


# A worker that stops answering is let go after a minute, not Dask's five: its work then runs
# again on the others within a test's timeout. Before that, its threads' stacks are written
# (see _Unanswering) and the run's summary shows them.
dask.config.set({"distributed.scheduler.worker-ttl": "60s"})
_SILENT = 30.0  # seconds without a heartbeat before a worker's stacks are written
_STACKS = "DASKTRAIN_TEST_WORKER_STACKS"  # where they are written: a folder for the run


class _StacksOnSignal(WorkerPlugin):
    """Each worker writes every thread's stack to a file of its own on SIGUSR1."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def setup(self, worker) -> None:
        path = os.path.join(self.directory, f"worker-{os.getpid()}.txt")
        self._file = open(path, "w")  # noqa: SIM115 (written to until the process ends)
        faulthandler.register(signal.SIGUSR1, file=self._file, all_threads=True)


class _Unanswering(threading.Thread):
    """Asks each worker of ``cluster`` that has sent no heartbeat for :data:`_SILENT`
    seconds for its stacks, once: what a frozen worker was doing, for the summary."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(name="dasktrain-test-unanswering", daemon=True)
        self.cluster = cluster
        self.stop = threading.Event()
        self.asked: set[int] = set()

    def run(self) -> None:
        while not self.stop.wait(5.0):
            try:
                workers = list(self.cluster.scheduler.workers.values())
            except RuntimeError:  # changed while read: the next look
                continue
            for ws in workers:
                if time.time() - ws.last_seen > _SILENT and ws.pid not in self.asked:
                    self.asked.add(ws.pid)
                    with contextlib.suppress(OSError):
                        os.kill(ws.pid, signal.SIGUSR1)


@pytest.fixture(scope="session")
def client():
    """One real-process cluster for the whole session: two single-threaded workers."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        c.register_plugin(_StacksOnSignal(os.environ[_STACKS]))
        watch = _Unanswering(cluster)
        watch.start()
        yield c
        watch.stop.set()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process: the suite's processes
        os.environ[_STACKS] = tempfile.mkdtemp(prefix="dasktrain-stacks-")  # inherit it


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _STACKS not in os.environ:
        return
    for path in sorted(Path(os.environ[_STACKS]).glob("worker-*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            terminalreporter.section(f"a test cluster's worker that stopped answering "
                                     f"({path.stem}): its threads")
            terminalreporter.write_line(text)


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
