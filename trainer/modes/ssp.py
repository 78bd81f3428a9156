"""``ssp``: stale-synchronous parallel, bounded staleness (Ho et al., NIPS 2013).

Every gradient is applied on arrival, as in ``async``; a worker's clock is the number of
batches it has pushed this epoch. A worker more than ``staleness_bound`` (s) clocks ahead of
the slowest live worker waits (its reply is held) until the slowest catches up. So no
gradient is ever computed more than s clocks ahead of the slowest live worker: each
applied gradient records that lead as ``clock_lead`` (always <= s). With s = 0 the workers
move in lock-step, one gradient each per clock.

The bound is on clocks, as in SSP: the version staleness of a gradient (recorded for every
mode) also counts the other workers' gradients applied meanwhile, at most (N - 1)(2s + 1)
while membership is fixed. A worker computing from clock c received its parameters at most s
ahead of the slowest (so every other worker was at clock >= c - s then), and while it
computes the slowest is at most c, so another worker may push until it is s + 1 past that:
2s + 1 gradients each. A worker that finished its share of the epoch, or died (the watchdog drops
it), no longer holds the others back. Each gradient is applied at its share of the learning
rate, with the momentum compensated, and the options of :mod:`.adjust` apply too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dasktrain.trainer.modes.adjust import StaleGradientMode
from dasktrain.trainer.modes.base import Contribution, Host

__all__ = ["SSPMode"]


class SSPMode(StaleGradientMode):
    name = "ssp"
    gradient_fields = {"clock_lead": 0}

    def __init__(self, host: Host | None, *, staleness_bound: int = 3, **options: Any) -> None:
        super().__init__(host, **options)
        if not isinstance(staleness_bound, int) or staleness_bound < 0:
            raise ValueError(f"staleness_bound must be an integer >= 0, got "
                             f"{staleness_bound!r}")
        self.staleness_bound = staleness_bound
        self._waiting: dict[int, asyncio.Future] = {}
        self._lead: dict[int, int] = {}  # each worker's lead when it last got parameters

    def _clock(self, worker: int) -> int:
        return self.host.batches_taken(worker)

    def _slowest(self) -> int | None:
        live = self.host.live_workers()
        return min((self._clock(w) for w in live), default=None)

    def fields(self, contribution: Contribution) -> dict[str, Any]:
        # How far ahead of the slowest its worker was when it started this gradient.
        return {"clock_lead": self._lead.get(contribution.worker, 0)}

    def sent(self, worker: int) -> None:
        super().sent(worker)
        slowest = self._slowest()
        self._lead[worker] = 0 if slowest is None else max(0, self._clock(worker) - slowest)

    async def push(self, contribution: Contribution) -> None:
        if contribution.grads is not None:
            await self.host.apply([contribution], adjust=self.adjuster)
        self._release()
        worker = contribution.worker
        if self._ahead(worker):
            future = asyncio.get_running_loop().create_future()
            self._waiting[worker] = future
            await future

    def _ahead(self, worker: int) -> bool:
        slowest = self._slowest()
        return slowest is not None and self._clock(worker) - slowest > self.staleness_bound

    def _release(self) -> None:
        for worker, future in list(self._waiting.items()):
            if future.done():
                del self._waiting[worker]
            elif not self._ahead(worker) or worker not in self.host.live_workers():
                del self._waiting[worker]
                future.set_result(None)

    def waiting_for(self) -> set[int]:
        if not self._waiting:
            return set()
        lead = max(self._clock(w) for w in self._waiting)
        return {w for w in self.host.live_workers() - self._waiting.keys()
                if lead - self._clock(w) > self.staleness_bound}

    async def membership_changed(self) -> None:
        self._release()

    def joined(self, worker: int) -> None:
        # A reply still held for this worker was for its earlier task, which is gone (its
        # process died): let that push return, or it would wait for good.
        stale = self._waiting.pop(worker, None)
        if stale is not None and not stale.done():
            stale.set_result(None)
        self._release()

    def abort(self, error: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
