"""Noticing, within seconds, a cluster on which nothing can run.

Dask's memory manager pauses a worker whose process passes the pause fraction of its memory
limit (80 % by default): it keeps serving but starts no task. A trainer whose workers are
paused waits on tasks that never start, and only the trainer's long ``timeout`` would end
it. The driver therefore asks the scheduler, about once a second while it waits, whether a
worker is paused or closing; if one stays so for a few seconds while the run makes no
progress, the run stops with the memory figures and what to change.
"""

from __future__ import annotations

import time
from typing import Any

import dask
from distributed import Client

from dasktrain._cluster import worker_info
from dasktrain.trainer.errors import WorkersPaused

__all__ = ["TRAINER_MEMORY_HINT", "PauseWatch", "describe_stuck"]

_STUCK = ("paused", "closing", "closing_gracefully", "closed")
TRAINER_MEMORY_HINT = ("a trainer worker's process needs about 400 MiB for Python, Dask and "
                       "PyTorch, plus its model replica and prefetch x block size; the "
                       "holder's worker also keeps the parameters and optimizer state")


def _mib(value: Any) -> str:
    return f"{value / 2**20:,.0f} MiB" if isinstance(value, (int, float)) else "?"


def describe_stuck(address: str, info: dict[str, Any]) -> str:
    """One worker's state and memory, e.g. ``tcp://…: paused (362 MiB of a 400 MiB
    limit)``."""
    memory = (info.get("metrics") or {}).get("memory")
    limit = info.get("memory_limit")
    figures = f"process memory {_mib(memory)}"
    if limit:
        figures += f" of a {_mib(limit)} limit"
    return f"{address}: {info.get('status')} ({figures})"


class PauseWatch:
    """Raises :class:`WorkersPaused` once a worker stays paused or closing for ``grace``
    seconds during which the run made no progress."""

    def __init__(self, client: Client, grace: float = 5.0, interval: float = 1.0) -> None:
        self.client = client
        self.grace = grace
        self.interval = interval
        self._checked = 0.0
        self._since: float | None = None
        self._progress: Any = None

    def check(self, progress: Any, what: str,
              workers: dict[str, dict[str, Any]] | None = None) -> None:
        """``progress`` changes when the run moves (the holder's version); ``what`` says
        what is waiting, for the message; ``workers``: the scheduler's worker information if
        the caller has just fetched it (else it is fetched here)."""
        now = time.monotonic()
        if now - self._checked < self.interval:
            return
        self._checked = now
        if workers is None:
            workers = worker_info(self.client)
        stuck = {a: w for a, w in workers.items() if w.get("status") in _STUCK}
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
        raise WorkersPaused(
            f"{what} cannot go on: {len(stuck)} of {len(workers)} Dask worker(s) stuck for "
            f"{now - self._since:.0f}s: {listed}. {cause}. Give the workers more memory "
            f"(LocalCluster(memory_limit=...), dask worker --memory-limit ...): "
            f"{TRAINER_MEMORY_HINT}")
