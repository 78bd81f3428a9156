"""Moving bytes on the holder's side of the direct channel: reads and writes awaited on the
holder's event loop, each with a deadline, and large payloads moved on threads.

The holder moves large payloads on threads of its own (:class:`Movers`), with the socket
blocking, rather than a socket-buffer's worth per turn of its event loop; smaller ones, and
every header, are awaited on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from dasktrain.trainer.exchange import shared
from dasktrain.trainer.exchange.protocol import REPLY

__all__ = ["Movers", "drain", "recv_into", "send", "send_error", "shut"]

_DRAIN = 1 << 20  # bytes read at a time from a payload that is refused
_BULK_BYTES = 1 << 20  # payloads from this size move on a thread (see Movers.bulk)
# Replies copied into shared memory up to this size are copied on the loop: a 2 MiB copy
# takes ~0.1 ms there, and ~0.6 ms through a thread (the wake-ups and the GIL handed
# back and forth); larger ones go on a thread, several workers' at once.
_COPY_INLINE_BYTES = 16 << 20
_MOVERS = 8  # threads moving payloads: connections served at once at full speed


class Movers:
    """The threads that move a channel's large payloads, started on first use."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                _MOVERS, thread_name_prefix="dasktrain-channel")
        return self._pool

    async def _on_thread(self, sock: socket.socket, function: Callable[..., Any],
                         *args: Any) -> Any:
        """``function(*args)`` on a thread, which may make ``sock`` blocking meanwhile;
        the loop does not watch ``sock`` until it is back."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads(), function,
                                                                    *args)
        finally:
            with contextlib.suppress(OSError):  # closed meanwhile: the caller sees why
                sock.setblocking(False)

    async def bulk(self, sock: socket.socket, views: list[memoryview], idle: float, *,
                   receive: bool, landed: Callable[[int], None] | None = None) -> None:
        """Move a payload's bytes. Large ones go on a thread, with the socket blocking: a
        tight loop of system calls moves them at the speed of the transport, where each
        step through the event loop would cost a wake-up per socket-buffer's worth
        (hundreds per payload). A transfer is ended by shutting its socket (:func:`shut`).
        ``landed(i)``: told as each view received is whole."""
        if sum(v.nbytes for v in views) < _BULK_BYTES:
            for index, view in enumerate(views):
                if receive:
                    await recv_into(sock, view, idle)
                    if landed is not None:
                        landed(index)
                else:
                    await send(sock, idle, view)
            return
        if receive:
            await self._on_thread(sock, _recv_slices, sock, views, idle, landed)
        else:
            await self._on_thread(sock, _send_slices, sock, views, idle)

    async def copy(self, into: np.ndarray, values: np.ndarray) -> None:
        """Copy a reply into shared memory; a large one on a thread,
        as :meth:`bulk` moves large payloads, so the loop keeps serving."""
        if values.nbytes <= _COPY_INLINE_BYTES:
            np.copyto(into, values)
        else:
            await asyncio.get_running_loop().run_in_executor(self._threads(), np.copyto, into,
                                                             values)

    async def receive_offer(self, sock: socket.socket, size: int, timeout: float
                            ) -> shared.Regions | None:
        """A worker's shared-memory offer (see :mod:`.shared`), read on a thread: the event
        loop cannot receive descriptors."""
        return await self._on_thread(sock, shared.receive_offer, sock, size, timeout)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def shut(sock: socket.socket) -> None:
    """End a served connection: its task's next read or write fails and it closes."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


async def recv_into(sock: socket.socket, view: memoryview, idle: float | None = None) -> None:
    """Fill ``view``; TimeoutError once ``idle`` seconds pass without a byte (the deadline
    moves with each byte received: a long payload on a slow link is not cut short)."""
    loop = asyncio.get_running_loop()
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


async def send(sock: socket.socket, seconds: float, *parts: bytes | memoryview) -> None:
    """Send ``parts`` within ``seconds``: a worker that stops reading must not hold the
    connection (and the parameters being sent) forever."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(seconds):
        for data in parts:
            await loop.sock_sendall(sock, data)


async def drain(sock: socket.socket, nbytes: int, idle: float) -> None:
    """Read and drop ``nbytes`` (a payload refused), keeping the connection in step."""
    scratch = memoryview(bytearray(min(max(nbytes, 0), _DRAIN)))
    left = nbytes
    while left > 0:
        chunk = scratch[: min(left, scratch.nbytes)]
        await recv_into(sock, chunk, idle)
        left -= chunk.nbytes


async def send_error(sock: socket.socket, seconds: float, status: int, message: str) -> None:
    """Answer a push with ``status`` (not :data:`~.protocol.OK`) and why."""
    data = message.encode()
    await send(sock, seconds, REPLY.pack(status, -1, len(data)) + data)


def _recv_slices(sock: socket.socket, views: list[memoryview], idle: float,
                 landed: Callable[[int], None] | None) -> None:
    """Fill each of ``views`` in turn from a socket made blocking for it, telling
    ``landed`` of each; TimeoutError after ``idle`` seconds without a byte."""
    sock.settimeout(idle)
    for index, view in enumerate(views):
        got = 0
        while got < view.nbytes:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("connection closed")
            got += n
        if landed is not None:
            landed(index)


def _send_slices(sock: socket.socket, views: list[memoryview], idle: float) -> None:
    """Send ``views`` on a socket made blocking for it; TimeoutError after ``idle``
    seconds without progress."""
    sock.settimeout(idle)
    for view in views:
        sock.sendall(view)
