"""One way to get a Dask client: the caller's, an existing cluster's, or an embedded LocalCluster.

Every component that runs work on the cluster (preparation, verification, the pipeline, the
trainer) goes through :func:`cluster_client`, so "no client given" means the same thing
everywhere: the client the user made in this process if there is one, else the process's
one *embedded* LocalCluster on 127.0.0.1, sized for this machine. The embedded cluster
starts on first use (a few seconds), is reused by every later call (a notebook pays the
start-up once, not per ``prepare`` or ``fit``), says once where its Dask dashboard is, and
closes when the process exits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

import dask
import dask.config
from distributed import Client, LocalCluster, default_client

from dasktrain import _embedded_worker
from dasktrain._malloc import ARENA_MAX, MMAP_THRESHOLD, TRIM_THRESHOLD
from dasktrain.errors import DasktrainError

__all__ = [
    "MAX_LOCAL_WORKERS",
    "WORKER_MALLOC_ENVIRONMENT",
    "close_embedded",
    "cluster_client",
    "declares_gpu",
    "default_local_cluster_options",
    "embedded_client",
    "get_client",
    "start_local_cluster",
    "worker_info",
    "worker_malloc_settings",
]

logger = logging.getLogger(__name__)

#: Worker processes of the embedded LocalCluster: one per core, at most this many (more
#: processes on a big machine mostly add memory and start-up time for small jobs).
MAX_LOCAL_WORKERS = 8
#: Seconds a Ctrl-C during the embedded cluster's start waits for it, to close it cleanly.
_START_WAIT = 30.0


#: glibc allocator settings of the embedded cluster's worker processes. distributed starts
#: every worker with ``MALLOC_TRIM_THRESHOLD_=65536``, which also freezes glibc's mmap
#: threshold at 128 KiB: every buffer the size of a chunk (MiBs: rows read, compressed,
#: summarised) is then a fresh mmap, page-faulted in and unmapped again, which made writing a
#: chunk about 1.5x as costly as in a plain process. These are the values glibc's own
#: adaptive thresholds reach in a plain process (mmap from 32 MiB, trim at twice that):
#: chunk-sized buffers are reused, and more than 64 MiB free at the top of a heap still goes
#: back to the system.
#: (Workers of other clusters get them at run time, see :mod:`dasktrain._malloc`.)
#: Each arena keeps up to the trim threshold of freed memory, and glibc makes one per thread
#: that allocates, up to 8 per core: a worker's pipeline and comm threads each left their
#: own, and the process grew epoch after epoch (W13's image epochs). Two arenas bound it.
#: Only at a process's start: a limit set later leaves the arenas already made.
WORKER_MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                             "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
                             "MALLOC_ARENA_MAX": str(ARENA_MAX)}
#: What distributed starts workers with when nobody configured the allocator.
_STOCK_MALLOC = {"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_MMAP_THRESHOLD_": None,
                 "MALLOC_ARENA_MAX": None}


@contextlib.contextmanager
def worker_malloc_settings() -> Iterator[None]:
    """Start the nannies made within with :data:`WORKER_MALLOC_ENVIRONMENT`, unless the user
    configured the allocator (in dask's configuration or the environment).

    distributed takes these variables from ``os.environ`` before its configuration, and
    writes them into ``os.environ`` as it starts a worker; both are put back afterwards.
    """
    config = dict(dask.config.get("distributed.nanny.pre-spawn-environ", None) or {})
    current = {key: os.environ.get(key, config.get(key)) for key in _STOCK_MALLOC}
    if {k: None if v is None else str(v) for k, v in current.items()} != _STOCK_MALLOC:
        yield
        return
    saved = {key: os.environ.get(key) for key in _STOCK_MALLOC}
    os.environ.update(WORKER_MALLOC_ENVIRONMENT)
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ":
                              {**config, **WORKER_MALLOC_ENVIRONMENT}}):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


NO_DASHBOARD: dict = {
    "dashboard_address": None,
    # Without a dashboard the scheduler still serves its HTTP routes, on port 8787 by default,
    # and warns when another cluster holds it: any free loopback port instead.
    "scheduler_kwargs": {"dashboard_address": "127.0.0.1:0"},
}
"""``LocalCluster`` options for clusters that show no dashboard (benchmarks, tests)."""


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
        # The dashboard on loopback only; another process holding 8787 moves it elsewhere.
        "dashboard_address": "127.0.0.1:8787",
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
        Size of the LocalCluster used when neither of the above is given. Without them
        the process's embedded cluster serves (see :func:`embedded_client`), unless the
        user has made a client in this process, which then wins; with them a cluster of
        that size is started for this call and closed after it.
    """
    if client is not None and scheduler is not None:
        raise ValueError("give either client= or scheduler=, not both")
    if client is not None:
        yield client
        return
    if scheduler is not None:
        try:
            # Dask's own connect timeout (``distributed.comm.timeouts.connect``, 30 s by
            # default): an unreachable address is retried that long before failing.
            own = Client(scheduler,
                         timeout=dask.config.get("distributed.comm.timeouts.connect"))
        except OSError as exc:
            raise ConnectionError(
                f"cannot reach the Dask scheduler at {scheduler!r}: {exc}"
            ) from exc
        try:
            yield own
        finally:
            own.close()
        return
    if n_workers is None and memory_limit is None:
        yield get_client()
        return
    with start_local_cluster(n_workers, memory_limit) as cluster, Client(cluster) as own:
        yield own


def get_client() -> Client:
    """The client dasktrain runs on when none is given: the one made in this process, else
    the embedded cluster's (started now if needed). Shown in a notebook, it links to the
    Dask dashboard."""
    return _users_client() or embedded_client()


def _users_client() -> Client | None:
    """The client this process's code made last (``Client(...)`` sets itself as the
    default), if it is still open."""
    try:
        client = default_client()
    except ValueError:
        return None
    return client if client.status == "running" else None


# -- the embedded cluster ------------------------------------------------------------------
_embedded: tuple[LocalCluster, Client] | None = None
_embedded_lock = threading.Lock()


def _announce_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


announce: Callable[[str], None] = _announce_to_stderr
"""Where the one line saying the embedded cluster started (and its dashboard) goes; the
CLI sends it to standard output."""


def embedded_client() -> Client:
    """The client of this process's embedded LocalCluster, started on first use and reused
    by every later call; closed when the process exits (or by :func:`close_embedded`).

    A cluster that has died meanwhile (its scheduler or client closed) is replaced."""
    global _embedded
    with _embedded_lock:
        if _embedded is not None:
            cluster, client = _embedded
            if client.status == "running" and cluster.status.name == "running":
                return client
            _close(cluster, client)
            _embedded = None
        cluster = start_local_cluster()
        # The default client, as a user's own would be: dask computations in a notebook
        # run on it too, and a client the user makes later takes over.
        client = Client(cluster)
        _embedded = (cluster, client)
        workers = len(cluster.workers)
        link = cluster.dashboard_link if cluster.dashboard_link else None
        announce(f"dasktrain: started a local Dask cluster ({workers} worker"
                 f"{'s' if workers != 1 else ''}, reused until exit)"
                 + (f"; dashboard: {link}" if link else ""))
        return client


def close_embedded() -> None:
    """Close the embedded cluster now, if one runs (the next call starts a fresh one)."""
    global _embedded
    with _embedded_lock:
        if _embedded is not None:
            _close(*_embedded)
            _embedded = None


def _close(cluster: LocalCluster, client: Client) -> None:
    with contextlib.suppress(Exception):  # at exit, best effort: the process is ending
        client.close(timeout=10)
    with contextlib.suppress(Exception):
        cluster.close(timeout=10)


# Closed when the main thread ends, before Python shuts down its thread pools: the
# scheduler runs in this process and hands work to one of them (Dask's offload executor),
# and what a client sent last (a pipeline's released work, say) must still find it
# working. An atexit handler runs after those pools refuse work ("cannot schedule new
# futures after shutdown", logged by the scheduler at exit); threading's own exit hooks
# run before, last registered first, and concurrent.futures registered its one on import.
threading._register_atexit(close_embedded)


def start_local_cluster(n_workers: int | None = None,
                        memory_limit: str | float | None = None) -> LocalCluster:
    """The embedded default: a LocalCluster on 127.0.0.1 sized for this machine.

    Its worker processes never get the signals a terminal sends to this process's group
    (Ctrl-C): this process handles them and closes the cluster (see
    :mod:`dasktrain._embedded_worker`).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A worker process re-running a script's top level as it starts (spawn).
        raise DasktrainError(_UNGUARDED_SCRIPT)
    options = default_local_cluster_options(n_workers, memory_limit)
    configured = dask.config.get("distributed.worker.preload", None) or []
    options["preload"] = [*([configured] if isinstance(configured, str) else configured),
                          _embedded_worker.__name__]
    logger.info("starting a LocalCluster with %d worker(s)", options["n_workers"])

    def start() -> LocalCluster:
        with warnings.catch_warnings(), worker_malloc_settings():
            # Another cluster holding port 8787 only moves our (loopback) HTTP server.
            warnings.filterwarnings("ignore", message="Port .* is already in use")
            # The nannies read the environment as they are made, within this call.
            return LocalCluster(**options)

    try:
        return _with_terminal_signals_blocked(start)
    except RuntimeError as exc:
        if _unguarded_script():
            raise DasktrainError(f"the embedded cluster's workers failed to start "
                                 f"({exc}): {_UNGUARDED_SCRIPT}") from exc
        raise


_UNGUARDED_SCRIPT = (
    "a script that uses dasktrain's embedded cluster must keep its work under "
    "`if __name__ == \"__main__\":` (each worker process starts by importing the script, "
    "as for any multiprocessing program)")


def _unguarded_script() -> bool:
    """Whether ``__main__`` is a script run as a file without a main guard (roughly)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as source:
            return "__main__" not in source.read()
    except OSError:
        return False


def _with_terminal_signals_blocked(start: Callable[[], LocalCluster]) -> LocalCluster:
    """``start()`` in a thread that blocks :data:`~dasktrain._embedded_worker.TERMINAL_SIGNALS`.

    The cluster's event loop thread is made within ``start()`` and inherits the block, and
    so do the threads it makes and the worker processes they spawn, now and at every
    restart; each worker unblocks them once it has left this process group. The calling
    thread keeps them unblocked, so it is the one a Ctrl-C interrupts.
    """
    if not hasattr(signal, "pthread_sigmask"):
        return start()
    started: concurrent.futures.Future[LocalCluster] = concurrent.futures.Future()

    def run() -> None:
        # multiprocessing unblocks these signals in the thread that starts its resource
        # tracker (which protects itself the same way): start it here, before the block.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, _embedded_worker.TERMINAL_SIGNALS)
        try:
            started.set_result(start())
        except BaseException as exc:
            started.set_exception(exc)

    threading.Thread(target=run, name="dasktrain-cluster-start", daemon=True).start()
    try:
        return started.result()
    except KeyboardInterrupt:
        # A start cannot be cut short: let it end (a second Ctrl-C does not wait) and close
        # what it made, so that none of it outlives the interrupted call or talks after it.
        with contextlib.suppress(Exception):
            started.result(timeout=_START_WAIT).close(timeout=10)
        raise


def declares_gpu(info: dict) -> bool:
    """Whether a worker (its :func:`worker_info` entry) declares a ``GPU`` resource: the
    workers that run model replicas on a GPU cluster."""
    return "GPU" in (info.get("resources") or {})


def worker_info(client: Client) -> dict[str, dict]:
    """Per-worker information (address -> info), asked of the scheduler now.

    Not ``client.scheduler_info()``: it returns a cached dict that the client's periodic
    refresh, which carries no per-worker details, may overwrite between the fetch and the
    read — a live worker would then look gone.
    """
    return client.sync(client.scheduler.identity, n_workers=-1).get("workers", {})
