"""The holder's side of the direct channel: it listens, admits trainer workers by their
tokens and serves their pushes (the wire is :mod:`.protocol`'s; the bytes move through
:mod:`.transfer`).

The holder listens on its worker's own host (the interface Dask already uses) on a port
chosen by the system and, on Linux, on a local socket of a random abstract name: a worker on
the same host (every GPU of a machine, a LocalCluster) connects there, and moves bytes two
to three times faster than through TCP on the loopback interface; elsewhere that connect
fails at once and TCP serves. A connection is accepted only after it presents its worker's
token, which each worker receives through the actor. Clusters whose comm is not plain TCP
(TLS, UCX) keep every call on the actor, and so does a worker that cannot reach the port.

The port is open to anyone who can reach the host, so the holder's worker process defends
itself: it keeps at most ``_MAX_UNAUTHENTICATED`` connections waiting for their token (a
newer one pushes the oldest out, see :mod:`.admission`) and each only ``_HELLO_TIMEOUT``
seconds; a worker's token, derived from a secret of the holder, the worker's number and
its incarnation, admits that incarnation only (so no worker can take over another's
connection, and a connection speaks for the incarnation that opened it: once that one is
fenced, so are its pushes, even those already in the socket), and a wrong one is answered
with a refusal; and a connection that sends nothing for ``idle_timeout`` seconds, between
pushes or in the middle of one, is ended.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from dasktrain.trainer.errors import Fenced
from dasktrain.trainer.exchange import shared
from dasktrain.trainer.exchange.admission import Members, Refusals, WaitingRoom, local_listener
from dasktrain.trainer.exchange.buckets import reply_order
from dasktrain.trainer.exchange.landing import Arriving, Landing
from dasktrain.trainer.exchange.protocol import (
    ACCEPTED,
    CONNECT_TIMEOUT,
    FENCED,
    HELLO,
    OK,
    PUSH,
    REFUSED,
    REPLY,
    TOKEN_BYTES,
    TRAINER_ERROR,
    VALUE_ERROR,
    Order,
    check_order,
    tune,
)
from dasktrain.trainer.exchange.transfer import Movers, drain, recv_into, send, send_error, shut

__all__ = ["ChannelServer", "PushFunction", "SharedReply"]

logger = logging.getLogger(__name__)

_SECRET_BYTES = 32
_HELLO_TIMEOUT = 3.0  # seconds a new connection has to present its token, in all
# Connections still to present a token: each holds a descriptor of the holder's worker
# process until its hello deadline, so a flood of them must not grow without bound (past
# it, the oldest is closed: see .admission).
_MAX_UNAUTHENTICATED = 32
_IDLE_TIMEOUT = 600.0  # default seconds of silence after which a worker's connection ends
_ACCEPT_RETRY = 0.5  # seconds before accepting again after a failed accept

# Takes a push, returns the reply under a lease (``.array``, ``.version``, ``.release()``).
PushFunction = Callable[..., Awaitable[Any]]
#: ``(worker, incarnation, region, attached)``: the reply region in shared memory of a
#: worker's incarnation, or its end.
SharedReply = Callable[[int, int, np.ndarray, bool], None]


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
    shared_reply
        Told of each worker's reply region in shared memory as its connection begins and
        ends. A reply whose lease is that region itself (the holder keeps its parameters
        there) is sent as its header alone, and the lease is kept until the worker's next
        push or the connection's end: the worker reads its model meanwhile.
    arriving
        Told as a payload's bytes begin to arrive on the socket (not in shared memory,
        where a payload is whole when its header comes), with a
        :class:`~.landing.Landing` of its slices; ``push`` follows once it is all in.
    """

    def __init__(self, push: PushFunction, size: int,
                 idle_timeout: float = _IDLE_TIMEOUT, order: Order | None = None,
                 shared_memory: bool = True, shared_reply: SharedReply | None = None,
                 arriving: Arriving | None = None) -> None:
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be positive, got {idle_timeout!r}")
        self._push = push
        self._shared_reply = shared_reply
        self._arriving = arriving
        self._size = size
        self.order: Order = ((0, size),) if order is None else tuple(order)
        check_order(self.order, size)
        self._reply_order = reply_order(self.order)
        self.idle_timeout = idle_timeout
        self.shared_memory = shared_memory and shared.supported()
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        # (listener, its accept task): TCP, and a local socket where the system has them.
        self._listening: list[tuple[socket.socket, asyncio.Task]] = []
        self.local_name: str | None = None
        self._movers = Movers()
        self._tasks: set[asyncio.Task] = set()
        self._sockets: set[socket.socket] = set()
        self._members = Members()  # each worker's connection, by incarnation
        self._waiting = WaitingRoom(_MAX_UNAUTHENTICATED)  # still to present a token
        self._refusals = Refusals(logger)
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
        local = local_listener()
        if local is not None:
            self._listening.append((local, loop.create_task(self._accept(local))))
            self.local_name = local.getsockname()

    def contact(self, worker: int, incarnation: int) -> dict[str, Any] | None:
        """What ``worker``'s ``incarnation`` needs to connect (sent through the actor): its
        token admits it as that incarnation only."""
        if self.address is None:
            return None
        return {"host": self.address[0], "port": self.address[1],
                "local": self.local_name, "token": self._token(worker, incarnation),
                "incarnation": incarnation,
                "idle_timeout": self.idle_timeout, "order": self.order,
                "shared": self.shared_memory}

    def _token(self, worker: int, incarnation: int) -> bytes:
        # Derived rather than stored: nothing kept per worker, any number checked on arrival.
        message = struct.pack("<qq", worker, incarnation)
        return hmac.new(self._secret, message, "sha256").digest()[:TOKEN_BYTES]

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
                tune(sock)
            except OSError:  # reset by the peer already
                sock.close()
                continue
            pushed_out = self._waiting.enter(sock)
            if pushed_out is not None:  # its task sees the end, and closes it
                shut(pushed_out)
                self._refusals.note(f"the oldest of {_MAX_UNAUTHENTICATED} waiting to "
                                    "present a token, for a newer one")
            self._sockets.add(sock)
            self._spawn(self._serve(sock))
            # Let the new connection's task read its hello (a worker sends it as it
            # connects) before a flood's next connection can push it out of the room.
            await asyncio.sleep(0)

    async def _serve(self, sock: socket.socket) -> None:
        """Serve one connection until it ends: admit its worker, take the shared memory it
        offers, then answer its pushes."""
        worker = None
        try:
            member = await self._admit(sock)
            if member is not None:
                worker = member[0]
                regions = await self._share(sock)
                if regions is not None and self._shared_reply is not None:
                    self._shared_reply(*member, regions.reply, True)
                try:
                    await self._serve_pushes(sock, member, regions)
                finally:
                    if regions is not None and self._shared_reply is not None:
                        self._shared_reply(*member, regions.reply, False)
        except (ConnectionError, OSError, TimeoutError):
            pass  # the worker went away (it rejoins through the actor if it comes back)
        except Exception:
            logger.exception("parameter holder: a push connection failed")
        finally:
            self._forget(sock, worker)

    async def _admit(self, sock: socket.socket) -> tuple[int, int] | None:
        """The worker and incarnation whose token the connection presents; None for a wrong
        token, which is refused."""
        hello = bytearray(HELLO.size)
        # One deadline for the whole hello: trickling it in byte by byte buys no time.
        async with asyncio.timeout(_HELLO_TIMEOUT):
            await recv_into(sock, memoryview(hello))
        token, worker, incarnation = HELLO.unpack(hello)
        why = None
        if not hmac.compare_digest(token, self._token(worker, incarnation)):
            why = f"a wrong token for worker {worker}"
        elif (newer := self._members.superseding(worker, incarnation)) is not None:
            why = f"worker {worker}'s incarnation {incarnation}, superseded by {newer}"
        if why is not None:
            self._refusals.note(why)
            await send(sock, _HELLO_TIMEOUT, REFUSED)
            return None
        self._waiting.leave(sock)
        if (older := self._members.enter(worker, incarnation, sock)) is not None:
            shut(older)  # see Members
        await send(sock, self.idle_timeout, ACCEPTED)
        return worker, incarnation

    async def _share(self, sock: socket.socket) -> shared.Regions | None:
        """The regions of memory shared with a worker on this host, if it offers them and
        this server takes them; a local connection is always told which."""
        if sock.family != socket.AF_UNIX:
            return None
        regions = await self._movers.receive_offer(sock, self._size, _HELLO_TIMEOUT)
        if not self.shared_memory:
            regions = None
        await send(sock, self.idle_timeout, ACCEPTED if regions is not None else b"\0")
        return regions

    async def _serve_pushes(self, sock: socket.socket, member: tuple[int, int],
                            regions: shared.Regions | None) -> None:
        """Receive a push, hand it to the holder, send the reply; until the connection
        ends. The payload lands in one buffer per connection (the shared region, if any)."""
        idle = self.idle_timeout
        payload = (np.empty(self._size, dtype=np.float32) if regions is None
                   else regions.payload)
        view = memoryview(payload).cast("B")
        header = bytearray(PUSH.size)
        kept = None  # the lease of a reply in the worker's own region, while it reads it
        try:
            while True:
                await recv_into(sock, memoryview(header), idle)
                if kept is not None:  # a push: the worker is done reading its model
                    kept.release()
                    kept = None
                kept = await self._answer(sock, member, header, payload, view, regions)
        finally:
            if kept is not None:
                kept.release()

    async def _answer(self, sock: socket.socket, member: tuple[int, int], header: bytearray,
                      payload: np.ndarray, view: memoryview,
                      regions: shared.Regions | None) -> Any:
        """Take the rest of a push whose header came from ``member`` (worker, incarnation),
        hand it to the holder, reply; the reply's lease if kept (see ``shared_reply``)."""
        idle, worker = self.idle_timeout, member[0]
        version, count, loss, epoch, batches, nbytes = PUSH.unpack(header)
        if nbytes not in (-1, view.nbytes):
            await drain(sock, nbytes, idle)
            await send_error(sock, idle, VALUE_ERROR,
                             f"worker {worker} pushed {max(nbytes, 0) // 4} float32 "
                             f"values; the holder's model takes {self._size}: the "
                             "worker's model differs from the holder's")
            return None
        grads = None
        if nbytes >= 0:
            if regions is None:  # else it lies in the shared payload region already
                await self._receive(sock, view, (*member, version, count, loss, payload))
            grads = payload
        lease = await self._apply(sock, member, version, grads, count, loss,
                                  (epoch, batches))
        if lease is None:
            return None
        return await self._reply(sock, lease, regions)

    async def _receive(self, sock: socket.socket, view: memoryview, push: tuple) -> None:
        """Receive a push's payload (into ``view``), telling ``arriving`` of its slices."""
        landing = None if self._arriving is None else Landing(self.order)
        if landing is not None:
            self._arriving(*push, landing)
        try:
            await self._movers.bulk(sock, [view[a * 4:b * 4] for a, b in self.order],
                                    self.idle_timeout, receive=True,
                                    landed=None if landing is None else landing.landed)
        finally:
            if landing is not None:
                landing.fail()  # a no-op once every slice is in

    async def _apply(self, sock: socket.socket, member: tuple[int, int], version: int,
                     grads: np.ndarray | None, count: int, loss: float,
                     position: tuple[int, int]) -> Any:
        """The holder's reply to a push under a lease; None when it refused the push, which
        the worker is told (its connection stays usable)."""
        try:
            return await self._push(*member, version, grads, count, loss, position)
        except Fenced as exc:
            await send_error(sock, self.idle_timeout, FENCED, exc.reason)
        except ValueError as exc:
            await send_error(sock, self.idle_timeout, VALUE_ERROR, str(exc))
        except Exception as exc:
            await send_error(sock, self.idle_timeout, TRAINER_ERROR, str(exc))
        return None

    async def _reply(self, sock: socket.socket, lease: Any,
                     regions: shared.Regions | None) -> Any:
        """Send the parameters of ``lease`` (into the shared reply region, if any), then
        give the lease back; or keep it, returned, where it is the region itself."""
        idle = self.idle_timeout
        out = None
        in_place = regions is not None and lease.array.ctypes.data == \
            regions.reply.ctypes.data and lease.array.nbytes == regions.reply.nbytes
        if in_place:  # the holder keeps its parameters in the worker's model
            try:
                await send(sock, idle, REPLY.pack(OK, lease.version, lease.array.nbytes))
            except BaseException:
                lease.release()
                raise
            return lease
        try:
            out = memoryview(lease.array).cast("B")
            if regions is not None:
                # Into the worker's model; the header after it says it is there.
                await self._movers.copy(regions.reply, lease.array)
            await send(sock, idle, REPLY.pack(OK, lease.version, out.nbytes))
            if regions is None:
                # In the order a forward pass reads them (see .arrival); whole if the reply
                # is not parameters then buffers.
                pieces = ([out[a * 4:b * 4] for a, b in self._reply_order]
                          if out.nbytes == 4 * self._size else [out])
                await self._movers.bulk(sock, pieces, idle, receive=False)
        finally:
            # Sent (or failed): the holder may write to that buffer again.
            del out
            lease.release()
        return None

    def _forget(self, sock: socket.socket, worker: int | None) -> None:
        """A connection has ended: close it, and drop it wherever it was kept."""
        self._waiting.leave(sock)
        if worker is not None:
            self._members.leave(worker, sock)
        self._sockets.discard(sock)
        sock.close()

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
            shut(sock)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CONNECT_TIMEOUT)
        self._movers.shutdown()
