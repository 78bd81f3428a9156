"""Gathering many futures with a progress bar, and cancelling them all on any failure."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from distributed import Client, Future, as_completed
from tqdm.auto import tqdm

from dasktrain._watch import PauseWatch
from dasktrain.errors import ClusterStuck

__all__ = ["gather_with_progress", "wait_until_stopped"]

logger = logging.getLogger(__name__)

#: How long a cancelled job may take to let its running tasks finish.
STOP_TIMEOUT = 60.0
#: Between looks at finished tasks while none is (``as_completed``'s own iteration waits
#: 0.1 s), here so that the watch for paused workers runs between looks.
_LOOK = 0.05
#: What a worker running a job's tasks needs, for the message when they cannot run.
TASK_MEMORY_HINT = ("a worker's process needs about 200 MiB for Python and Dask, plus a "
                    "few of the job's chunks at once")


def gather_with_progress(
    client: Client, futures: Sequence[Future], desc: str, progress: bool = True,
    hint: str = TASK_MEMORY_HINT,
) -> list[Any]:
    """Results of ``futures`` in their order, a bar ticking as each finishes.

    The first failure (or a Ctrl-C) cancels whatever is still running, so an aborted job
    does not keep the cluster busy, then re-raises. Workers that stay paused or closing
    while nothing finishes and no other worker runs one of the tasks raise
    :class:`~dasktrain.errors.ClusterStuck` within seconds (``hint``: what a worker of the
    job needs), not a wait without end.
    """
    watch = PauseWatch(client, ClusterStuck, hint)
    pending = {future.key for future in futures}
    try:
        with tqdm(total=len(futures), desc=desc, unit="chunk", disable=not progress,
                  leave=False, dynamic_ncols=True) as bar:
            finished = as_completed(futures, loop=client.loop)
            while not finished.is_empty():
                batch = finished.next_batch(block=False)
                if not batch:
                    watch.check(len(pending), desc, keys=pending)
                    time.sleep(_LOOK)
                    continue
                for future in batch:
                    if future.status != "finished":
                        future.result()  # raises the task's error
                    pending.discard(future.key)
                bar.update(len(batch))
        # One request per worker for all results, rather than a round trip per future.
        results = client.gather(list(futures))
    except BaseException:
        client.cancel(list(futures))
        # A task already running on a worker is not stopped by a cancel: it runs to its
        # end. Callers clean up after a failure (a half-written build), which a task still
        # writing would recreate, so wait for them here (the cluster may well live on).
        wait_until_stopped(client, [f.key for f in futures])
        raise
    return results


def _running(dask_worker: Any, keys: Collection[Any]) -> list[Any]:
    state = dask_worker.state
    return [ts.key for ts in (*state.executing, *state.long_running) if ts.key in keys]


def wait_until_stopped(client: Client, keys: Sequence[Any],
                       timeout: float = STOP_TIMEOUT) -> bool:
    """Wait until no worker is still executing one of ``keys``; ``False`` if some still
    ran after ``timeout`` seconds (or the workers could not be asked)."""
    wanted = set(keys)
    deadline = time.monotonic() + timeout
    while True:
        try:
            running = client.run(_running, keys=wanted, on_error="ignore")
        except Exception:  # the cluster is going away: nothing more to wait for
            logger.debug("could not ask the workers for running tasks", exc_info=True)
            return False
        if not any(running.values()):
            return True
        if time.monotonic() > deadline:
            logger.warning("%d cancelled task(s) still running after %.0f s",
                           sum(len(v) for v in running.values()), timeout)
            return False
        time.sleep(0.05)  # polling the workers, each poll a round trip
