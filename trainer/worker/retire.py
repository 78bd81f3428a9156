"""A trainer worker whose Dask worker is retired hands back its work before the process
goes.

``client.retire_workers`` (or a scale-down) closes a Dask worker at once when it holds no
data: the task running there is cancelled and the process exits, so a trainer worker
would only be noticed as dead. :class:`RetireWatch`, a worker plugin registered for elastic
runs, is torn down while the worker closes, before its services stop: it tells the trainer
workers of the process (:func:`retiring`) and waits, a few seconds at most, until each has
finished the batch in hand and left the holder, which puts what it claimed back in the
pool (see :mod:`dasktrain.trainer.holder.ledger`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from distributed import get_worker
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["RetireWatch", "retiring", "training"]

#: Seconds a closing worker waits for its trainer workers to leave.
LEAVE_WITHIN = 10.0

_closing = threading.Event()
_running = 0
_lock = threading.Lock()


class training:
    """Counts a trainer worker of this process while it trains (until it has left)."""

    def __enter__(self) -> training:
        global _running
        with _lock:
            _running += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _running
        with _lock:
            _running -= 1


#: Dask's loggers that report a retirement's expected steps as if they were failures.
_NOISY = ("distributed.worker.state_machine", "distributed.worker", "distributed.nanny")
_CLOSING = (Status.closing_gracefully, Status.closing, Status.closed)


class _RetirementNoise(logging.Filter):
    """Drops, in a worker process that is closing (retired, scaled down), what Dask logs
    of it as if it failed: that a trainer task was cancelled (the worker cancels its tasks
    as it closes, while the trainer hands back its work and leaves: the History says so),
    the shutdown notices of a heartbeat sent after the scheduler let the worker go, and
    "Worker process died unexpectedly" from the thread that waits for the nanny's stop
    message when the process ends first."""

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        if not (_closing.is_set() or getattr(self.worker, "status", None) in _CLOSING):
            return True
        message = record.getMessage()
        return not (("dasktrain-trainer" in message and "cancelled" in message.lower())
                    or "Scheduler was unaware of this worker" in message
                    or "Worker process died unexpectedly" in message)


def retiring() -> bool:
    """This process's Dask worker is closing (retired, scaled down): stop and leave."""
    if _closing.is_set():
        return True
    try:
        status = get_worker().status
    except ValueError:
        return False
    return status in (Status.closing_gracefully, Status.closing)


class RetireWatch(WorkerPlugin):
    """Holds a closing worker open until its trainer workers have left (see above)."""

    name = "dasktrain-retire-watch"

    def setup(self, worker: Any) -> None:
        _closing.clear()
        for name in _NOISY:
            logger = logging.getLogger(name)
            for old in [f for f in logger.filters if isinstance(f, _RetirementNoise)]:
                logger.removeFilter(old)
            logger.addFilter(_RetirementNoise(worker))

    async def teardown(self, worker: Any) -> None:
        _closing.set()
        # Torn down as the worker closes (not replaced by the next fit's plugin): the
        # scheduler has let it go, and a heartbeat now would only make it say that it
        # does not know the worker, and the worker that it shuts down.
        heartbeat = getattr(worker, "periodic_callbacks", {}).get("heartbeat")
        if heartbeat is not None and getattr(worker, "status", None) in _CLOSING:
            heartbeat.stop()
        deadline = time.monotonic() + LEAVE_WITHIN
        while _running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the trainer threads call the holder via this loop
