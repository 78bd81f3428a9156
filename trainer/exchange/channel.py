"""A direct TCP connection per trainer worker to the holder, for gradients and parameters.

Dask's actor calls cost milliseconds each (a message through the worker's RPC layer, a
task-like dispatch, serialisation into frames and back), several times what the bytes take
on the wire. Pushes, the only calls made every step, therefore go over a plain socket of
their own: a fixed header, then the raw float32 payload, received straight into a buffer
that is reused step after step. Everything else (joining, progress, checkpoints) stays on
the actor.

The holder listens on its worker's own host (the interface Dask already uses) on a port
chosen by the system and, on Linux, on a local socket of a random abstract name: a worker on
the same host (every GPU of a machine, a LocalCluster) connects there, and moves bytes two
to three times faster than through TCP on the loopback interface; elsewhere that connect
fails at once and TCP serves. A connection is accepted only after it presents its worker's
token, which each worker receives through the actor. Clusters whose comm is not plain TCP
(TLS, UCX) keep every call on the actor, and so does a worker that cannot reach the port.

Payloads travel in the order of :mod:`.buckets` (so a gradient can leave during backward).
The holder moves large payloads on threads of its own, with the socket blocking, rather than
a socket-buffer's worth per turn of its event loop.

The port is open to anyone who can reach the host, so the holder's worker process defends
itself: it keeps at most ``_MAX_UNAUTHENTICATED`` connections waiting for their token (a
newer one pushes the oldest out, see :mod:`.admission`) and each only ``_HELLO_TIMEOUT``
seconds; a worker's token, derived from a secret of the holder and the worker's number,
admits that worker only (so no worker can take over another's connection), and a wrong one
is answered with a refusal; and a connection that sends nothing for ``idle_timeout``
seconds, between pushes or in the middle of one, is ended. A worker silent for half that
long connects afresh before its next push. A worker retries a connection that fails and,
having given up, pushes through the actor until it gets back (see :mod:`.reconnect`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import math
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from dasktrain.trainer.errors import HolderLost, TrainerError
from dasktrain.trainer.exchange import shared
from dasktrain.trainer.exchange.admission import WaitingRoom
from dasktrain.trainer.exchange.reconnect import ChannelRefused, connect_retrying

__all__ = ["ChannelClient", "ChannelServer", "OutgoingPush", "channel_host"]

logger = logging.getLogger(__name__)

_TOKEN_BYTES = 16
_HELLO = struct.Struct(f"<{_TOKEN_BYTES}sq")  # token, worker
# version, count, loss, epoch, batches, payload bytes (-1: no batch this step)
_PUSH = struct.Struct("<qqdqqq")
# status, version, bytes of the parameters (or of the error message)
_REPLY = struct.Struct("<qqq")
_OK, _VALUE_ERROR, _TRAINER_ERROR = 0, 1, 2
_ACCEPTED = b"\x01"
_REFUSED = b"\x02"  # a wrong token: the worker does not try again
_DRAIN = 1 << 20  # bytes read at a time from a payload that is refused
_BULK_BYTES = 1 << 20  # payloads from this size move on a thread (see ChannelServer._bulk)
# Replies copied into shared memory up to this size are copied on the loop: a 2 MiB copy
# takes ~0.1 ms there, and ~0.6 ms through a thread (the wake-ups and the GIL handed
# back and forth); larger ones go on a thread, several workers' at once.
_COPY_INLINE_BYTES = 16 << 20
_MOVERS = 8  # threads moving payloads: connections served at once at full speed
_SECRET_BYTES = 32
_CONNECT_TIMEOUT = 10.0  # seconds for one attempt to connect and be accepted
# Seconds a worker keeps trying to connect (see .reconnect) before it pushes through the
# actor: as long as one attempt was given before attempts were retried.
_RECONNECT_WITHIN = 10.0
_HELLO_TIMEOUT = 3.0  # seconds a new connection has to present its token, in all
# Connections still to present a token: each holds a descriptor of the holder's worker
# process until its hello deadline, so a flood of them must not grow without bound (past
# it, the oldest is closed: see .admission).
_MAX_UNAUTHENTICATED = 32
_IDLE_TIMEOUT = 600.0  # default seconds of silence after which a worker's connection ends
_LOG_EVERY = 60.0  # seconds between warnings of refused connections
_SLICE = 2.0  # seconds between liveness checks while a transfer makes no progress
_ACCEPT_RETRY = 0.5  # seconds before accepting again after a failed accept
_LOST_GRACE = 1.0  # seconds the scheduler has to report a dead holder after a dropped connection
# Keep-alive probes (seconds idle, seconds apart, count): a peer that vanished without a
# reset is noticed in about two minutes instead of the system's two hours.
_KEEPALIVE = (60, 10, 6)

Order = tuple[tuple[int, int], ...]  # (start, stop) slices of a payload, as they travel

# Takes a push, returns the reply under a lease (``.array``, ``.version``, ``.release()``).
PushFunction = Callable[..., Awaitable[Any]]


def _local_listener() -> socket.socket | None:
    """A listening socket in Linux's abstract namespace (no file to clean up, gone with the
    process), or None where there is none. Its random name is only learnt through the
    actor, and a connection to it still has to present a worker's token."""
    if not sys.platform.startswith("linux"):
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0dasktrain-channel-{secrets.token_hex(16)}")
        listener.listen(64)
        listener.setblocking(False)
    except OSError:
        listener.close()
        return None
    return listener


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_UNIX:  # same host: no delay to turn off, no peer to vanish
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), _KEEPALIVE,
                           strict=True):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def channel_host(worker_address: str) -> str | None:
    """The host to listen on for a worker at ``worker_address``; None where the cluster's
    comm is not plain TCP."""
    scheme, _, rest = worker_address.partition("://")
    if scheme != "tcp" or not rest:
        return None
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


