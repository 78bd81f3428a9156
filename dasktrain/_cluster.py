"""One way to get a Dask client: the caller's, an existing cluster's, or an embedded LocalCluster.

Every component that runs work on the cluster (preparation, verification, the pipeline, the
trainer) goes through :func:`cluster_client`, so "no client given" means the same thing
everywhere: a LocalCluster on 127.0.0.1 sized for this machine, closed when the work is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

from distributed import Client, LocalCluster

__all__ = ["MAX_LOCAL_WORKERS", "cluster_client", "default_local_cluster_options",
           "start_local_cluster", "worker_info"]

logger = logging.getLogger(__name__)

#: Worker processes of the embedded LocalCluster: one per core, at most this many (more
#: processes on a big machine mostly add memory and start-up time for small jobs).
MAX_LOCAL_WORKERS = 8


def default_local_cluster_options(
    n_workers: int | None = None, memory_limit: str | float | None = None
) -> dict:
    """Options for the embedded LocalCluster: one single-threaded worker process per core
    (at most :data:`MAX_LOCAL_WORKERS`).

    One thread per process keeps numpy/torch from oversubscribing the cores, and processes
    (not threads) keep the GIL out of the data path.
    """
    cores = os.cpu_count() or 1
    options: dict = {
        "n_workers": n_workers or max(1, min(cores, MAX_LOCAL_WORKERS)),
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": None,
        "silence_logs": logging.ERROR,
    }
    if memory_limit is not None:
        options["memory_limit"] = memory_limit
    return options


@contextlib.contextmanager
def cluster_client(
    client: Client | None = None,
    scheduler: str | None = None,
    *,
    n_workers: int | None = None,
    memory_limit: str | float | None = None,
) -> Iterator[Client]:
    """Yield a client to run work on, closing only what this call started.

    Parameters
    ----------
    client
        A client the caller owns; used as it is and left open.
    scheduler
        Address of an existing scheduler (``tcp://host:8786``); connected to and disconnected
        from, the cluster itself is left running.
    n_workers, memory_limit
        Size of the embedded LocalCluster started when neither of the above is given.
    """
    if client is not None and scheduler is not None:
        raise ValueError("give either client= or scheduler=, not both")
    if client is not None:
        yield client
        return
    if scheduler is not None:
        try:
            own = Client(scheduler, timeout="20s")
        except OSError as exc:
            raise ConnectionError(
                f"cannot reach the Dask scheduler at {scheduler!r}: {exc}"
            ) from exc
        try:
            yield own
        finally:
            own.close()
        return
    with start_local_cluster(n_workers, memory_limit) as cluster, Client(cluster) as own:
        yield own


def start_local_cluster(n_workers: int | None = None,
                        memory_limit: str | float | None = None) -> LocalCluster:
    """The embedded default: a LocalCluster on 127.0.0.1 sized for this machine."""
    options = default_local_cluster_options(n_workers, memory_limit)
    logger.info("starting a LocalCluster with %d worker(s)", options["n_workers"])
    with warnings.catch_warnings():
        # Another cluster holding port 8787 only moves our (loopback) HTTP server elsewhere.
        warnings.filterwarnings("ignore", message="Port .* is already in use")
        return LocalCluster(**options)


def worker_info(client: Client) -> dict[str, dict]:
    """Per-worker information (address -> info), asked of the scheduler now.

    Not ``client.scheduler_info()``: it returns a cached dict that the client's periodic
    refresh, which carries no per-worker details, may overwrite between the fetch and the
    read — a live worker would then look gone.
    """
    return client.sync(client.scheduler.identity, n_workers=-1).get("workers", {})
