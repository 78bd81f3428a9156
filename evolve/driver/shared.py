"""Objects the driver places on the cluster for a generation's tasks (its update record, a
snapshot of the state), and the count of the bytes they cost.

An object is scattered to the workers that will need it and its tasks take it as a Dask
dependency: Dask delivers it with the first task a worker runs and keeps it there for the
others, and moves it to any other worker that runs one of them. Every copy a worker holds
is counted once, at the object's size: those scattered when it is placed, and those Dask
made since (:meth:`SharedObjects.count_copies` asks the scheduler who holds each).

Scattered data has no recipe: if every worker holding an object dies, it is gone, and so
are the tasks waiting for it (:meth:`SharedObjects.lost` tells; the driver places it anew).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from distributed import Client, Future

__all__ = ["Shared", "SharedObjects"]


@dataclasses.dataclass(slots=True, eq=False)
class Shared:
    """One object on the cluster."""

    future: Future
    size: int
    generation: int
    copies: set[str] = dataclasses.field(default_factory=set)
    """Workers whose copy has been counted."""


class SharedObjects:
    """The shared objects of a run on ``client``'s cluster."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._live: list[Shared] = []
        self.touched: set[str] = set()
        """Every worker that held a copy of an object placed (for the clean-up)."""

    def place(self, key: str, value: Any, size: int, generation: int, workers: list[str]
              ) -> tuple[Shared, int]:
        """Scatter ``value`` (``size`` bytes as it travels) to each of ``workers`` under
        ``key``; returns it and the bytes its copies took."""
        future = self.client.scatter({key: value}, workers=workers, broadcast=True,
                                     hash=False)[key]
        shared = Shared(future, size, generation, set(workers))
        self._live.append(shared)
        self.touched |= shared.copies
        return shared, size * len(workers)

    def count_copies(self, shared: Shared) -> int:
        """Bytes of the copies of ``shared`` made since it was last counted."""
        holders = self.client.who_has([shared.future]).get(shared.future.key, ())
        new = set(holders) - shared.copies
        shared.copies |= new
        self.touched |= new
        return shared.size * len(new)

    @staticmethod
    def lost(shared: Shared | None) -> bool:
        """Whether ``shared`` is gone from the cluster (every worker holding it died)."""
        return shared is not None and shared.future.status != "finished"

    def release(self, shared: Shared | None) -> None:
        """Let the workers drop ``shared``."""
        if shared is not None and shared in self._live:
            self._live.remove(shared)
            shared.future.release()

    def close(self) -> None:
        for shared in list(self._live):
            self.release(shared)
