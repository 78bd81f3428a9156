"""Modes whose updates gather pushes into rounds: every push waits until the round it
joined is applied (``sync``, ``soft``, ``average``)."""

from __future__ import annotations

import asyncio
from typing import Any

from dasktrain.trainer.modes.base import Contribution, Host, UpdateMode

__all__ = ["RoundMode"]


class RoundMode(UpdateMode):
    """A round collects at most one contribution per worker; when :meth:`complete` says so
    it is closed (:meth:`close_round` applies it) and every push in it returns.

    A worker restarted while its push waits may push again into the same round: the newer
    copy (the same batch) replaces the older.
    """

    def __init__(self, host: Host | None, **options: Any) -> None:
        super().__init__(host, **options)
        self._round: dict[int, Contribution] = {}
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
        promise, so it is recorded as dropped."""
        host = self.host
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
        self._round[contribution.worker] = contribution
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        done = self._done
        await self._apply_if_complete()
        await done

    @property
    def round(self) -> dict[int, Contribution]:
        """The contributions of the round being gathered, by worker."""
        return self._round

    def waiting_for(self) -> set[int]:
        if not self._round:
            return set()
        assert self.host is not None
        return self.host.live_workers() - self._round.keys()

    async def membership_changed(self) -> None:
        await self._apply_if_complete()

    async def _apply_if_complete(self) -> None:
        # A loop: pushes that arrive while a round is applied start the next one, which
        # may be complete by the time this one is done.
        while not self._applying and self._round and self.complete():
            contributions, done = list(self._round.values()), self._done
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
