"""A trainer worker's side of the direct channel: its pushes, sent whole or bucket by bucket
while backward still writes the gradient, and the replies (the wire is :mod:`.protocol`'s,
each connection a :class:`~.link.HolderLink`).

Payloads travel in the order of :mod:`.buckets`. A connection the holder may have ended for
being idle (see :mod:`.server`) is replaced before the next push: a worker silent for half
the holder's ``idle_timeout`` connects afresh first. A worker retries a connection that
fails and, having given up, pushes through the actor until it gets back (see
:mod:`.reconnect`). On the holder's host, a connection offers shared memory (see
:mod:`.shared`), and payloads and replies then move no bytes on the socket.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dasktrain.trainer.errors import Fenced, HolderLost, TrainerError
from dasktrain.trainer.exchange import shared
from dasktrain.trainer.exchange.arrival import Arrival
from dasktrain.trainer.exchange.buckets import reply_order
from dasktrain.trainer.exchange.link import HolderLink, Wait
from dasktrain.trainer.exchange.protocol import (
    ACCEPTED,
    CONNECT_TIMEOUT,
    FENCED,
    HELLO,
    OK,
    PUSH,
    REFUSED,
    REPLY,
    VALUE_ERROR,
    Order,
    check_order,
    tune,
)
from dasktrain.trainer.exchange.reconnect import ChannelRefused, connect_retrying
from dasktrain.trainer.exchange.streaming import (
    Outbox,
    OutgoingPush,
    receive_pieces,
    start_thread,
)

__all__ = ["ChannelClient", "PendingPush"]

logger = logging.getLogger(__name__)

# Seconds a worker keeps trying to connect (see .reconnect) before it pushes through the
# actor: as long as one attempt was given before attempts were retried.
_RECONNECT_WITHIN = 10.0



class ChannelClient:
    """A trainer worker's side: one blocking socket used from the worker's own thread.

    Replies are received into ``into`` (default: an array of its own), which the returned
    parameters then are: valid until the next push.

    ``alive`` tells whether the holder's worker still exists; it is asked whenever a transfer
    makes no progress for a couple of seconds, so a dead holder fails a wait at once and a
    silent one after ``timeout`` seconds.

    The holder ends a connection silent for the ``idle_timeout`` of ``contact``; a push after
    half that long without one goes over a new connection, made first.

    A connection (the first, or a new one) is tried for ``connect_within`` seconds (default
    ``_RECONNECT_WITHIN``), with retries (see :mod:`.reconnect`); then
    :class:`~.reconnect.ChannelUnavailable` says that the push can go through the actor,
    nothing of it having been sent.
    """

    def __init__(self, contact: dict[str, Any], worker: int, size: int, timeout: float,
                 alive: Callable[[], bool], into: np.ndarray | None = None,
                 connect_within: float | None = None) -> None:
        self.timeout = timeout
        if connect_within is None:
            connect_within = _RECONNECT_WITHIN
        self._connect_within = connect_within
        self._alive = alive
        self._contact = contact
        self._worker = worker
        self._host = f"{contact['host']}:{contact['port']}"
        # Half the holder's deadline: its clock starts after it replies, later than ours
        # (at the push), and the margin covers a slow new connection.
        self._stale_after = float(contact.get("idle_timeout", math.inf)) / 2
        self.transport: str | None = None
        """``"local"`` (a socket on the holder's own host) or ``"tcp"``."""
        # Where replies land (the worker's model itself, when it lives on the CPU).
        self._params = np.empty(size, dtype=np.float32) if into is None else into
        if self._params.dtype != np.float32 or self._params.shape != (size,) \
                or not self._params.flags.c_contiguous:
            raise ValueError(f"the receive buffer must be {size} contiguous float32 values")
        self._size = size
        # Shared memory with the holder (see .shared): offered on every local connection
        # while the holder takes it; once refused, never offered again.
        self._offer = bool(contact.get("shared")) and shared.supported()
        self._file: int | None = None
        self._regions: shared.Regions | None = None
        self.shared: shared.Regions | None = None
        """The regions shared with the holder over the current connection, if any."""
        self._link: HolderLink | None = None
        try:
            connect_retrying(self._connect, connect_within, CONNECT_TIMEOUT, self._holder_dead)
        except BaseException:
            self._close_file()
            raise
        self._header = bytearray(REPLY.size)
        self._pending = False  # a push's reply is still to be read from the connection
        self.order: Order = tuple((int(a), int(b)) for a, b in contact.get("order",
                                                                          ((0, size),)))
        check_order(self.order, size)
        self.order_size = size
        self._reply_order = reply_order(self.order)
        self._outbox: Outbox | None = None  # the sender thread's, once started
        self.stream_replies = False
        """Receive a reply's parameters on the channel's thread, bucket by bucket, while
        the caller goes on (see :mod:`.arrival`): :attr:`arrival` tells what has landed."""
        self.arrival: Arrival | None = None
        """The reply still arriving, if any (None once it is all in place)."""

    def push(self, version: int, grads: np.ndarray | None, count: int, loss: float,
             position: tuple[int, int]) -> PendingPush:
        """Send one push; the reply is read by the returned object's ``result``."""
        if grads is not None and (not isinstance(grads, np.ndarray) or grads.ndim != 1
                                  or grads.dtype != np.float32):
            raise ValueError(f"a push carries a 1-D float32 array, got "
                             f"{getattr(grads, 'dtype', type(grads).__name__)} of shape "
                             f"{getattr(grads, 'shape', '?')}")
        data = None if grads is None else np.ascontiguousarray(grads)
        nbytes = -1 if data is None else data.nbytes
        # First: a new connection decides whether memory is shared (or no longer is).
        self._fresh()
        regions = self.shared
        if regions is not None and data is not None and data.size == self._size:
            if data.ctypes.data != regions.payload.ctypes.data:
                np.copyto(regions.payload, data)
            self._start(version, count, loss, position, nbytes)
            self._pending = True
            return PendingPush(self)
        wait = self._start(version, count, loss, position, nbytes)
        if data is not None:
            view = memoryview(data).cast("B")
            # A payload of another size goes whole: the holder drains it and says why.
            pieces = self.order if data.size == self.order_size else ((0, data.size),)
            for start, stop in pieces:
                self._link.send(view[start * 4:stop * 4], wait)
        self._pending = True
        return PendingPush(self)

    def begin(self, version: int, count: int, loss: float, position: tuple[int, int],
              payload: np.ndarray) -> OutgoingPush:
        """Start a push whose ``payload`` is still being written: its buckets (the slices of
        :attr:`order`) are sent, in order, as the caller marks them ready with
        :meth:`OutgoingPush.ready`, by a thread of this channel; :meth:`OutgoingPush.finish`
        sends the rest and returns the reply's :class:`PendingPush`. The caller must not
        write to a bucket after marking it ready."""
        size = self.order_size
        self._fresh()
        if self.shared is not None:
            # The header would have the holder read the payload before it is written.
            raise TrainerError("a push over shared memory is not sent bucket by bucket")
        if payload.dtype != np.float32 or payload.shape != (size,) or \
                not payload.flags.c_contiguous:
            raise ValueError(f"a streamed push carries the whole payload: {size} contiguous "
                             "float32 values")
        wait = self._start(version, count, loss, position, payload.nbytes)
        self._pending = True  # until finish, nothing else may use the socket
        return OutgoingPush(self._link, memoryview(payload).cast("B"), self.order, wait,
                            self._thread_outbox(), reply=PendingPush(self),
                            abandon=self._abandon)

    def _thread_outbox(self) -> Outbox:
        """The queue of the channel's thread (started on first use), which sends a push's
        buckets and receives a streamed reply's, one job after another."""
        if self._outbox is None:
            self._outbox = start_thread()
        return self._outbox

    def _start(self, version: int, count: int, loss: float, position: tuple[int, int],
               nbytes: int) -> Wait:
        """Send the header (on a connection :meth:`_fresh` has just made sure of)."""
        self._last_push = time.monotonic()
        wait = Wait(self.timeout, "the holder to take a push")
        self._link.send(PUSH.pack(version, count, loss, position[0], position[1], nbytes),
                        wait)
        return wait

    def settle(self) -> None:
        """Wait until the last reply has all arrived (raising what stopped it)."""
        arrival = self.arrival
        if arrival is not None:
            arrival.wait()
            self.arrival = None

    def _fresh(self) -> None:
        """Connect afresh if the holder may have ended this connection for being idle."""
        self.settle()
        if self._pending:
            raise TrainerError("a push is already waiting for its reply on this channel")
        if time.monotonic() - self._last_push > self._stale_after:
            self.close()
            connect_retrying(self._connect, self._connect_within, CONNECT_TIMEOUT,
                             self._holder_dead)

    def _abandon(self) -> None:
        """A streamed push failed part-way (see :meth:`OutgoingPush.finish`): no reply will
        come, and part of the push may be on the connection, so the next push connects
        afresh."""
        self._pending = False
        self.close()

    def receive(self, timeout: float, what: str) -> tuple[np.ndarray, int]:
        """The reply to the pending push: the parameters (valid until the next push)."""
        wait = Wait(timeout, what)
        self._pending = False  # whatever happens now, this reply is being consumed
        self._link.recv_into(memoryview(self._header), wait)
        status, version, nbytes = REPLY.unpack(self._header)
        if status != OK:
            message = bytearray(nbytes)
            self._link.recv_into(memoryview(message), wait)
            text = message.decode(errors="replace")
            if status == FENCED:
                raise Fenced(self._worker, int(self._contact["incarnation"]), text, what)
            error = ValueError if status == VALUE_ERROR else TrainerError
            raise error(text)
        view = memoryview(self._params).cast("B")
        if nbytes != view.nbytes:
            self.close()
            raise TrainerError(f"the holder sent {nbytes} bytes of parameters, expected "
                               f"{view.nbytes}")
        if self.shared is not None:  # written into the reply region before the header
            if self._params is not self.shared.reply:
                np.copyto(self._params, self.shared.reply)
            return self._params, version
        pieces = [view[a * 4:b * 4] for a, b in self._reply_order]
        if not self.stream_replies:
            for piece in pieces:
                self._link.recv_into(piece, wait)
            return self._params, version
        arrival = self.arrival = Arrival(len(pieces), what, timeout)
        self._thread_outbox().put(functools.partial(receive_pieces, self._link, pieces,
                                                    wait, arrival))
        return self._params, version

    def receive_into(self, into: np.ndarray) -> None:
        """Receive replies into ``into`` from now on: the shared reply region, once the
        worker's model lives there (so a reply costs no copy on this side)."""
        if into.dtype != np.float32 or into.shape != (self._size,) or \
                not into.flags.c_contiguous:
            raise ValueError(f"the receive buffer must be {self._size} contiguous float32 "
                             "values")
        self._params = into

    def _open(self, timeout: float) -> HolderLink:
        """A connection to the holder: its local socket when this worker is on the holder's
        host (it fails at once elsewhere), else TCP."""
        name = self._contact.get("local")
        if name and self.transport != "tcp":
            link = HolderLink.local(name, timeout, self._host, self._alive)
            if link is not None:
                self.transport = "local"
                return link
        self.transport = "tcp"
        return HolderLink.tcp((self._contact["host"], self._contact["port"]), timeout,
                              self._alive)

    def _connect(self, timeout: float) -> None:
        """Open the connection and present the worker's token; one attempt, of at most
        ``timeout`` seconds."""
        link = self._link = self._open(timeout)
        try:
            tune(link.sock)
            link.sock.sendall(HELLO.pack(self._contact["token"], self._worker,
                                         int(self._contact["incarnation"])))
            wait = Wait(timeout, "the holder to accept the connection")
            accepted = bytearray(1)
            link.recv_into(memoryview(accepted), wait, handshake=True)
            if accepted == REFUSED:
                raise ChannelRefused(f"the parameter holder ({self._host}) refused worker "
                                     f"{self._worker}'s connection: its token is not this "
                                     "holder's, or a newer task of the worker connected")
            self.shared = None
            if link.sock.family == socket.AF_UNIX:
                self._share(link, wait)
        except BaseException:
            link.close()
            raise
        self._last_push = time.monotonic()  # the holder's idle clock starts now too

    def _share(self, link: HolderLink, wait: Wait) -> None:
        """Offer the holder shared memory (see :mod:`.shared`); a local connection always
        says whether it does."""
        if self._offer and self._file is None:
            try:
                self._file, self._regions = shared.create(self._size)
            except OSError as exc:  # no memory files here: bytes over the socket
                logger.info("worker %d: no shared memory with the holder (%s)",
                            self._worker, exc)
                self._offer = False
        shared.offer(link.sock, self._file if self._offer else None, self._size)
        answer = bytearray(1)
        link.recv_into(memoryview(answer), wait, handshake=True)
        if answer == ACCEPTED:
            self.shared = self._regions
        else:
            self._offer = False

    def _holder_dead(self) -> HolderLost | None:
        """HolderLost if the holder's worker is gone (asked between attempts to connect)."""
        if self._alive():
            return None
        return HolderLost(f"the parameter holder's worker ({self._host}) died")

    def close(self) -> None:
        if self._link is not None:
            self._cut_arrival()
            self._link.close()

    def _cut_arrival(self) -> None:
        """End a reply still arriving before its socket closes: the thread receiving it
        must not be left reading a descriptor number that the process may give to another
        socket. Shutting the socket down wakes that thread (its receive fails); the
        descriptor is closed once it has stopped."""
        arrival, self.arrival = self.arrival, None
        if arrival is None or arrival.complete:
            return
        with contextlib.suppress(OSError):
            self._link.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            arrival.wait()

    def stop(self) -> None:
        """Close the connection, the shared memory file and end the sender thread."""
        self.close()
        self._close_file()
        if self._outbox is not None:
            self._outbox.put(None)
            self._outbox = None

    def _close_file(self) -> None:
        if self._file is not None:  # the mappings keep the memory while anyone uses it
            os.close(self._file)
            self._file = None


class PendingPush:
    """The reply to a push still on its way (like a future: ``result(timeout)``)."""

    def __init__(self, channel: ChannelClient) -> None:
        self._channel = channel
        self._value: tuple[np.ndarray, int] | None = None

    def result(self, timeout: float | None = None, what: str = "a push"
               ) -> tuple[np.ndarray, int]:
        """The parameters and their version; waits up to ``timeout`` seconds (default: the
        channel's), checking all the while that the holder's worker lives."""
        if self._value is None:
            seconds = self._channel.timeout if timeout is None else timeout
            self._value = self._channel.receive(seconds, what)
        return self._value