class _Refusals:
    """Warns of refused connections at most once every ``_LOG_EVERY`` seconds, counting the
    rest: a flood of connections must not become a flood of log lines."""

    def __init__(self) -> None:
        self._quiet_until = -math.inf
        self._unreported = 0

    def note(self, why: str) -> None:
        now = time.monotonic()
        if now < self._quiet_until:
            self._unreported += 1
            return
        others = (f"; {self._unreported} more closed since the last warning"
                  if self._unreported else "")
        logger.warning("parameter holder: closed a push connection: %s%s (further ones in "
                       "the next %.0fs are only counted)", why, others, _LOG_EVERY)
        self._quiet_until = now + _LOG_EVERY
        self._unreported = 0


class ChannelServer:
    """The holder's side: accepts workers' connections and serves their pushes.

    Parameters
    ----------
    push
        The holder's push, awaited for each push received.
    size
        Values (float32) of the model.
    order
        The ``(start, stop)`` slices of a payload in the order they travel (see
        :mod:`.buckets`); default: in one piece.
    shared_memory
        Take the shared memory that workers on this host offer (see :mod:`.shared`), so
        their payloads and replies move no bytes on the socket.
    idle_timeout
        Seconds a worker's connection may send nothing, between pushes or in the middle of
        one, before it is ended (the worker connects again before its next push).
    """

    def __init__(self, push: PushFunction, size: int,
                 idle_timeout: float = _IDLE_TIMEOUT, order: Order | None = None,
                 shared_memory: bool = True) -> None:
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be positive, got {idle_timeout!r}")
        self._push = push
        self._size = size
        self.order: Order = ((0, size),) if order is None else tuple(order)
        _check_order(self.order, size)
        self.idle_timeout = idle_timeout
        self.shared_memory = shared_memory and shared.supported()
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        # (listener, its accept task): TCP, and a local socket where the system has them.
        self._listening: list[tuple[socket.socket, asyncio.Task]] = []
        self.local_name: str | None = None
        self._movers: concurrent.futures.ThreadPoolExecutor | None = None  # see _bulk
        self._tasks: set[asyncio.Task] = set()
        self._sockets: set[socket.socket] = set()
        self._by_worker: dict[int, socket.socket] = {}
        self._waiting = WaitingRoom(_MAX_UNAUTHENTICATED)  # still to present a token
        self._refusals = _Refusals()
        self.address: tuple[str, int] | None = None

    async def start(self, host: str) -> None:
        """Listen on ``host`` (TCP, a port the system chooses) and, on Linux, on a local
        socket of a random abstract name, which workers on the same host reach faster."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        loop = asyncio.get_running_loop()
        self._listening.append((listener, loop.create_task(self._accept(listener))))
        self.address = (host, listener.getsockname()[1])
        local = _local_listener()
        if local is not None:
            self._listening.append((local, loop.create_task(self._accept(local))))
            self.local_name = local.getsockname()

    def contact(self, worker: int) -> dict[str, Any] | None:
        """What ``worker`` needs to connect (sent through the actor): its token admits it
        as ``worker`` only."""
        if self.address is None:
            return None
        return {"host": self.address[0], "port": self.address[1],
                "local": self.local_name, "token": self._token(worker),
                "idle_timeout": self.idle_timeout, "order": self.order,
                "shared": self.shared_memory}

    def _token(self, worker: int) -> bytes:
        # Derived rather than stored: nothing kept per worker, any number checked on arrival.
        message = int(worker).to_bytes(8, "little", signed=True)
        return hmac.new(self._secret, message, "sha256").digest()[:_TOKEN_BYTES]

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if listener.fileno() == -1:  # closed
                    return
                # Out of descriptors, say: keep listening, but not in a busy loop.
                logger.warning("parameter holder: accepting a push connection failed: %s", exc)
                await asyncio.sleep(_ACCEPT_RETRY)
                continue
            try:
                sock.setblocking(False)
                _tune(sock)
            except OSError:  # reset by the peer already
                sock.close()
                continue
            pushed_out = self._waiting.enter(sock)
            if pushed_out is not None:  # its task sees the end, and closes it
                _shut(pushed_out)
                self._refusals.note(f"the oldest of {_MAX_UNAUTHENTICATED} waiting to "
                                    "present a token, for a newer one")
            self._sockets.add(sock)
            self._spawn(self._serve(sock))
            # Let the new connection's task read its hello (a worker sends it as it
            # connects) before a flood's next connection can push it out of the room.
            await asyncio.sleep(0)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        idle = self.idle_timeout
        worker = None
        try:
            hello = bytearray(_HELLO.size)
            # One deadline for the whole hello: trickling it in byte by byte buys no time.
            async with asyncio.timeout(_HELLO_TIMEOUT):
                await _recv_into(loop, sock, memoryview(hello))
            token, claimed = _HELLO.unpack(hello)
            if not hmac.compare_digest(token, self._token(claimed)):
                self._refusals.note(f"a wrong token for worker {claimed}")
                await _send(loop, sock, _HELLO_TIMEOUT, _REFUSED)
                return
            self._waiting.leave(sock)
            worker = claimed
            # A worker that connects again was restarted: its old connection may never see
            # an end (a vanished machine sends no reset) and holds a payload-sized buffer.
            older = self._by_worker.get(worker)
            if older is not None and older is not sock:
                _shut(older)
            self._by_worker[worker] = sock
            await _send(loop, sock, idle, _ACCEPTED)
            regions = None
            if sock.family == socket.AF_UNIX:  # a worker on this host offers shared memory
                regions = await self._take_offer(loop, sock)
                await _send(loop, sock, idle, _ACCEPTED if regions is not None else b"\0")
            payload = (np.empty(self._size, dtype=np.float32) if regions is None
                       else regions.payload)
            view = memoryview(payload).cast("B")
            header = bytearray(_PUSH.size)
            while True:
                await _recv_into(loop, sock, memoryview(header), idle)
                version, count, loss, epoch, batches, nbytes = _PUSH.unpack(header)
                if nbytes not in (-1, view.nbytes):
                    await _drain(loop, sock, nbytes, idle)
                    message = (f"worker {worker} pushed {max(nbytes, 0) // 4} float32 values; "
                               f"the holder's model takes {self._size}: the worker's model "
                               "differs from the holder's")
                    await _send_error(loop, sock, idle, _VALUE_ERROR, message)
                    continue
                grads = None
                if nbytes >= 0:
                    if regions is None:  # else it lies in the shared payload region already
                        await self._bulk(loop, sock,
                                         [view[a * 4:b * 4] for a, b in self.order],
                                         idle, receive=True)
                    grads = payload
                try:
                    lease = await self._push(worker, version, grads, count, loss,
                                             (epoch, batches))
                except ValueError as exc:
                    await _send_error(loop, sock, idle, _VALUE_ERROR, str(exc))
                    continue
                except Exception as exc:
                    await _send_error(loop, sock, idle, _TRAINER_ERROR, str(exc))
                    continue
                out = None
                try:
                    out = memoryview(lease.array).cast("B")
                    if regions is not None:
                        # Into the worker's model; the header after it says it is there.
                        await self._copy(loop, regions.reply, lease.array)
                    await _send(loop, sock, idle, _REPLY.pack(_OK, lease.version, out.nbytes))
                    if regions is None:
                        await self._bulk(loop, sock, [out], idle, receive=False)
                finally:
                    # Sent (or failed): the holder may write to that buffer again.
                    del out
                    lease.release()
        except (ConnectionError, OSError, TimeoutError):
            pass  # the worker went away (it rejoins through the actor if it comes back)
        except Exception:
            logger.exception("parameter holder: a push connection failed")
        finally:
            self._waiting.leave(sock)
            if worker is not None and self._by_worker.get(worker) is sock:
                del self._by_worker[worker]
            self._sockets.discard(sock)
            sock.close()

    def _mover(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._movers is None:
            self._movers = concurrent.futures.ThreadPoolExecutor(
                _MOVERS, thread_name_prefix="dasktrain-channel")
        return self._movers

    async def _take_offer(self, loop: asyncio.AbstractEventLoop, sock: socket.socket
                          ) -> shared.Regions | None:
        """A worker's shared-memory offer (see :mod:`.shared`), read on a thread: the event
        loop cannot receive descriptors."""
        try:
            regions = await loop.run_in_executor(self._mover(), shared.receive_offer, sock,
                                                 self._size, _HELLO_TIMEOUT)
            return regions if self.shared_memory else None
        finally:
            with contextlib.suppress(OSError):
                sock.setblocking(False)

    async def _copy(self, loop: asyncio.AbstractEventLoop, into: np.ndarray,
                    values: np.ndarray) -> None:
        """Copy a reply into shared memory; a large one on a thread, as :meth:`_bulk`
        moves large payloads, so the loop keeps serving."""
        if values.nbytes <= _COPY_INLINE_BYTES:
            np.copyto(into, values)
        else:
            await loop.run_in_executor(self._mover(), np.copyto, into, values)

    async def _bulk(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    views: list[memoryview], idle: float, *, receive: bool) -> None:
        """Move a payload's bytes. Large ones go on a thread of the channel's own, with the
        socket blocking: a tight loop of system calls moves them at the speed of the
        transport, where each step through the event loop would cost a wake-up per
        socket-buffer's worth (hundreds per payload). Meanwhile the loop does not watch
        this socket, and :meth:`close` ends a transfer by shutting it."""
        if sum(v.nbytes for v in views) < _BULK_BYTES:
            for view in views:
                if receive:
                    await _recv_into(loop, sock, view, idle)
                else:
                    await _send(loop, sock, idle, view)
            return
        try:
            move = _recv_slices if receive else _send_slices
            await loop.run_in_executor(self._mover(), move, sock, views, idle)
        finally:
            with contextlib.suppress(OSError):  # closed meanwhile: the caller sees why
                sock.setblocking(False)

    async def stop_accepting(self) -> None:
        """Take no more connections (those open are still served)."""
        # The accept must be cancelled, and its reader unregistered, before the socket
        # closes: the loop's selector must never watch a closed (or reused) descriptor.
        listening, self._listening = self._listening, []
        for _, task in listening:
            task.cancel()
        await asyncio.gather(*(task for _, task in listening), return_exceptions=True)
        for listener, _ in listening:
            listener.close()

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        await self.stop_accepting()
        self.address = None
        # Connections are ended by shutting their sockets, never by cancelling their tasks:
        # a task may be waiting on a barrier future shared with the other workers' pushes,
        # which a cancellation would cancel for all of them.
        for sock in list(self._sockets):
            _shut(sock)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=_CONNECT_TIMEOUT)
        if self._movers is not None:
            self._movers.shutdown(wait=False)


def _check_order(order: Order, size: int) -> None:
    """An order must cover every value of a payload exactly once."""
    ends = [0]
    for start, stop in sorted(order):
        if start != ends[-1] or stop <= start:
            break
        ends.append(stop)
    if ends[-1] != size or len(ends) != len(order) + 1:
        raise ValueError(f"a payload order must tile [0, {size}) with (start, stop) slices, "
                         f"got {order!r}")


def _recv_slices(sock: socket.socket, views: list[memoryview], idle: float) -> None:
    """Fill each of ``views`` in turn from a socket made blocking for it; TimeoutError after
    ``idle`` seconds without a byte."""
    sock.settimeout(idle)
    for view in views:
        got = 0
        while got < view.nbytes:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("connection closed")
            got += n


def _send_slices(sock: socket.socket, views: list[memoryview], idle: float) -> None:
    """Send ``views`` on a socket made blocking for it; TimeoutError after ``idle``
    seconds without progress."""
    sock.settimeout(idle)
    for view in views:
        sock.sendall(view)


def _shut(sock: socket.socket) -> None:
    """End a served connection: its task's next read or write fails and it closes."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview,
                     idle: float | None = None) -> None:
    """Fill ``view``; TimeoutError once ``idle`` seconds pass without a byte (the deadline
    moves with each byte received: a long payload on a slow link is not cut short)."""
    got = 0
    async with asyncio.timeout(idle) as deadline:
        moved = loop.time()
        while got < view.nbytes:
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise ConnectionError("connection closed")
            got += n
            # Moved at most a few times per deadline, not per chunk: a 100 MB payload
            # arrives in thousands of chunks, each reschedule a new timer handle.
            if idle is not None and loop.time() - moved > idle / 8:
                moved = loop.time()
                deadline.reschedule(moved + idle)


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, seconds: float,
                *parts: bytes | memoryview) -> None:
    """Send ``parts`` within ``seconds``: a worker that stops reading must not hold the
    connection (and the parameters being sent) forever."""
    async with asyncio.timeout(seconds):
        for data in parts:
            await loop.sock_sendall(sock, data)


