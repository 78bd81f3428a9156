"""A reply still arriving: the parameters land bucket by bucket while the worker's next
forward pass has begun.

Over TCP a reply of an 8.5 MB model takes milliseconds on the wire, and the next forward
pass needs the first layers first. So the holder sends a reply's buckets in the order a
forward pass reads them (:func:`~.buckets.reply_order`: the buffers, then the parameters
from the first tensor to the last), a thread of the worker's channel receives them straight
into the model, and each module's forward waits only for the buckets that hold its own
tensors (see :mod:`dasktrain.trainer.worker.gate`), as FSDP gathers a module's parameters
just before its forward.
"""

from __future__ import annotations

import threading
import time

from dasktrain.trainer.errors import TrainerError

__all__ = ["Arrival"]

_POLL = 2.0  # seconds between looks at a receiver that may have died without a word


class Arrival:
    """Which buckets of a reply (indices into the channel's reply order) have landed.

    The receiving thread calls :meth:`landed` for each bucket in turn, then nothing more,
    or :meth:`failed` with the error that stopped it; readers :meth:`wait` for buckets.
    """

    def __init__(self, buckets: int, what: str, timeout: float) -> None:
        self._landed = 0  # buckets 0..landed-1 are in place
        self._buckets = buckets
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._what = what
        self._timeout = timeout

    @property
    def complete(self) -> bool:
        return self._landed == self._buckets

    def landed(self, bucket: int) -> None:
        """Bucket ``bucket`` is in place (buckets land in order)."""
        with self._changed:
            self._landed = bucket + 1
            self._changed.notify_all()

    def failed(self, error: BaseException) -> None:
        """The reply will not arrive: every wait raises ``error``."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def wait(self, bucket: int | None = None) -> None:
        """Return once bucket ``bucket`` (None: every bucket) has landed; raise the
        receiver's error if it failed. The receiver keeps the channel's deadline and
        liveness checks, so this wait only guards against a receiver gone silent."""
        needed = self._buckets if bucket is None else bucket + 1
        if self._landed >= needed:  # the common case, without the lock
            return
        deadline = time.monotonic() + self._timeout + _POLL
        with self._changed:
            while self._landed < needed:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrainerError(f"no answer from the parameter holder for "
                                       f"{self._what} after {self._timeout:.0f}s")
                self._changed.wait(min(left, _POLL))
