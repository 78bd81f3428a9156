"""The prefetch bound: rows of prefetch one consumer may hold in flight."""

from __future__ import annotations

import threading

from dasktrain.pipeline.plan import EpochPlan, Unit

__all__ = ["DEFAULT_PREFETCH", "PrefetchBudget", "prefetch_rows", "unit_rows"]

DEFAULT_PREFETCH = 4
"""Groups of blocks in flight at least, where a pipeline's ``prefetch`` is left to its
default."""


def prefetch_rows(prefetch: int | None, group_rows: int, readers: int, world_size: int,
                  batch_size: int) -> int:
    """Rows one consumer may hold in flight: ``prefetch`` groups of ``group_rows``; by
    default (None) the larger of 4 groups and two batches per process reading for this
    consumer's rank (``readers`` shared by ``world_size`` ranks), as a DataLoader keeps
    two batches per worker process."""
    if prefetch is not None:
        return prefetch * group_rows
    per_rank = -(-readers // world_size)
    return max(DEFAULT_PREFETCH * group_rows, 2 * per_rank * batch_size)


def unit_rows(plan: EpochPlan, unit: Unit) -> int:
    """What a unit costs of the budget: the rows of its window."""
    span = plan.window_spans[unit.window]
    return span.stop - span.start


class PrefetchBudget:
    """Rows of prefetch still free: a unit takes its window's rows until it is used up.

    Counted in rows rather than units so that the small windows that start an epoch (see
    :class:`~dasktrain.pipeline.plan.EpochPlan`) do not take a whole slot each. The feeder
    takes rows, the consumer gives them back; the count is the one thing both touch, and
    only under the condition's lock.
    """

    def __init__(self, rows: int) -> None:
        self._free = rows
        self._cond = threading.Condition()

    def _acquire(self, rows: int, timeout: float) -> bool:
        with self._cond:
            if self._free < rows:
                self._cond.wait(timeout)
            if self._free >= rows:
                self._free -= rows
                return True
            return False

    def release(self, rows: int) -> None:
        """Give back the rows of a unit the consumer has used up (or that was dropped)."""
        with self._cond:
            self._free += rows
            self._cond.notify_all()

    def take(self, rows: int, stop: threading.Event,
             finishing: threading.Event | None = None) -> bool:
        """Wait for ``rows`` of free prefetch. False once the consumer has stopped, or (given
        ``finishing``: the epoch is consumed, nothing more will be freed) none is left."""
        while True:
            # Nothing will be freed once finishing: no wait for it then.
            wait = 0.1 if finishing is None else 0.0 if finishing.is_set() else 0.01
            if self._acquire(rows, timeout=wait):
                if stop.is_set():
                    self.release(rows)
                    return False
                return True
            if stop.is_set() or (finishing is not None and finishing.is_set()):
                return False
