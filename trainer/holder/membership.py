"""Who trains with the holder: each worker's state, address, clock and place in the epoch,
and the watchdog that stops waiting for workers that died or went silent."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Membership", "Watchdog"]

# expected: should join this epoch; active: joined and pushing; done: finished its share
# of the epoch; lost: dropped by the watchdog (or its task given up), until it comes back;
# absent: not part of this epoch (yet): an elastic run's slot that no worker fills.
STATES = ("expected", "active", "done", "lost", "absent")


logger = logging.getLogger(__name__)

@dataclasses.dataclass(slots=True)
class _Member:
    state: str = "expected"
    address: str | None = None
    waiting_since: float | None = None


class Membership:
    """The holder's view of its ``workers`` trainer workers.

    ``clocks[w]`` counts the gradients (or parameter pushes) of worker ``w`` the holder has
    taken in the whole run; ``positions[w]`` is ``(epoch, batches consumed)`` after its
    latest one.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._members = {w: _Member() for w in range(workers)}
        self.clocks = [0] * workers
        self.positions: dict[int, tuple[int, int]] = {}

    def check(self, worker: int) -> None:
        if worker not in self._members:
            raise ValueError(f"unknown worker {worker!r}: this holder serves workers "
                             f"0..{self.workers - 1}")

    def state(self, worker: int) -> str:
        self.check(worker)
        return self._members[worker].state

    def states(self) -> dict[int, str]:
        return {w: m.state for w, m in self._members.items()}

    def address(self, worker: int) -> str | None:
        return self._members[worker].address

    def addresses(self) -> dict[int, str | None]:
        """Where each worker joined from (None: not this epoch)."""
        return {w: m.address for w, m in self._members.items()}

    def live(self) -> set[int]:
        """Workers still to push this epoch: expected or active (not done, not lost)."""
        return {w for w, m in self._members.items() if m.state in ("expected", "active")}

    def begin_epoch(self, present: int | None = None) -> None:
        """Expect workers ``0..present-1`` (all by default); the others are absent."""
        present = self.workers if present is None else present
        for w, member in self._members.items():
            member.state = "expected" if w < present else "absent"
            member.address, member.waiting_since = None, None

    def sharing(self, worker: int, address: str | None) -> int | None:
        """Another active worker on ``address``, if any."""
        return next((w for w, m in self._members.items() if w != worker and address
                     and m.state == "active" and m.address == address), None)

    def set(self, worker: int, state: str, address: str | None = None) -> str:
        """Move ``worker`` to ``state``; returns the state it was in."""
        self.check(worker)
        member = self._members[worker]
        before = member.state
        member.state, member.waiting_since = state, None
        if address is not None:
            member.address = address
        return before

    def heard(self, worker: int) -> None:
        """``worker`` pushed: whatever it is waited for, it is not silent."""
        self._members[worker].waiting_since = None

    def counted(self, worker: int, position: tuple[int, int]) -> None:
        """One more contribution of ``worker``, which has now consumed ``position``."""
        self.clocks[worker] += 1
        self.positions[worker] = position

    def position_in(self, worker: int, epoch: int) -> int:
        """Batches ``worker`` has consumed of ``epoch`` (0 if it has not started it)."""
        at_epoch, batches = self.positions.get(worker, (epoch, 0))
        return batches if at_epoch == epoch else 0

    def mark_waiting(self, waiting: set[int], now: float) -> None:
        for w, member in self._members.items():
            if w not in waiting:
                member.waiting_since = None
            elif member.waiting_since is None:
                member.waiting_since = now

    def waited(self, worker: int, now: float) -> float:
        since = self._members[worker].waiting_since
        return 0.0 if since is None else now - since

    def state_dict(self) -> dict[str, Any]:
        return {"clocks": list(self.clocks),
                "positions": {w: list(p) for w, p in self.positions.items()}}

    def load_state_dict(self, state: dict[str, Any], any_count: bool = False) -> None:
        """``any_count``: the checkpoint may have another number of workers (work claimed on
        demand): the workers in both keep their clocks, new ones start at 0."""
        clocks = [int(c) for c in state["clocks"]]
        if len(clocks) != self.workers and not any_count:
            raise ValueError(f"the checkpoint has {len(clocks)} workers, this run "
                             f"{self.workers}")
        self.clocks = (clocks + [0] * self.workers)[:self.workers]
        self.positions = {int(w): (int(p[0]), int(p[1]))
                          for w, p in state["positions"].items() if int(w) < self.workers}


class Watchdog:
    """Drops the workers an update waits for whose Dask worker died or that stay silent
    for ``timeout`` seconds: a barrier never waits on the dead."""

    def __init__(self, membership: Membership, waiting_for: Callable[[], set[int]],
                 drop: Callable[[int, str], Awaitable[None]],
                 alive: Callable[[], Awaitable[set[str] | None]], *, interval: float,
                 timeout: float) -> None:
        self.membership = membership
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
        self.membership.mark_waiting(waiting, now)
        if not waiting:
            return
        alive = await self._alive()
        for w in sorted(waiting):
            address = self.membership.address(w)
            if alive is not None and address is not None and address not in alive:
                await self._drop(w, f"its Dask worker {address} is gone")
            elif self.membership.waited(w, now) > self.timeout:
                await self._drop(w, f"nothing for {self.timeout:g}s")