async def _drain(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int,
                 idle: float) -> None:
    scratch = memoryview(bytearray(min(max(nbytes, 0), _DRAIN)))
    left = nbytes
    while left > 0:
        chunk = scratch[: min(left, scratch.nbytes)]
        await _recv_into(loop, sock, chunk, idle)
        left -= chunk.nbytes


async def _send_error(loop: asyncio.AbstractEventLoop, sock: socket.socket, seconds: float,
                      status: int, message: str) -> None:
    data = message.encode()
    await _send(loop, sock, seconds, _REPLY.pack(status, -1, len(data)) + data)


class _Wait:
    """A deadline and what it is for (for the error that says it passed)."""

    __slots__ = ("deadline", "seconds", "what")

    def __init__(self, seconds: float, what: str) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.what = what


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
        try:
            connect_retrying(self._connect, connect_within, _CONNECT_TIMEOUT, self._holder_dead)
        except BaseException:
            self._close_file()
            raise
        self._header = bytearray(_REPLY.size)
        self._pending = False
        self.order: Order = tuple((int(a), int(b)) for a, b in contact.get("order",
                                                                          ((0, size),)))
        _check_order(self.order, size)
        self.order_size = size
        self._outbox: queue.SimpleQueue | None = None  # the sender thread's, once started

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
                self._send(view[start * 4:stop * 4], wait)
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
        if self._outbox is None:
            self._outbox = queue.SimpleQueue()
            threading.Thread(target=self._sender, args=(self._outbox,), daemon=True,
                             name="dasktrain-push-sender").start()
        self._pending = True  # until finish, nothing else may use the socket
        return OutgoingPush(self, memoryview(payload).cast("B"), wait, self._outbox)

    def _start(self, version: int, count: int, loss: float, position: tuple[int, int],
               nbytes: int) -> _Wait:
        """Send the header (on a connection :meth:`_fresh` has just made sure of)."""
        self._last_push = time.monotonic()
        wait = _Wait(self.timeout, "the holder to take a push")
        self._send(_PUSH.pack(version, count, loss, position[0], position[1], nbytes), wait)
        return wait

    def _fresh(self) -> None:
        """Connect afresh if the holder may have ended this connection for being idle."""
        if self._pending:
            raise TrainerError("a push is already waiting for its reply on this channel")
        if time.monotonic() - self._last_push > self._stale_after:
            self.close()
            connect_retrying(self._connect, self._connect_within, _CONNECT_TIMEOUT,
                             self._holder_dead)

    def _sender(self, outbox: queue.SimpleQueue) -> None:
        """Sends queued buckets; a push's first failure is kept for its :meth:`finish`, and
        its remaining buckets are skipped. Ends when the channel closes."""
        while True:
            item = outbox.get()
            if item is None:
                return
            push, view = item
            if view is None:  # the push's end: all before it is sent (or failed)
                push.sent.set()
            elif push.error is None:
                try:
                    self._send(view, push.wait)
                except BaseException as exc:  # handed to the caller, in its thread
                    push.error = exc

    def receive(self, timeout: float, what: str) -> tuple[np.ndarray, int]:
        """The reply to the pending push: the parameters (valid until the next push)."""
        wait = _Wait(timeout, what)
        self._pending = False  # whatever happens now, this reply is being consumed
        self._recv_into(memoryview(self._header), wait)
        status, version, nbytes = _REPLY.unpack(self._header)
        if status != _OK:
            message = bytearray(nbytes)
            self._recv_into(memoryview(message), wait)
            error = ValueError if status == _VALUE_ERROR else TrainerError
            raise error(message.decode(errors="replace"))
        view = memoryview(self._params).cast("B")
        if nbytes != view.nbytes:
            self.close()
            raise TrainerError(f"the holder sent {nbytes} bytes of parameters, expected "
                               f"{view.nbytes}")
        if self.shared is not None:  # written into the reply region before the header
            if self._params is not self.shared.reply:
                np.copyto(self._params, self.shared.reply)
        else:
            self._recv_into(view, wait)
        return self._params, version

    def receive_into(self, into: np.ndarray) -> None:
        """Receive replies into ``into`` from now on: the shared reply region, once the
        worker's model lives there (so a reply costs no copy on this side)."""
        if into.dtype != np.float32 or into.shape != (self._size,) or \
                not into.flags.c_contiguous:
            raise ValueError(f"the receive buffer must be {self._size} contiguous float32 "
                             "values")
        self._params = into

    def _open(self, timeout: float) -> socket.socket:
        """A connection to the holder: its local socket when this worker is on the holder's
        host (it fails at once elsewhere), else TCP."""
        local = self._contact.get("local")
        if local and self.transport != "tcp":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(local)
                self.transport = "local"
                return sock
            except OSError:
                sock.close()  # another host, or another network namespace
        self.transport = "tcp"
        return socket.create_connection((self._contact["host"], self._contact["port"]),
                                        timeout=timeout)

    def _connect(self, timeout: float) -> None:
        """Open the connection and present the worker's token; one attempt, of at most
        ``timeout`` seconds."""
        self._sock = self._open(timeout)
        self._timeout: float | None = timeout  # the socket's, as last set
        try:
            _tune(self._sock)
            self._sock.sendall(_HELLO.pack(self._contact["token"], self._worker))
            wait = _Wait(timeout, "the holder to accept the connection")
            accepted = bytearray(1)
            self._recv_into(memoryview(accepted), wait, handshake=True)
            if accepted == _REFUSED:
                raise ChannelRefused(f"the parameter holder ({self._host}) refused worker "
                                     f"{self._worker}'s token: it is not this holder's")
            self.shared = None
            if self._sock.family == socket.AF_UNIX:
                self._share(wait)
        except BaseException:
            self._sock.close()
            raise
        self._last_push = time.monotonic()  # the holder's idle clock starts now too

    def _share(self, wait: _Wait) -> None:
        """Offer the holder shared memory (see :mod:`.shared`); a local connection always
        says whether it does."""
        if self._offer and self._file is None:
            try:
                self._file, self._regions = shared.create(self._size)
            except OSError as exc:  # no memory files here: bytes over the socket
                logger.info("worker %d: no shared memory with the holder (%s)",
                            self._worker, exc)
                self._offer = False
        shared.offer(self._sock, self._file if self._offer else None, self._size)
        answer = bytearray(1)
        self._recv_into(memoryview(answer), wait, handshake=True)
        if answer == _ACCEPTED:
            self.shared = self._regions
        else:
            self._offer = False

    def _send(self, data: bytes | memoryview, wait: _Wait) -> None:
        view = memoryview(data)
        sent = 0
        while sent < view.nbytes:
            self._set_timeout(wait)
            try:
                sent += self._sock.send(view[sent:])
            except TimeoutError:
                self._check_alive(wait.what)
            except OSError as exc:
                raise self._lost(exc) from exc

    def _recv_into(self, view: memoryview, wait: _Wait, handshake: bool = False) -> None:
        """Fill ``view``. ``handshake``: a connection not yet accepted, which the holder
        may close for a newer one (see :mod:`.admission`): its end is an OSError to retry
        at once, not a lost connection whose holder is given time to be found dead."""
        got = 0
        while got < view.nbytes:
            self._set_timeout(wait)
            try:
                n = self._sock.recv_into(view[got:])
            except TimeoutError:
                self._check_alive(wait.what)
                continue
            except OSError as exc:
                if handshake:
                    raise
                raise self._lost(exc) from exc
            if n == 0:
                if handshake:
                    raise ConnectionError("connection closed by the holder before it was "
                                          "accepted")
                raise self._lost(ConnectionError("connection closed by the holder"))
            got += n

    def _set_timeout(self, wait: _Wait) -> None:
        """Block at most a slice, or what is left of the deadline; fails once it passed.
        (Set only when it changes: every transfer of a push loops through here.)"""
        left = wait.deadline - time.monotonic()
        if left <= 0:
            self.close()
            raise TrainerError(f"no answer from the parameter holder ({self._host}) for "
                               f"{wait.what} after {wait.seconds:.0f}s")
        seconds = min(_SLICE, left)
        if seconds != self._timeout:
            self._sock.settimeout(seconds)
            self._timeout = seconds

    def _check_alive(self, what: str) -> None:
        if not self._alive():
            self.close()
            raise HolderLost(f"the parameter holder's worker ({self._host}) died while "
                             f"waiting for {what}")

    def _holder_dead(self) -> HolderLost | None:
        """HolderLost if the holder's worker is gone (asked between attempts to connect)."""
        if self._alive():
            return None
        return HolderLost(f"the parameter holder's worker ({self._host}) died")

    def _lost(self, exc: BaseException) -> TrainerError:
        """The error for a dropped connection: HolderLost only if the holder's worker is
        gone. A process that dies drops its connections at the moment the scheduler learns
        of it, so it is given a moment to tell."""
        self.close()
        deadline = time.monotonic() + _LOST_GRACE
        while self._alive():
            if time.monotonic() >= deadline:
                return TrainerError(f"lost the connection to the parameter holder "
                                    f"({self._host}), whose worker is still alive: {exc}")
            time.sleep(_LOST_GRACE / 10)
        return HolderLost(f"the parameter holder's worker ({self._host}) died: {exc}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

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


class OutgoingPush:
    """A push being sent bucket by bucket (see :meth:`ChannelClient.begin`)."""

    def __init__(self, channel: ChannelClient, view: memoryview, wait: _Wait,
                 outbox: queue.SimpleQueue) -> None:
        self.wait = wait
        self.error: BaseException | None = None
        self.sent = threading.Event()
        self._channel = channel
        self._view = view
        self._outbox = outbox
        self._ready = [False] * len(channel.order)
        self._next = 0  # the first bucket not yet queued: buckets leave in order
        self._lock = threading.Lock()

    def ready(self, bucket: int) -> None:
        """Bucket ``bucket`` of the channel's order is final: send it when its turn comes
        (callable from any thread, in any order)."""
        order = self._channel.order
        with self._lock:
            self._ready[bucket] = True
            while self._next < len(order) and self._ready[self._next]:
                start, stop = order[self._next]
                self._outbox.put((self, self._view[start * 4:stop * 4]))
                self._next += 1

    def finish(self) -> PendingPush:
        """Send whatever is not sent yet; once all is on its way, the reply's
        :class:`PendingPush`. A failed send fails here as a plain push would."""
        for bucket in range(len(self._ready)):
            self.ready(bucket)
        self._outbox.put((self, None))
        # The sends themselves keep the deadline and check that the holder lives.
        if not self.sent.wait(self.wait.seconds + _CONNECT_TIMEOUT):
            self.error = self.error or TrainerError(
                f"no answer from the parameter holder for {self.wait.what} after "
                f"{self.wait.seconds:.0f}s")
        if self.error is not None:
            self._channel._pending = False
            self._channel.close()
            raise self.error
        return PendingPush(self._channel)


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
