"""A :class:`ChannelServer` on an event loop of the test's own, for tests of the channel's
wire without a holder."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from dasktrain.trainer.channel import ChannelServer, Order, PushFunction


@contextlib.contextmanager
def serve_channel(push: PushFunction, size: int, idle_timeout: float = 600.0,
                  order: Order | None = None, shared_memory: bool = True
                  ) -> Iterator[ChannelServer]:
    """A server of ``size`` values answering with ``push``, on its own thread's loop."""
    server = ChannelServer(push, size, idle_timeout=idle_timeout, order=order,
                           shared_memory=shared_memory)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start("127.0.0.1"), loop).result(10)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
