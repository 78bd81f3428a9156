"""Helpers for tests of the direct channel: a :class:`ChannelServer` on an event loop of the
test's own (the channel's wire without a holder), a holder actor on a worker process, and a
flood of connections from a thread of the test's process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from dasktrain.trainer.exchange.protocol import Order
from dasktrain.trainer.exchange.server import ChannelServer, PushFunction, SharedReply
from dasktrain.trainer.holder.actor import ParameterHolder
from tests.common.training import zeros_holder

T = TypeVar("T")

_LOOPS: weakref.WeakKeyDictionary[ChannelServer, asyncio.AbstractEventLoop] = \
    weakref.WeakKeyDictionary()


@contextlib.contextmanager
def serve_channel(push: PushFunction, size: int, idle_timeout: float = 600.0,
                  order: Order | None = None, shared_memory: bool = True,
                  shared_reply: SharedReply | None = None) -> Iterator[ChannelServer]:
    """A server of ``size`` values answering with ``push``, on its own thread's loop."""
    server = ChannelServer(push, size, idle_timeout=idle_timeout, order=order,
                           shared_memory=shared_memory, shared_reply=shared_reply)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    _LOOPS[server] = loop
    try:
        asyncio.run_coroutine_threadsafe(server.start("127.0.0.1"), loop).result(10)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def on_loop(server: ChannelServer, call: Callable[[], Awaitable[T]]) -> T:
    """Await ``call()`` on the loop of a server of :func:`serve_channel`."""
    async def run() -> T:
        return await call()

    return asyncio.run_coroutine_threadsafe(run(), _LOOPS[server]).result(30)


@contextlib.contextmanager
def holder_actor(client: Any, features: int, mode: str = "async") -> Iterator[Any]:
    """A holder actor of two workers on a worker process (plain SGD, lr 1, from zero: see
    :func:`zeros_holder`)."""
    future = client.submit(ParameterHolder, zeros_holder(features, workers=2, mode=mode),
                           actor=True, pure=False)
    actor = future.result(timeout=60)
    try:
        yield actor
    finally:
        actor.close().result(timeout=30)  # closing twice is harmless
        future.release()


def until_waiting_for(holder: Any, workers: list[int]) -> None:
    """Poll the holder until its pending update waits for exactly ``workers``."""
    deadline = time.monotonic() + 30
    while holder.progress().result(timeout=30)["waiting_for"] != workers:
        assert time.monotonic() < deadline, "the holder never got the push"


def channel_addresses(dask_worker: Any) -> list[tuple[str, int]]:
    """Where the open channels of the holders on ``dask_worker`` listen (for ``client.run``:
    how a test learns the channel of a holder that a fit made)."""
    return [tuple(actor.channel_address) for actor in list(dask_worker.state.actors.values())
            if isinstance(actor, ParameterHolder) and actor.channel_address is not None]


class Flood:
    """Connections to ``address`` from a thread of this process, as an attacker's flood.

    Up to ``held`` are open at once; each ``garbage_every``-th sends a hello's worth of
    random bytes, the others never send anything. One the holder ends is replaced by a new
    one, at most ``burst`` per round of ``pace`` seconds. Bounded: the flood ends when
    stopped, after ``seconds``, or after ``total`` connections.
    """

    def __init__(self, address: tuple[str, int], held: int = 64, burst: int = 8,
                 pace: float = 0.01, garbage_every: int = 4, seconds: float = 120.0,
                 total: int = 200_000) -> None:
        assert address[0] == "127.0.0.1", "a flood stays on this host"
        self.address = address
        self.held, self.burst, self.pace = held, burst, pace
        self.garbage_every, self.seconds, self.total = garbage_every, seconds, total
        self.opened = 0
        """Connections opened so far."""
        self.ended_by_holder = 0
        """Connections the holder ended (closed, reset) while the flood held them."""
        self._enough = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flood")

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the flood did not stop"

    def wait_opened(self, count: int, timeout: float) -> None:
        """Wait until ``count`` connections were opened."""
        with self._enough:
            if not self._enough.wait_for(lambda: self.opened >= count or not self.running,
                                         timeout):
                raise TimeoutError(f"the flood opened {self.opened} of {count} connections "
                                   f"in {timeout}s")
        assert self.opened >= count, "the flood ended early"

    def _run(self) -> None:
        held: dict[int, socket.socket] = {}
        poller = select.poll()
        end = time.monotonic() + self.seconds
        try:
            while not self._stop.is_set() and time.monotonic() < end \
                    and self.opened < self.total:
                for fd, _ in poller.poll(0):  # readable: ended by the holder, or a refusal
                    sock = held.pop(fd)
                    poller.unregister(fd)
                    with contextlib.suppress(OSError):
                        sock.recv(64)
                    sock.close()
                    self.ended_by_holder += 1
                for _ in range(min(self.burst, self.held - len(held))):
                    try:
                        sock = socket.create_connection(self.address, timeout=5)
                    except OSError:  # the backlog is full: next round
                        break
                    if self.opened % self.garbage_every == 0:
                        with contextlib.suppress(OSError):
                            sock.sendall(os.urandom(24))
                    held[sock.fileno()] = sock
                    poller.register(sock, select.POLLIN)
                    with self._enough:
                        self.opened += 1
                        self._enough.notify_all()
                self._stop.wait(self.pace)  # the flood's own pace, not a synchronisation
        finally:
            for sock in held.values():
                sock.close()
            with self._enough:
                self._enough.notify_all()
