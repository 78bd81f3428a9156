"""Checkpoints at exact update counts: calls that wait for the holder to reach a version and
are answered with its state taken right then, however seldom the caller looks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["StateWaiters"]

State = dict[str, Any]


class StateWaiters:
    """Who waits for which version's state (on the holder's event loop, no locks)."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, asyncio.Future[State]]] = []

    def wait(self, version: int) -> asyncio.Future[State]:
        """A future of the first state taken at ``version`` or later."""
        future: asyncio.Future[State] = asyncio.get_running_loop().create_future()
        self._waiting.append((version, future))
        return future

    def due(self, version: int) -> bool:
        """Whether someone waits for ``version`` or an earlier one."""
        return bool(self._waiting) and version >= min(v for v, _ in self._waiting)

    async def serve(self, take: Callable[[], Awaitable[State]]) -> None:
        """Answer those whose version the state that ``take`` returns has reached."""
        # Taken before the (possibly threaded) copy, so that an update finishing meanwhile
        # does not copy the state a second time for the same requests.
        waiting, self._waiting = self._waiting, []
        state = await take()
        for version, future in waiting:
            if future.done():
                continue
            if state["version"] >= version:
                future.set_result(state)
            else:
                self._waiting.append((version, future))

    def fail(self, error: BaseException) -> None:
        """Fail every waiting call with ``error`` (the run is over)."""
        waiting, self._waiting = self._waiting, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)
