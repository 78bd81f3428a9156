"""Modes whose updates gather pushes into rounds: every push waits until the round it
joined is applied (``sync``, ``soft``, ``average``).

A round keeps one contribution per *batch*: a worker's batch is named by the position it
pushes, ``(epoch, batches consumed after it)``, so ``(worker, position)`` says which batch a
contribution is of. A restarted worker (its process died, Dask ran its task again) starts
after the last of its batches the holder has taken (``start_position``, the default).

* In ``sync`` and ``average`` a push is taken when its round is applied. A worker that
  died while its push waited in the round computes that batch again: the newer copy
  replaces the older one, whose push returns with the round all the same. (So every shard
  of a sharded holder gets the batch, even one the first copy never reached.) If the
  round was applied with the older copy meanwhile, the newer one is a repeat of a batch
  taken already: ignored, with an event, neither applied nor counted as dropped.
* ``soft`` takes a push as it enters the round, so its restarted worker goes on with the
  next batch, and so does a run resumed from a checkpoint whose stored round holds it. A
  push of a *different* batch of a worker that has one waiting joins the round beside it:
  both are applied. Replacing the waiting one would lose a gradient that its worker will
  not compute again: neither applied nor recorded as dropped.

So every contribution that enters a round is applied with it, and one that comes too late
for its version's round (``sync``, ``average``) is recorded as dropped, unless its batch
was applied already.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from dasktrain.trainer.modes.base import Contribution, Host, UpdateMode

__all__ = ["RoundMode"]

_Key = tuple[int, tuple[int, int]]  # (worker, position): one batch of one worker


def _key(contribution: Contribution) -> _Key:
    return contribution.worker, tuple(contribution.position)


class RoundMode(UpdateMode):
    """A round collects contributions, at most one per batch (see the module docstring);
    when :meth:`complete` says so it is closed (:meth:`close_round` applies it) and every
    push in it returns."""

    def __init__(self, host: Host | None, **options: Any) -> None:
        super().__init__(host, **options)
        self._round: dict[_Key, Contribution] = {}
        self._done: asyncio.Future | None = None
        self._applying = False

    def complete(self) -> bool:
        """Whether the current (non-empty) round can be applied now."""
        raise NotImplementedError

    async def close_round(self, contributions: list[Contribution]) -> None:
        """Apply a completed round."""
        raise NotImplementedError

    async def enter_if_current(self, contribution: Contribution, what: str) -> None:
        """:meth:`enter` a lock-step round, unless ``contribution`` (``what``: "gradient",
        "parameters") was computed on parameters whose round has closed without it (its
        worker was dropped, then came back): applying it now would break the barrier's
        promise, so it is recorded as dropped. A repeat of a batch taken already is
        ignored (see the module docstring)."""
        host = self.host
        epoch, batches = contribution.position
        # Where work is claimed, positions name batches and the ledger refuses repeats.
        if not host.claims_work and epoch == host.epoch \
                and batches <= host.batches_taken(contribution.worker):
            host.record_event(f"worker {contribution.worker}: {what} of a batch applied "
                              f"already (position {batches} of epoch {epoch}), computed "
                              "again after a restart; ignored")
            return
        if contribution.version != host.version:
            host.record_event(f"worker {contribution.worker}: {what} of version "
                              f"{contribution.version} arrived at version {host.version}; "
                              "dropped")
            if contribution.grads is not None:
                host.drop_gradient(contribution, "its round closed without it")
            return
        await self.enter(contribution)

    async def enter(self, contribution: Contribution) -> None:
        """Put ``contribution`` in the current round; return once that round is applied."""
        key = _key(contribution)
        older = self._round.get(key)
        if older is not None:  # the same batch, recomputed by a restarted worker
            contribution.held = contribution.held or older.held
        self._round[key] = contribution
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        done = self._done
        await self._apply_if_complete()
        await done

    @property
    def round(self) -> list[Contribution]:
        """The contributions of the round being gathered, by worker, then position."""
        return [self._round[key] for key in sorted(self._round)]

    def round_workers(self) -> set[int]:
        """The workers with a contribution in the round being gathered."""
        return {worker for worker, _ in self._round}

    def restore_round(self, contributions: Iterable[Contribution]) -> None:
        """Make ``contributions`` (a checkpoint's) the round being gathered."""
        self._round = {_key(c): c for c in contributions}

    def waiting_for(self) -> set[int]:
        if not self._round:
            return set()
        assert self.host is not None
        return self.host.live_workers() - self.round_workers()

    async def membership_changed(self) -> None:
        await self._apply_if_complete()

    async def _apply_if_complete(self) -> None:
        # A loop: pushes that arrive while a round is applied start the next one, which
        # may be complete by the time this one is done.
        while not self._applying and self._round and self.complete():
            contributions, done = self.round, self._done
            self._round, self._done, self._applying = {}, None, True
            try:
                await self.close_round(contributions)
            except BaseException as exc:
                if done is not None and not done.done():
                    done.set_exception(exc)
                raise
            finally:
                self._applying = False
            if done is not None and not done.done():
                done.set_result(None)

    def abort(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self._round, self._done = {}, None
