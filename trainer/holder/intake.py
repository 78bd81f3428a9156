"""Pushes coming in: what the holder does with a worker's gradient (or parameters) once the
roster has let the call through, and the reply it sends back.

A push of claimed work is admitted against the ledger first (a second gradient of a batch
is refused: an event, the batch counting once by its first); an admitted one goes to the
mode. Payloads still arriving over the direct channel may let a round's mean begin early
(:mod:`.early`). The reply is the current parameters under a lease (or the mode's own, as
``average``'s with each worker's optimizer state).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from dasktrain.trainer.exchange.landing import Landing
from dasktrain.trainer.holder.arithmetic import Arithmetic, Lease
from dasktrain.trainer.holder.balance import Balance
from dasktrain.trainer.holder.early import Arrival, early_round
from dasktrain.trainer.holder.host import ModeHost
from dasktrain.trainer.holder.roster import Roster
from dasktrain.trainer.modes import Contribution
from dasktrain.trainer.modes.base import UpdateMode

__all__ = ["Intake"]


class Intake:
    """Takes pushes for one holder (on its event loop); ``usable()`` is False once the
    holder is closed or failed."""

    def __init__(self, roster: Roster, host: ModeHost, mode: UpdateMode, arith: Arithmetic,
                 balance: Balance, payload_size: int, usable: Callable[[], bool]) -> None:
        self.roster = roster
        self.host = host
        self.mode = mode
        self.arith = arith
        self.balance = balance
        self.payload_size = payload_size
        self._usable = usable
        self.arriving: dict[int, Arrival] = {}  # payloads coming over the channel (.early)

    async def take(self, worker: int, incarnation: int, version: int,
                   grads: np.ndarray | None, count: int, loss: float,
                   position: tuple[int, int]) -> Lease:
        """A push of ``worker``'s current ``incarnation`` (the roster checked it): hand it
        to the mode; the reply under a lease."""
        self.arriving.pop(worker, None)  # in, if it came over the channel
        layout = self.host.layout
        if grads is not None and (grads.dtype != np.float32
                                  or grads.shape != (self.payload_size,)):
            raise ValueError(
                f"worker {worker} pushed {grads.size} {grads.dtype} values; the holder "
                f"takes {self.payload_size} float32 ({layout.num_params} parameters "
                f"+ {layout.num_buffers} buffer values"
                f"{' + optimizer state' if self.payload_size > layout.size else ''})"
                ": the worker's model differs from the holder's")
        if self.arith.threaded:
            # Let an update in flight finish first: its version bump decides whether this
            # push is on time, and no push may slip in between its check and the bump.
            await self.arith.promptly(_nothing)
        contribution = Contribution(worker, version, grads, count, loss, tuple(position),
                                    clock=self.roster.clocks[worker])
        loop = asyncio.get_running_loop()
        self.balance.pushed(worker, count if grads is not None else 0, loop.time())
        refusal = self._admit(contribution)
        if refusal is None:
            if self.arriving:
                # Once this push is in the round, which may then wait only for payloads
                # still arriving.
                loop.call_soon(self.begin_mean)
            await self.mode.push(contribution)
        else:
            # An event, not a dropped gradient: its batch counts once, by its first one.
            self.host.record_event(f"worker {worker}'s gradient refused: {refusal}")
        # The incarnation may have been superseded while its push waited in a round.
        lease = await self.arith.promptly(self.reply, worker, incarnation)
        self.balance.replied(worker, loop.time())
        return lease

    def _admit(self, contribution: Contribution) -> str | None:
        """Why a gradient of work claimed on demand is not taken (its batch was applied
        already, or is not the epoch's), or None."""
        ledger = self.roster.ledger
        if ledger is None or contribution.grads is None:
            return None
        epoch, batch = contribution.position
        if epoch != ledger.epoch:
            return f"it is of epoch {epoch}, not {ledger.epoch}"
        return ledger.arrive(contribution.worker, batch)

    def reply(self, worker: int, pushed: int | None = None) -> Lease:
        """The reply to ``worker``, leased (in the serial section); ``pushed``: to the push
        of this incarnation of it, which waits for it without reading its model."""
        custom = self.mode.reply(worker)
        self.mode.sent(worker)
        if custom is not None:
            return Lease(custom, self.host.version, None)
        if pushed is not None:  # that incarnation waits for this reply: its region is free
            self.arith.adopt_for(worker, pushed)
        return self.arith.lease(self.host.version)

    def arriving_payload(self, worker: int, incarnation: int, version: int, count: int,
                         loss: float, payload: np.ndarray, landing: Landing) -> None:
        """The channel's news that ``worker``'s push for ``version`` is arriving into
        ``payload`` (its push follows once it is in); a stale incarnation's is ignored."""
        if self.roster.incarnation(worker) != incarnation \
                or self.roster.state(worker) != "active":
            return
        self.arriving[worker] = Arrival(version, count, loss, payload, landing)
        self.begin_mean()

    def begin_mean(self) -> None:
        """Begin the round's mean while its last payloads arrive, if it waits for nothing
        else (see :mod:`.early`)."""
        if not self._usable():
            return
        found = early_round(self.mode.round, self.mode.waiting_for(), self.arriving,
                            self.host.version)
        if found is not None:
            self.arith.begin_mean(*found)


def _nothing() -> None:
    """A no-op for the serial section: awaiting it waits for the work queued before."""
