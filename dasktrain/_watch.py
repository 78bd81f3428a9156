"""Noticing, within seconds, a cluster on which a job's tasks cannot run.

Dask's memory manager pauses a worker whose process passes the pause fraction of its memory
limit (80 % by default): it keeps serving but starts no task, and it stays paused for as long
as its memory stays there, which for memory the process does not give back is for ever. A
job waiting on such a worker would wait until its own timeout, or without end. Whoever waits
(the trainer's driver, a preparation's gather) asks the scheduler about once a second whether
a worker is paused or closing; if one stays so for a few seconds while the job makes no
progress, the job stops with the memory figures and what to change.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import dask
from distributed import Client

from dasktrain._cluster import worker_info

__all__ = ["STUCK_STATES", "PauseWatch", "describe_stuck"]

#: Worker states in which a worker starts no task.
STUCK_STATES = ("paused", "closing", "closing_gracefully", "closed")


def _mib(value: Any) -> str:
    return f"{value / 2**20:,.0f} MiB" if isinstance(value, (int, float)) else "?"


def describe_stuck(address: str, info: dict[str, Any]) -> str:
    """One worker's state and memory, e.g. ``tcp://…: paused (process memory 362 MiB of a
    400 MiB limit)``."""
    memory = (info.get("metrics") or {}).get("memory")
    limit = info.get("memory_limit")
    figures = f"process memory {_mib(memory)}"
    if limit:
        figures += f" of a {_mib(limit)} limit"
    return f"{address}: {info.get('status')} ({figures})"


class PauseWatch:
    """Raises ``error`` once a worker stays paused or closing for ``grace`` seconds during
    which the job made no progress.

    ``hint`` says what a worker of this job needs, for the message. Given ``keys`` (the
    job's tasks not yet done, at each check), the watch also waits while a worker that is
    not stuck runs one of them: a long task elsewhere is progress to come, and a paused
    worker the job does not use is none of its business.
    """

    def __init__(self, client: Client, error: type[Exception], hint: str,
                 grace: float = 5.0, interval: float = 1.0) -> None:
        self.client = client
        self.error = error
        self.hint = hint
        self.grace = grace
        self.interval = interval
        self._checked = 0.0
        self._since: float | None = None
        self._progress: Any = None

    def check(self, progress: Any, what: str,
              workers: dict[str, dict[str, Any]] | None = None,
              keys: Collection[Any] | None = None) -> None:
        """``progress`` changes when the job moves (the holder's version, a count of tasks
        done); ``what`` says what is waiting, for the message; ``workers``: the scheduler's
        worker information if the caller has just fetched it (else it is fetched here)."""
        now = time.monotonic()
        if now - self._checked < self.interval:
            return
        self._checked = now
        if workers is None:
            workers = worker_info(self.client)
        stuck = {a: w for a, w in workers.items() if w.get("status") in STUCK_STATES}
        if stuck and keys is not None and self._runs_elsewhere(set(stuck), keys):
            stuck = {}
        if not stuck or progress != self._progress or self._since is None:
            self._since = now if stuck else None
            self._progress = progress
            return
        if now - self._since < self.grace:
            return
        pause = dask.config.get("distributed.worker.memory.pause", 0.8)
        listed = "; ".join(describe_stuck(a, w) for a, w in sorted(stuck.items()))
        paused = any(w.get("status") == "paused" for w in stuck.values())
        cause = (f"Dask's memory manager pauses a worker whose process passes "
                 f"{pause:.0%} of its memory limit, and a paused worker starts no task"
                 if paused and pause else "they start no task")
        raise self.error(
            f"{what} cannot go on: {len(stuck)} of {len(workers)} Dask worker(s) stuck for "
            f"{now - self._since:.0f}s: {listed}. {cause}. Give the workers more memory "
            f"(LocalCluster(memory_limit=...), dask worker --memory-limit ...): {self.hint}")

    def _runs_elsewhere(self, stuck: set[str], keys: Collection[Any]) -> bool:
        wanted = set(keys)
        processing = self.client.processing()
        return any(address not in stuck and wanted.intersection(running)
                   for address, running in processing.items())
