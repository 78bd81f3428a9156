"""Epoch boundaries inside the holder, for trainer tasks that last a whole fit.

Where each trainer worker runs one task for all of a fit's epochs, nobody restarts at an
epoch's end: every worker hands the holder its report of the epoch as it leaves it, and
asks for the next. The holder decides when the epoch is complete (every stride done, or
every claimed batch applied with nobody still training), keeps a snapshot of that
boundary (the parameters, and the whole state where the run checkpoints) for the
driver's validation, callbacks and checkpoint, and begins the next epoch at once if the
driver queued it. The workers then go on training while the driver does its boundary
work on the snapshot, which is exactly the state an epoch-by-epoch run would have seen.

This module keeps that bookkeeping (on the holder's event loop, no locks); when an epoch
is complete is the holder's own rule (``ParameterHolder._epoch_complete``).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Turns"]


class Turns:
    """Reports, boundary snapshots and the queued next epoch of one fit's holder."""

    def __init__(self) -> None:
        self.complete = -1
        """The last epoch found complete."""
        self.queued: tuple[int, tuple[Any, ...]] | None = None
        """(epoch, its begin arguments), begun as soon as the epoch before is complete."""
        self.keep: str | None = None
        """What to snapshot at the current epoch's end: "params", "state" or nothing."""
        self.ended: str | None = None
        """Why the fit ended for its workers (they stop asking for epochs)."""
        self.reports: dict[int, dict[int, dict[str, Any]]] = {}
        self.boundaries: dict[int, dict[str, Any]] = {}
        self.joined: set[int] = set()  # workers whose task for the fit joined
        self.shares: dict[int, dict[int, int]] = {}  # batches each worker took, by epoch
        self._waiters: list[asyncio.Future[None]] = []

    def begin(self, epoch: int, keep: str | None) -> None:
        """``epoch`` begins; reports of epochs before the last are let go (nobody asks for
        them where tasks are started per epoch)."""
        self.keep = keep
        for old in [e for e in self.reports if e < epoch - 1]:
            del self.reports[old]

    def report(self, worker: int, report: dict[str, Any]) -> None:
        """``worker``'s report of the epoch it left (the epoch is in the report). A task
        Dask ran again after its worker died, that finds its stride done, reports no
        steps: the report of the steps it took stays."""
        mine = self.reports.setdefault(int(report["epoch"]), {})
        if worker not in mine or report.get("steps"):
            mine[worker] = report

    def finish(self, epoch: int, boundary: dict[str, Any] | None,
               shares: dict[int, int]) -> None:
        """``epoch`` is complete; ``boundary`` is the state it ended with (None: not kept),
        ``shares`` the batches each worker took of it (work claimed on demand)."""
        self.complete = epoch
        if boundary is not None:
            self.boundaries[epoch] = boundary
        self.shares = {epoch: shares}
        self.changed()

    def take_queued(self, epoch: int) -> tuple[Any, ...] | None:
        """The begin arguments of ``epoch`` if the driver queued it."""
        if self.queued is None or self.queued[0] != epoch:
            return None
        args, self.queued = self.queued[1], None
        return args

    def take_reports(self, epoch: int) -> list[dict[str, Any]]:
        """``epoch``'s reports, by worker (asked again, the same: a sharded holder's driver
        asks until every shard's epoch is complete)."""
        found = self.reports.get(epoch, {})
        return [found[w] for w in sorted(found)]

    def end(self, reason: str) -> None:
        self.ended = reason
        self.changed()

    def changed(self) -> None:
        """Wake whoever waits for an epoch to end or begin."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Until the next change, or ``seconds``."""
        changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(changed)
        await asyncio.wait([changed], timeout=max(seconds, 0.0))
