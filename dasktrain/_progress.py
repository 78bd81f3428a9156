"""Gathering many futures with a progress bar, and cancelling them all on any failure."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from distributed import Client, Future, as_completed
from tqdm.auto import tqdm

__all__ = ["gather_with_progress", "wait_until_stopped"]

logger = logging.getLogger(__name__)

#: How long a cancelled job may take to let its running tasks finish.
STOP_TIMEOUT = 60.0


def gather_with_progress(
    client: Client, futures: Sequence[Future], desc: str, progress: bool = True
) -> list[Any]:
    """Results of ``futures`` in their order, a bar ticking as each finishes.

    The first failure (or a Ctrl-C) cancels whatever is still running, so an aborted job
    does not keep the cluster busy, then re-raises.
    """
    try:
        with tqdm(total=len(futures), desc=desc, unit="chunk", disable=not progress,
                  leave=False, dynamic_ncols=True) as bar:
            for future in as_completed(futures, loop=client.loop):
                if future.status != "finished":
                    future.result()  # raises the task's error
                bar.update(1)
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
