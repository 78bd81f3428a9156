"""A push's payload arriving slice by slice: which of its slices are in, for a reader that
uses them before the rest has come (the holder's early mean, see
:mod:`dasktrain.trainer.holder.early`).

The holder's channel receives a payload in the slices of its order (see :mod:`.buckets`), on
a mover thread (see :mod:`.transfer`); each slice is told here once it is whole. A transfer
that fails says so, so that no reader waits for a slice that will not come.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from dasktrain.trainer.exchange.protocol import Order

__all__ = ["Arriving", "Landing"]


class Landing:
    """The slices of ``order`` received so far of one payload (they arrive in order)."""

    def __init__(self, order: Order) -> None:
        self.order = order
        self._changed = threading.Condition()
        self._landed = 0  # slices whole, from the first
        self._failed = False

    @property
    def failed(self) -> bool:
        """The transfer ended before every slice was in."""
        return self._failed

    @property
    def complete(self) -> bool:
        return self._landed == len(self.order)

    def landed(self, index: int) -> None:
        """Slice ``index`` (and every one before it) is whole."""
        with self._changed:
            self._landed = max(self._landed, index + 1)
            self._changed.notify_all()

    def fail(self) -> None:
        """The transfer failed: the slices not yet in will not come."""
        with self._changed:
            if not self.complete:
                self._failed = True
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake the readers waiting, to look again at why they wait."""
        with self._changed:
            self._changed.notify_all()

    def wait(self, index: int, timeout: float) -> bool:
        """Whether slice ``index`` is in: waits until it is, the transfer failed, someone
        called :meth:`wake`, or ``timeout`` seconds passed."""
        with self._changed:
            if self._landed <= index and not self._failed:
                self._changed.wait(timeout)
            return self._landed > index


#: ``(worker, incarnation, version, count, loss, payload, landing)``: a push's payload is
#: arriving into ``payload``, slice by slice as ``landing`` tells; the push itself follows
#: once it is in.
Arriving = Callable[[int, int, int, int, float, np.ndarray, Landing], None]
