"""The life of an epoch inside the holder: one state machine, one place that moves it.

Each trainer worker runs one task for the whole fit, so nobody restarts at an epoch's end:
a worker hands the holder its report of the epoch as it leaves it and asks for the next.
The holder decides when the epoch is complete, keeps a snapshot of that boundary (the
parameters, and the whole state where the run checkpoints) for the driver's validation,
callbacks and checkpoint, and begins the next epoch at once if the driver queued it. The
workers train on while the driver does its boundary work on the snapshot, which is exactly
the state an epoch-by-epoch run would have seen.

States (:attr:`EpochMachine.state`), each move logged:

``idle``
    no epoch has begun (the driver's first :meth:`~EpochMachine.queue` begins one);
``running``
    the epoch's work is being done;
``draining``
    every batch is done (work claimed on demand) and the holder waits for the workers still
    active to leave; the watchdog drops any that died meanwhile;
``boundary``
    the epoch is complete and its snapshot kept; the next one begins as soon as the driver
    queued it and, in an elastic run, enough workers are there;
``ended``
    the fit is over for its workers.

The rule for *complete* is stated once (:meth:`EpochMachine.work_done`): every batch done
where work is claimed on demand, with nobody still training; else every rank's stride done
(its worker left the epoch with its report, or its task was given up). A rank whose worker
died is finished by its task, run again, which continues where the holder says.
:meth:`EpochMachine.advance` is the one place where the state moves on, called after every
change that can complete an epoch or begin the next (a worker leaving or being dropped, a
batch taken, a join, the driver queuing an epoch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dasktrain.trainer.holder.roster import Roster

__all__ = ["STATES", "EpochMachine", "Queued", "world_changed"]

logger = logging.getLogger(__name__)

STATES = ("idle", "running", "draining", "boundary", "ended")


@dataclasses.dataclass(frozen=True, slots=True)
class Queued:
    """An epoch the driver asked for: it begins once the one before is complete."""

    epoch: int
    fresh: bool = True  # False: continue a resumed epoch (its done work stays done)
    work: tuple[int, list[int]] | None = None  # batches and claim bounds (claimed work)
    present: int | None = None  # workers 0..present-1 (None: the roster decides)
    keep: str | None = None  # what to snapshot at its end: "params", "state" or None


class EpochMachine:
    """One fit's epochs at the holder (on its event loop, no locks).

    ``elastic``: the workers of each epoch follow the cluster, at least ``least`` of them.
    ``snapshot(keep)`` takes the boundary's snapshot in the holder's serial section;
    ``began(queued, members)`` tells the holder a new epoch began with ``members``;
    ``version()`` is the holder's version.
    """

    def __init__(self, roster: Roster, *, elastic: bool, least: int,
                 snapshot: Callable[[str], Awaitable[dict[str, Any]]],
                 began: Callable[[Queued, list[int]], None],
                 version: Callable[[], int]) -> None:
        self.roster = roster
        self._version = version
        self._tasks: set[asyncio.Task] = set()
        self.elastic = elastic
        self.least = least
        self._snapshot = snapshot
        self._began = began
        self.state = "idle"
        self.epoch = 0
        self.start_version = 0  # the holder's version when the epoch began
        self.complete = -1  # the last epoch found complete
        self.keep: str | None = None
        self.ended: str | None = None
        self.queued: dict[int, Queued] = {}  # by epoch: each begins after the one before
        self.finished: set[int] = set()  # workers that left the current epoch
        self.reports: dict[int, dict[int, dict[str, Any]]] = {}
        self.boundaries: dict[int, dict[str, Any]] = {}
        self.outcomes: dict[int, dict[str, Any]] = {}  # by epoch: shares, samples applied
        self.applied_samples = 0  # samples the current epoch's updates applied
        self.applied_loss = 0.0  # and the sum of their losses (each a batch's mean x rows)
        self.short_of_workers = False  # a queued epoch waits for the least workers
        self._settling = False
        self._waiters: set[asyncio.Future[None]] = set()

    # -- moves ---------------------------------------------------------------------------
    def move(self, state: str, why: str) -> None:
        assert state in STATES
        if state != self.state:
            logger.debug("holder: epoch %d %s -> %s: %s", self.epoch, self.state, state, why)
            self.state = state
        self.changed()

    def queue(self, queued: Queued) -> None:
        """``queued`` begins once the epoch before it is complete (at :meth:`advance`); a
        driver ahead of an epoch that waits for workers queues the next one beside it."""
        if self.state == "ended":
            return
        self.queued[queued.epoch] = queued

    def end(self, reason: str) -> None:
        """The fit is over: workers asking for another epoch are told ``reason``."""
        self.ended = reason
        self.queued.clear()
        self.move("ended", reason)

    def work_done(self) -> bool:
        """Whether the current epoch's work is done (see the module docstring)."""
        ledger = self.roster.ledger
        if ledger is not None:
            return ledger.finished
        return all(w in self.finished or self.roster.state(w) == "left"
                   for w in self.roster.ranks)

    def _workers_left(self) -> bool:
        return self.roster.ledger is None or not self.roster.active()

    async def advance(self) -> None:
        """Move on as far as the state allows: complete the epoch (snapshot, reports kept),
        then begin the queued one."""
        if self._settling:
            return  # the call taking the snapshot moves on once it has it
        if self.state in ("running", "draining"):
            done = self.work_done()
            if done and not self._workers_left():
                if self.state == "running":
                    self.move("draining", "every batch is done; waiting for the workers "
                                          "still training to leave")
                return
            if not done:
                return
            epoch = self.epoch
            self._settling = True
            try:
                boundary = None if self.keep is None else await self._snapshot(self.keep)
            finally:
                self._settling = False
            ledger = self.roster.ledger
            self.complete = epoch
            if boundary is not None:
                self.boundaries[epoch] = boundary
            self.outcomes = {epoch: {"shares": {} if ledger is None else ledger.shares(),
                                     "samples": self.applied_samples,
                                     "loss": (self.applied_loss / self.applied_samples
                                              if self.applied_samples else None)}}
            self.move("boundary", f"epoch {epoch} is complete")
        if self.state in ("idle", "boundary"):
            self._begin_queued()

    def work_finished(self) -> None:
        """Every batch of the epoch is done (maybe while its workers still train): move on
        as soon as the event loop can."""
        if self.state == "running":
            task = asyncio.get_running_loop().create_task(self.advance())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _begin_queued(self) -> None:
        queued = self.queued.get(self.complete + 1)
        if queued is None:
            return
        if self.elastic and queued.present is None:
            alive = len(self.roster.alive())
            self.short_of_workers = alive < self.least
            if self.short_of_workers:
                self.changed()
                return
        del self.queued[queued.epoch]
        self.begin(queued)

    def begin(self, queued: Queued) -> None:
        """Begin ``queued`` now (a resumed fit's first epoch continues where it was)."""
        for old in [e for e in self.reports if e < queued.epoch - 1]:
            del self.reports[old]
        if queued.fresh or self.state != "idle":
            self.start_version = self._version()
        self.epoch, self.keep = queued.epoch, queued.keep
        self.finished = set()
        self.applied_samples, self.applied_loss = 0, 0.0
        members = self.roster.begin_epoch(queued.present, self.elastic)
        ledger = self.roster.ledger
        if ledger is not None:
            if queued.work is None:
                raise ValueError("a holder with dynamic assignment needs the epoch's work")
            ledger.begin(queued.epoch, queued.work[0], queued.work[1],
                         keep_done=not queued.fresh)
        self._began(queued, members)
        self.move("running", f"epoch {queued.epoch} began with workers {members}")

    # -- reports -------------------------------------------------------------------------
    def report(self, worker: int, report: dict[str, Any] | None) -> None:
        """``worker`` left the current epoch, with its ``report`` of it. A task Dask ran
        again after its worker died, that finds its stride done, reports no steps: the
        report of the steps it took stays."""
        self.finished.add(worker)
        if report is None:
            return
        mine = self.reports.setdefault(int(report["epoch"]), {})
        if worker not in mine or report.get("steps"):
            mine[worker] = report

    def take_reports(self, epoch: int) -> list[dict[str, Any]]:
        """``epoch``'s reports, by worker (asked again, the same: a sharded holder's driver
        asks until every shard's epoch is complete)."""
        found = self.reports.get(epoch, {})
        return [found[w] for w in sorted(found)]

    # -- waiting for a move --------------------------------------------------------------
    async def wait_complete(self, epoch: int, wait: float, stopped: Callable[[], bool]
                            ) -> bool:
        """Whether ``epoch`` is complete within ``wait`` seconds (False at once once
        ``stopped()``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self.complete < epoch:
            left = deadline - loop.time()
            if left <= 0 or stopped():
                return False
            await self.wait(left)
        return True

    async def wait_begun(self, after: int, wait: float, check: Callable[[], None]
                         ) -> str | None:
        """None once an epoch after ``after`` runs or the fit ended, within ``wait``
        seconds; else what the next epoch waits for (see :meth:`waits_for`). ``check()``
        after each move raises if the holder cannot go on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (self.epoch <= after or self.state != "running") and self.ended is None:
            left = deadline - loop.time()
            if left <= 0:
                return self.waits_for()
            await self.wait(left)
            check()
        return None

    def changed(self) -> None:
        """Wake whoever waits for the epoch to end or begin."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Until the next move, or ``seconds`` (a waiter that timed out is let go)."""
        changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(changed)
        try:
            await asyncio.wait([changed], timeout=max(seconds, 0.0))
        finally:
            self._waiters.discard(changed)

    @property
    def waiters(self) -> int:
        """Calls waiting for a move (they never pile up: each lets go of its own)."""
        return len(self._waiters)

    def waits_for(self) -> str:
        """What the next epoch waits for, as the workers asking for it are told."""
        if self.state in ("running", "draining"):
            return "workers"
        if self.short_of_workers:
            return "cluster"
        return "driver"


def world_changed(epoch: int, was: int, now: int, config: Any) -> str:
    """The History's word on an elastic epoch that began with another number of workers
    (``config``: the holder's, for how work is shared out)."""
    how = ("each claims work as it goes" if config.assignment == "dynamic" else
           f"a step averages their {now} batches ({now * (config.batch_size or 0)} samples)")
    return (f"epoch {epoch}: {now} trainer worker(s) (was {was}); {how}; the learning rate "
            "follows its schedule")
