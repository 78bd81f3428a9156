"""The holder's end of the direct channel: opened when the first worker from another process
joins, a contact (address and token) for each worker, and the actor's calls instead when it
cannot be opened.

It runs in the holder's process, as the channel's server does, and lives beside that server
in the exchange rather than in the holder's room: the actor asks it for a worker's contact
and closes it, and knows nothing else of the channel, so that the channel can change (its
protocol, server and client) without the actor.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dasktrain.trainer.exchange.buckets import bucket_order
from dasktrain.trainer.exchange.landing import Arriving
from dasktrain.trainer.exchange.server import ChannelServer, SharedReply
from dasktrain.trainer.flat import FlatLayout

__all__ = ["HolderChannel", "channel_host"]

logger = logging.getLogger(__name__)

Exchange = Callable[..., Awaitable[Any]]  # the holder's exchange, called for each push


def channel_host(worker_address: str) -> str | None:
    """The host to listen on for a worker at ``worker_address``; None where the cluster's
    comm is not plain TCP."""
    scheme, _, rest = worker_address.partition("://")
    if scheme != "tcp" or not rest:
        return None
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


class HolderChannel:
    """The direct channel of one holder, opened on first use.

    Parameters
    ----------
    exchange
        The holder's ``exchange``, which every push received is handed to.
    layout, payload_size
        What the holder keeps, and the float32 values of one push (with optimizer state in
        averaging modes): the order of the buckets a payload travels in.
    worker_address
        The Dask address of the holder's worker (None outside a cluster: no channel).
    enabled, shared_memory, bucket_bytes
        :class:`~dasktrain.trainer.holder.config.HolderConfig`'s ``direct_channel``,
        ``shared_memory`` and ``bucket_bytes``.
    shared_reply, arriving
        Told of each worker's reply region in shared memory, and of each payload as it
        begins to arrive on a socket (see :class:`ChannelServer`).
    """

    def __init__(self, exchange: Exchange, layout: FlatLayout, payload_size: int, *,
                 worker_address: str | None, enabled: bool = True, shared_memory: bool = True,
                 bucket_bytes: int, shared_reply: SharedReply | None = None,
                 arriving: Arriving | None = None) -> None:
        self._exchange = exchange
        self._layout = layout
        self._payload_size = payload_size
        self._worker_address = worker_address
        self._enabled = enabled and worker_address is not None
        self._shared_memory = shared_memory
        self._bucket_bytes = bucket_bytes
        self._shared_reply = shared_reply
        self._arriving = arriving
        self.server: ChannelServer | None = None
        """The channel's server, once open."""

    async def contact(self, worker: int, incarnation: int) -> dict[str, Any] | None:
        """Where ``worker``'s ``incarnation`` connects for pushes, with its own token (None:
        it pushes through the actor); the listener opens on first use, and once it failed
        to, never again."""
        if not self._enabled:
            return None
        if self.server is None:
            host = channel_host(self._worker_address)
            if host is None:
                return None
            server = ChannelServer(self._exchange, self._payload_size,
                                   order=bucket_order(self._layout, self._payload_size,
                                                      self._bucket_bytes),
                                   shared_memory=self._shared_memory,
                                   shared_reply=self._shared_reply,
                                   arriving=self._arriving)
            try:
                await server.start(host)
            except OSError as exc:
                logger.warning("holder: no direct channel on %s (%s); pushes go through "
                               "the actor", host, exc)
                self._enabled = False
                return None
            self.server = server
        return self.server.contact(worker, incarnation)

    @property
    def address(self) -> tuple[str, int] | None:
        """Where the channel listens for TCP connections; None before it opened."""
        return None if self.server is None else self.server.address

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
