"""The ways into the holder's roster and the one way out.

In: a worker's task joins (its first task, or one Dask ran again after its process died,
or one that the holder dropped while it was alive). It gets a new incarnation, which
supersedes the earlier one (that one goes out first, by the one way out), and either its
welcome into the current epoch (the parameters, its rank, its place) or, where ranks own a
stride of the epoch and it has none in this one, word to wait for the next. In an elastic
run whose workers claim work, a task that lands beside another replica has no place.

Out: :meth:`Doors.deactivate`, whatever the cause (the worker left the epoch, retired,
failed, died, went silent, was superseded, was given up). What the incarnation claimed
goes back to the pool, the mode and the epoch machine are told, and in a holder in shards
a lost worker stops the fit (:class:`~dasktrain.trainer.errors.ShardedWorkerLost`): a step
must reach every shard or none.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dasktrain.trainer.errors import ShardedWorkerLost, TrainerError
from dasktrain.trainer.exchange.contact import HolderChannel
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.balance import Balance
from dasktrain.trainer.holder.claims import ClaimDesk
from dasktrain.trainer.holder.epochs import EpochMachine
from dasktrain.trainer.holder.host import ModeHost
from dasktrain.trainer.holder.intake import Intake
from dasktrain.trainer.holder.roster import Roster
from dasktrain.trainer.holder.watchdog import Watchdog

__all__ = ["Doors"]

logger = logging.getLogger(__name__)


class Doors:
    """Joins and the one way out of one holder (on its event loop). ``address`` is the
    holder's own Dask address (a worker there needs no channel); ``fail(error)`` stops
    the holder; ``advance()`` moves the epoch machine on."""

    def __init__(self, *, model_layout: FlatLayout, roster: Roster, epochs: EpochMachine,
                 host: ModeHost, intake: Intake, claims: ClaimDesk, balance: Balance,
                 watchdog: Watchdog, direct: HolderChannel, address: str | None, elastic: bool,
                 shards: int | None, fail: Callable[[TrainerError], Awaitable[None]],
                 advance: Callable[[], Awaitable[None]]) -> None:
        self.model_layout = model_layout
        self.roster, self.epochs, self.host = roster, epochs, host
        self.intake, self.claims, self.balance = intake, claims, balance
        self.watchdog, self.direct, self.address = watchdog, direct, address
        self.elastic, self.shards = elastic, shards
        self._fail, self._advance = fail, advance

    async def join(self, worker: int, address: str | None, layout: FlatLayout
                   ) -> dict[str, Any]:
        """See :meth:`ParameterHolder.join`."""
        roster = self.roster
        roster.known(worker)
        if layout != self.model_layout:
            raise ValueError(f"worker {worker}'s model does not match the holder's "
                             f"({self.model_layout.describe_difference(layout)}): every "
                             "worker must build the same model")
        surplus = self._surplus(worker, address)
        if surplus is not None:
            logger.info("holder: worker %d's task on %s is surplus: %s", worker, address,
                        surplus)
            return {"surplus": True}
        known = roster.incarnation(worker) > 0
        if known and roster.state(worker) not in ("absent", "left", "lost"):
            # Dask ran its task again (its process died): the earlier task is gone now.
            await self.deactivate(worker, "lost", f"worker {worker}'s earlier task is "
                                                  f"superseded by one on {address}")
        # Where ranks own a stride, a worker outside this epoch's ranks waits for the next.
        elsewhere = (roster.ledger is None and self.epochs.state != "idle"
                     and worker not in roster.ranks)
        incarnation = roster.admit(worker, address, "waiting" if elsewhere else "active")
        self.host.record_event(f"worker {worker} {'rejoined' if known else 'joined'} on "
                               f"{address} (incarnation {incarnation})")
        channel = (None if address is not None and address == self.address
                   else await self.direct.contact(worker, incarnation))
        # A queued epoch may have waited for one more worker: this one may be in it now.
        await self._advance()
        if roster.state(worker) == "waiting":
            return {"wait": self.epochs.epoch, "incarnation": incarnation, "channel": channel}
        return {**await self.welcome(worker, address), "channel": channel}

    async def welcome(self, worker: int, address: str | None) -> dict[str, Any]:
        """Make ``worker`` active in the current epoch: its parameters, version and place."""
        roster, host, epoch = self.roster, self.host, self.epochs.epoch
        roster.set(worker, "active")
        self.watchdog.ensure_running()
        mode = host.mode
        assert mode is not None
        mode.joined(worker)
        lease = await host.serially(self.intake.reply, worker)
        try:
            params = lease.array.copy()  # goes out through the actor: its own copy
        finally:
            lease.release()
        world = max(len(roster.ranks), 1)
        rank = roster.rank(worker)  # None for a worker joined mid-epoch to claim work
        return {"params": params, "version": lease.version, "epoch": epoch,
                "incarnation": roster.incarnation(worker), "address": address,
                "lr_factor": host.arith.lr_factor, "world": world,
                "rank": min(worker, world - 1) if rank is None else rank,
                "position": mode.start_position(worker, roster.position_in(worker, epoch)),
                "shares": self.balance.shares(epoch, len(roster.ranks))}

    def _surplus(self, worker: int, address: str | None) -> str | None:
        """Why a task of ``worker`` joining from ``address`` has no place in an elastic run
        whose workers claim work (Dask reran it after its worker left, or put it beside
        another replica), or None."""
        roster = self.roster
        if not (self.elastic and roster.ledger is not None):
            return None
        if roster.state(worker) == "active" and roster.address(worker) != address:
            return "another task of this worker is at work"
        other = roster.sharing(worker, address)
        return None if other is None else f"worker {other} trains on {address}"

    async def deactivate(self, worker: int, state: str, event: str | None) -> None:
        """The one way out: ``worker``'s incarnation holds nothing from now on (what it
        claimed goes back to the pool), the mode and the epoch machine are told."""
        roster = self.roster
        where = (f" (on {roster.address(worker) or 'an unnamed host'}, incarnation "
                 f"{roster.incarnation(worker)})")  # the same worker id may run elsewhere
        back = roster.deactivate(worker, state)
        self.balance.forget(worker)
        self.intake.arriving.pop(worker, None)
        if event is not None:
            self.host.record_event(event + where)
        if back:
            self.host.record_event(f"worker {worker}'s {back} claimed batch(es) went back "
                                   "to the pool")
        self.claims.changed()
        if state != "done":
            # Its process may live on (retiring, silent, superseded) and write into its
            # model, where the holder may keep its parameters (see Arithmetic.adopt).
            await self.host.arith.forsake(worker)
        if state == "lost" and self.shards is not None:
            await self._fail(ShardedWorkerLost(
                f"trainer worker {worker} was lost during the fit ({event}); with the holder "
                f"in {self.shards} shards a step must reach every shard or none, so the "
                "fit stops here: resume it from its last checkpoint"))
            return
        mode = self.host.mode
        assert mode is not None
        await (mode.lost(worker) if state == "lost" else mode.left(worker))
        await self._advance()
