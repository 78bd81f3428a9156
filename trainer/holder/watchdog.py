"""The holder's watchdog: it drops the workers something waits for whose Dask worker died or
that stay silent, so that no barrier, claim or epoch's end waits on the dead.

What is waited for is the holder's to say (a pending update, claims waiting for work that
others hold, an epoch whose work is done but whose workers have not left); dropping goes
through the holder's one way out (:meth:`~.roster.Roster.deactivate`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dasktrain.trainer.holder.roster import Roster

__all__ = ["Watchdog", "scheduler_workers"]

logger = logging.getLogger(__name__)


class Watchdog:
    """Drops the workers an update waits for whose Dask worker died or that stay silent
    for ``timeout`` seconds: a barrier never waits on the dead."""

    def __init__(self, roster: Roster, waiting_for: Callable[[], set[int]],
                 drop: Callable[[int, str], Awaitable[None]],
                 alive: Callable[[], Awaitable[set[str] | None]], *, interval: float,
                 timeout: float) -> None:
        self.roster = roster
        self._waiting_for = waiting_for
        self._drop = drop
        self._alive = alive
        self.interval = interval
        self.timeout = timeout
        self._task: asyncio.Task | None = None
        self._stopped = False
        self.failed_rounds = 0

    def ensure_running(self) -> None:
        if not self._stopped and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.interval)
            try:
                await self.check(time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:
                # A round that failed (the scheduler did not answer, a drop raised) must not
                # end the watch: the next round may succeed, and without it a barrier could
                # wait on a dead worker for good.
                self.failed_rounds += 1
                logger.warning("the holder's watchdog round failed; it keeps watching",
                               exc_info=self.failed_rounds == 1)

    async def check(self, now: float) -> None:
        """One round of checks (the loop's body)."""
        waiting = self._waiting_for()
        self.roster.mark_waiting(waiting, now)
        if not waiting:
            return
        alive = await self._alive()
        for w in sorted(waiting):
            address = self.roster.address(w)
            if alive is not None and address is not None and address not in alive:
                await self._drop(w, f"its Dask worker {address} is gone")
            elif self.roster.waited(w, now) > self.timeout:
                await self._drop(w, f"nothing for {self.timeout:g}s")


def scheduler_workers(dask_worker: Any) -> Callable[[], Awaitable[set[str] | None]]:
    """The addresses of the cluster's workers, as the scheduler of ``dask_worker`` (the
    holder's) knows them; None where it cannot tell now (outside a cluster, a slow or
    absent scheduler: the watchdog asks again next round)."""

    async def alive() -> set[str] | None:
        if dask_worker is None:
            return None
        try:
            info = await asyncio.wait_for(dask_worker.scheduler.identity(n_workers=-1), 10)
        except Exception:
            return None
        return set(info.get("workers", {}))

    return alive
