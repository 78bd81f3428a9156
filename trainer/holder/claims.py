"""Claims of work (``assignment="dynamic"``): the holder's answer to a worker's pipeline
asking for its next run of batches, and the waits that answer may need.

A claim takes the lowest pending batches (:mod:`.ledger`); when none is pending although
the epoch is not done (others hold the rest), it waits, up to its ``wait``, for work to
come back (a holder dies, leaves or is dropped) or for the epoch to be done. A claim that
waited checks its incarnation again before it takes anything: its worker may have been
dropped, or superseded by a rerun, meanwhile, and the actor runs the claim to its end
although its caller is gone. One that finds its epoch over is answered so (None) as long
as its incarnation is current, even if the next epoch, begun meanwhile, expects it: a
worker that joined as an epoch drained waits in a claim until that epoch is done. Every
wait lets go of its own future when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dasktrain.trainer.errors import TrainerError
from dasktrain.trainer.holder.roster import Roster
from dasktrain.trainer.modes.base import UpdateMode

__all__ = ["ClaimDesk"]

# (worker, incarnation, what, active=True): raises if fenced; with active=False a current
# incarnation passes whether or not it trains the current epoch.
Check = Callable[..., None]


class ClaimDesk:
    """Hands out claimed work for one holder (on its event loop).

    ``check`` is the holder's fence; ``version()`` its current version (recorded with each
    claim); ``finished()`` is called once every batch of the epoch is done.
    """

    def __init__(self, roster: Roster, mode: UpdateMode, check: Check,
                 version: Callable[[], int], finished: Callable[[], None]) -> None:
        self.roster = roster
        self.mode = mode
        self._check = check
        self._version = version
        self._finished = finished
        self._waiters: set[asyncio.Future[None]] = set()
        self.waiting = 0  # claims waiting for work that others hold
        self.claims: list[tuple[int, int, int, int]] = []  # (version, worker, start, stop)

    async def claim(self, worker: int, incarnation: int, epoch: int, wait: float
                    ) -> list[int] | None:
        """See :meth:`ParameterHolder.claim`."""
        ledger = self.roster.ledger
        if ledger is None:
            raise TrainerError("this holder assigns work statically: nothing to claim")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            if epoch != ledger.epoch or ledger.finished:
                # The epoch claimed from is over: its worker (current, though the next
                # epoch may expect it already) ends it and asks for the next.
                self._check(worker, incarnation, "a claim", active=False)
                return None
            self._check(worker, incarnation, "a claim")  # again, after every wait
            size, piece = self.mode.claim_size(worker)
            run = ledger.claim(worker, len(self.roster.live()), size, piece)
            if run is not None:
                self.claims.append((self._version(), worker, run.start, run.stop))
                return [run.start, run.stop] if piece is None else [run.start, run.stop,
                                                                    piece]
            left = deadline - loop.time()
            if left <= 0:
                return []
            # No await since the claim above: a change cannot slip in before this waits.
            changed: asyncio.Future[None] = loop.create_future()
            self._waiters.add(changed)
            self.waiting += 1
            try:
                # This worker has nothing to push now: an update waiting for it need not.
                await self.mode.membership_changed()
                await asyncio.wait([changed], timeout=left)
            finally:
                self.waiting -= 1
                self._waiters.discard(changed)

    def changed(self) -> None:
        """Wake the claims waiting for work (some came back, or the epoch is done)."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        ledger = self.roster.ledger
        if ledger is not None and ledger.finished:
            self._finished()

    @property
    def waiters(self) -> int:
        """Futures of claims waiting now (each lets go of its own when its wait ends)."""
        return len(self._waiters)

    def waited_for(self) -> set[int]:
        """Workers that claims wait on: those holding work while another waits for work,
        and, once every batch is done, those still training (whose leaving ends the
        epoch)."""
        ledger = self.roster.ledger
        if ledger is None:
            return set()
        waiting: set[int] = set()
        if self.waiting:
            waiting |= ledger.holders()
        if ledger.finished:
            waiting |= self.roster.active()
        return waiting

    def take(self) -> list[tuple[int, int, int, int]]:
        """The claims made since the last call, for the History."""
        claims, self.claims = self.claims, []
        return claims
