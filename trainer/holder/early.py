"""A round's mean begun while its last gradients are still arriving.

In ``sync`` every worker waits while the holder averages the round's gradients and steps:
that part of a step is on every worker's critical path. A worker on another host sends its
gradient bucket by bucket during backward (see :mod:`dasktrain.trainer.exchange.buckets`),
so when its last bucket lands, the buckets before it have been in the holder's memory for
milliseconds, and the other workers' gradients (the one in the holder's process, those in
memory shared with it) are whole. Once a round waits for nothing but payloads still
arriving, the holder begins the weighted mean on a thread of its own, bucket by bucket as
each lands; when the round closes, its average finds the mean done but for the last buckets.

Nothing is applied early. The mean is the one the round's update computes: the same
payloads in the same worker order, the same weights, the same element-wise operations, so
the same bits. The finiteness check and the optimizer step still wait for the whole round.
A mean begun for a round that closes otherwise (a worker dropped, a transfer that failed, a
gradient refused) is dropped, and the update computes its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dasktrain.trainer.errors import TrainerError
from dasktrain.trainer.exchange.landing import Landing

if TYPE_CHECKING:  # the modes import the holder's arithmetic, which imports this
    from dasktrain.trainer.modes.base import Contribution

__all__ = ["CHUNK", "EARLY_VALUES", "Arrival", "EarlyMean", "early_round", "lower_priority"]

EARLY_VALUES = 1 << 18  # payloads (float32 values, 1 MiB) from which a mean is begun early
CHUNK = 1 << 16  # values averaged at a time early: between chunks, the update may take over
_LOOK = 1.0  # seconds between looks at a stopped mean while a slice is awaited
_WAIT = 60.0  # seconds to wait for an early mean to stop (it stops after a chunk)


def lower_priority() -> None:
    """Make the calling thread run only on processors nothing else wants (nice 19, on
    Linux): the mean is begun early to use a processor that would idle while the round
    waits, not to take one from a worker's forward and backward on the same host."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    """A worker's payload on its way (see :class:`~dasktrain.trainer.exchange.landing.Landing`),
    as its push's header said."""

    version: int
    count: int
    loss: float
    payload: np.ndarray
    landing: Landing


def early_round(contributions: Iterable[Contribution], waiting_for: set[int],
                arriving: dict[int, Arrival], version: int
                ) -> tuple[list[np.ndarray], list[float], list[Landing | None]] | None:
    """What a round's mean would be made of, if it can be begun now: the payloads in the
    update's order (by worker), their weights and, for those still arriving, their
    landings. None unless the round (``contributions``, gathered for ``version``) waits only
    for workers whose payloads for ``version`` are arriving, and at least two payloads make
    the mean, one of them still arriving. (The holder is told of arriving payloads only
    from :data:`EARLY_VALUES` values.)"""
    coming = {worker: a for worker, a in arriving.items()
              if a.version == version and not a.landing.failed}
    if not coming or waiting_for != set(coming):
        return None
    items = [(c.worker, c.grads, c.count, c.loss, None) for c in contributions]
    items += [(w, a.payload, a.count, a.loss, a.landing) for w, a in coming.items()]
    items.sort(key=lambda item: item[0])  # stable: a worker's batches keep their order
    # As the update takes them: a batch, and a finite loss (see divergence.finite_mean).
    used = [item for item in items
            if item[1] is not None and item[2] > 0 and math.isfinite(item[3])]
    if len(used) < 2 or all(item[4] is None for item in used):
        return None
    return ([item[1] for item in used], [float(item[2]) for item in used],
            [item[4] for item in used])


class EarlyMean:
    """The mean of ``payloads``, written by :meth:`run` (on a thread of low priority, see
    :func:`lower_priority`) slice by slice of their order as each is in every payload, a
    chunk at a time: ``part(slice)`` writes one part of the mean and returns its sum (for
    the finiteness check). The update takes over with :meth:`finish`."""

    def __init__(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
                 landings: Sequence[Landing | None], part: Callable[[slice], float]) -> None:
        self._payloads = list(payloads)  # kept: compared by identity
        self._weights = [float(w) for w in weights]
        self._landings = [landing for landing in landings if landing is not None]
        self._order = self._landings[0].order
        self._part = part
        self._stopped = threading.Event()
        self._done = 0  # slices of the order written whole
        self._sums: list[float] = []  # the sums of those slices' chunks
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(self) -> None:
        """Write the mean, slice by slice as they land, until done or stopped."""
        try:
            for index, (start, stop) in enumerate(self._order):
                for landing in self._landings:
                    while not landing.wait(index, _LOOK):
                        if self._stopped.is_set() or landing.failed:
                            return
                sums = []
                for chunk in range(start, stop, CHUNK):
                    if self._stopped.is_set():
                        return
                    sums.append(self._part(slice(chunk, min(chunk + CHUNK, stop))))
                self._sums += sums
                self._done = index + 1
        except BaseException as exc:  # handed to the update, which computes its own
            self.future.set_exception(exc)
        finally:
            if not self.future.done():
                self.future.set_result(None)

    def finish(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
               write: Callable[[int, int], list[float]]) -> list[float] | None:
        """Stop it and, if it is the mean of these ``payloads`` with these ``weights``,
        write the slices it left with ``write(start, stop)`` (which returns their parts'
        sums): the sums of the whole mean; else None."""
        self.stop()
        same = len(payloads) == len(self._payloads) and all(
            a is b for a, b in zip(payloads, self._payloads, strict=False)) \
            and [float(w) for w in weights] == self._weights
        # A transfer that failed ended its connection: its payload is received again, whole.
        if not same or self.future.exception() is not None \
                or any(landing.failed for landing in self._landings):
            return None
        sums = list(self._sums)
        for start, stop in self._order[self._done:]:
            sums += write(start, stop)
        return sums

    def stop(self) -> None:
        """Stop it, and wait until it no longer writes the mean's buffer (after the chunk
        it is writing)."""
        self._stopped.set()
        for landing in self._landings:
            landing.wake()
        try:
            self.future.exception(_WAIT)
        except concurrent.futures.TimeoutError:
            raise TrainerError(f"an early average did not stop within {_WAIT:.0f}s") \
                from None
