"""``sync``: wait for the gradients of all live workers for a version, average, one step.

The average is weighted by each worker's batch size, so that with a mean-reduced loss the
update is exactly the gradient of the mean loss over the union of the batches: N workers
with batches of ``b`` equal one process with batches of ``N x b`` (same init, same order).
A worker that dies is dropped from the barrier (the holder's watchdog notices); a worker
that comes back joins the next round.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dasktrain.trainer.modes.base import Contribution, UpdateMode

__all__ = ["SyncMode"]


class SyncMode(UpdateMode):
    name = "sync"
    lockstep = True

    def __init__(self, holder: Any, **options: Any) -> None:
        super().__init__(holder, **options)
        self._round: dict[int, Contribution] = {}
        self._done: asyncio.Future | None = None
        self._applying = False

    async def push(self, contribution: Contribution) -> None:
        holder = self.holder
        if contribution.version != holder.version:
            # Computed on parameters whose round has closed without it (its worker was
            # dropped, then came back): applying it now would break the barrier's promise.
            holder.record_event(f"worker {contribution.worker}: gradient for version "
                                f"{contribution.version} arrived at version "
                                f"{holder.version}; dropped")
            return
        # A restarted worker may push again for the same version: the same batch, so the
        # newer copy simply replaces the older.
        self._round[contribution.worker] = contribution
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        done = self._done
        await self._apply_if_complete()
        await done

    def waiting_for(self) -> set[int]:
        if not self._round:
            return set()
        return self.holder.expected_workers() - self._round.keys()

    async def membership_changed(self) -> None:
        await self._apply_if_complete()

    async def _apply_if_complete(self) -> None:
        if self._applying or not self._round or self.waiting_for():
            return
        contributions, done = list(self._round.values()), self._done
        self._round, self._done, self._applying = {}, None, True
        try:
            await self.holder.apply(contributions)
        except BaseException as exc:
            if done is not None and not done.done():
                done.set_exception(exc)
            raise
        finally:
            self._applying = False
        if done is not None and not done.done():
            done.set_result(None)
        # Pushes for the next version cannot have arrived (their workers wait on ``done``).

    def abort(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self._round, self._done = {}, None
