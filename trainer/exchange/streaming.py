"""The direct channel's own thread on a worker: a push's buckets going out while backward
still computes them, and a streamed reply's coming in while the next forward pass runs (see
:mod:`.client`, whose :class:`~.client.ChannelClient` queues the jobs, and :mod:`.arrival`).
One thread per channel runs its jobs in order, so the socket has one user on each side of
a push: the sends, then the receive.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

from dasktrain.trainer.errors import TrainerError
from dasktrain.trainer.exchange.arrival import Arrival
from dasktrain.trainer.exchange.link import HolderLink, Wait
from dasktrain.trainer.exchange.protocol import CONNECT_TIMEOUT, Order

__all__ = ["Outbox", "OutgoingPush", "receive_pieces", "send_queued", "start_thread"]

Outbox = queue.SimpleQueue[Callable[[], None] | None]
"""The jobs of a channel's thread: a bucket to send, the end of a push, a reply to receive;
None ends the thread."""


def start_thread() -> Outbox:
    """Start a channel's thread; its queue."""
    outbox: Outbox = queue.SimpleQueue()
    threading.Thread(target=send_queued, args=(outbox,), daemon=True,
                     name="dasktrain-push-sender").start()
    return outbox


def receive_pieces(link: HolderLink, pieces: list[memoryview], wait: Wait,
                   arrival: Arrival) -> None:
    """On the channel's thread: receive a reply's buckets in turn, telling ``arrival``;
    a failure is told to it, and the connection closed (part of the reply is unread)."""
    try:
        for bucket, piece in enumerate(pieces):
            link.recv_into(piece, wait)
            arrival.landed(bucket)
    except BaseException as exc:  # handed to the readers, in their threads
        link.close()
        arrival.failed(exc)


def send_queued(outbox: Outbox) -> None:
    """A channel's thread: runs its jobs (see :data:`Outbox`) in order, until the channel
    stops."""
    while (send := outbox.get()) is not None:
        send()


class OutgoingPush:
    """A push being sent bucket by bucket (see :meth:`.client.ChannelClient.begin`), on ``link``
    by the channel's sender thread, which ``outbox`` feeds; ``reply`` is returned once all
    is sent, and ``abandon`` called if that failed."""

    def __init__(self, link: HolderLink, view: memoryview, order: Order, wait: Wait,
                 outbox: Outbox, *, reply: Any,
                 abandon: Callable[[], None]) -> None:
        self._link = link
        self._view = view
        self._order = order
        self._wait = wait
        self._outbox = outbox
        self._reply = reply
        self._abandon = abandon
        # Set by the sender thread alone: the push's first failed send, or that all is sent.
        self._sent: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ready = [False] * len(order)
        self._next = 0  # the first bucket not yet queued: buckets leave in order
        self._lock = threading.Lock()

    def ready(self, bucket: int) -> None:
        """Bucket ``bucket`` of the channel's order is final: send it when its turn comes
        (callable from any thread, in any order)."""
        with self._lock:
            self._ready[bucket] = True
            while self._next < len(self._order) and self._ready[self._next]:
                start, stop = self._order[self._next]
                self._outbox.put(functools.partial(self._send, self._view[start * 4:stop * 4]))
                self._next += 1

    def finish(self) -> Any:
        """Send whatever is not sent yet; once all is on its way, the reply's
        :class:`~.client.PendingPush`. A failed send fails here as a plain push would."""
        for bucket in range(len(self._ready)):
            self.ready(bucket)
        self._outbox.put(self._end)
        # The sends themselves keep the deadline and check that the holder lives.
        try:
            error = self._sent.exception(self._wait.seconds + CONNECT_TIMEOUT)
        except TimeoutError:
            error = TrainerError(f"no answer from the parameter holder for "
                                 f"{self._wait.what} after {self._wait.seconds:.0f}s")
        if error is not None:
            self._abandon()
            raise error
        return self._reply

    def _send(self, view: memoryview) -> None:
        """On the sender thread: send a bucket, unless one before it failed."""
        if self._sent.done():
            return
        try:
            self._link.send(view, self._wait)
        except BaseException as exc:  # handed to the caller, in its thread
            self._sent.set_exception(exc)

    def _end(self) -> None:
        """On the sender thread: every bucket before this is sent (or one failed)."""
        if not self._sent.done():
            self._sent.set_result(None)
