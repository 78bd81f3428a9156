"""Calling the holder from a trainer worker: in-process when they share a process, pushes
over a direct channel (else the actor's RPC) otherwise, and never waiting without a deadline
and a liveness check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import Client, get_client, get_worker

from dasktrain._cluster import worker_info
from dasktrain.trainer.arithmetic import Lease
from dasktrain.trainer.channel import ChannelClient, OutgoingPush, PendingPush
from dasktrain.trainer.errors import HolderLost, TrainerError
from dasktrain.trainer.flat import FlatLayout

__all__ = ["HolderHandle"]

logger = logging.getLogger(__name__)

_SLICE = 2.0  # seconds between liveness checks while waiting


class HolderHandle:
    """A view of the holder actor from a trainer worker (or the driver, with ``client``).

    When the holder lives in the calling worker's own process, calls go straight to the
    actor object on the worker's event loop: the payload is handed over by reference instead
    of being serialised and sent through a loopback socket. From another process, pushes
    go over the holder's direct channel when :meth:`join` gets one.
    """

    def __init__(self, actor: Any, timeout: float, client: Client | None = None) -> None:
        self.actor = actor
        self.timeout = timeout
        self._client = client  # for liveness checks; default: the current client
        # The actor's address is not public API; it names the worker holding the actor.
        self.address: str = actor._address
        self._local = None
        # What the last liveness check heard from the scheduler (address -> worker info):
        # the driver's other checks of the cluster read it instead of asking again.
        self.last_workers: dict[str, dict] | None = None
        self._channel: ChannelClient | None = None
        self._into: np.ndarray | None = None  # where in-process replies are copied
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            worker = get_worker()
        except ValueError:
            worker = None
        if worker is not None:
            self._loop = worker.loop.asyncio_loop
            if worker.address == self.address:
                self._local = worker.state.actors.get(actor.key)

    @property
    def local(self) -> bool:
        return self._local is not None

    @property
    def via(self) -> str:
        """How pushes reach the holder: ``"local"``, ``"direct"`` (channel) or ``"actor"``."""
        return "local" if self.local else "direct" if self._channel is not None else "actor"

    def join(self, worker: int, address: str | None, layout: FlatLayout,
             into: np.ndarray | None = None) -> dict[str, Any]:
        """Join the holder as ``worker``; opens the direct channel for pushes if offered,
        whose replies are received into ``into`` when given."""
        info = self.request("join", worker, address, layout, what=f"worker {worker} to join")
        self._into = into
        if self._client is None:
            # Resolved here, in the task's thread: the channel's sender thread checks the
            # holder's liveness too, and a worker's client is found from task threads only.
            with contextlib.suppress(ValueError):
                self._client = get_client()
        contact = info.get("channel")
        if contact is not None and self._local is None:
            self.close()
            try:
                size = layout.size if into is None else len(into)
                self._channel = ChannelClient(contact, worker, size, self.timeout,
                                              self.holder_alive, into)
            except (OSError, TrainerError) as exc:
                # A firewall may let Dask's ports through and not this one.
                logger.warning("worker %d cannot reach the holder's channel at %s:%s (%s); "
                               "pushing through the actor", worker, contact["host"],
                               contact["port"], exc)
        return info

    def share(self, adopt: Callable[[np.ndarray, np.ndarray], bool]) -> bool:
        """Where the direct channel shares memory with the holder (a worker on its host,
        see :mod:`.shared`): ``adopt(payload, reply)`` moves the caller's outgoing payload
        and receive buffer into the shared regions (returning False if it cannot), and
        replies are received there from now on. True if they were."""
        regions = None if self._channel is None else self._channel.shared
        if regions is None or not adopt(regions.payload, regions.reply):
            return False
        self._channel.receive_into(regions.reply)
        return True

    @property
    def transport(self) -> str | None:
        """How the direct channel moves payloads: ``"shared"`` (memory shared with the
        holder), ``"local"`` (a local socket), ``"tcp"``; None without a channel."""
        if self._channel is None:
            return None
        return "shared" if self._channel.shared is not None else self._channel.transport

    def push(self, worker: int, version: int, payload: Any, count: int, loss: float,
             position: tuple[int, int]) -> Any:
        """Start a push (see :meth:`ParameterHolder.push`); :meth:`wait` for its reply, the
        parameters (valid until the next push) and their version."""
        if self._channel is not None:
            return self._channel.push(version, payload, count, loss, position)
        if self._local is not None:
            # The reply is leased, copied into ``into`` by :meth:`wait` and given back.
            return self.call("exchange", worker, version, payload, count, loss, position)
        return self.call("push", worker, version, payload, count, loss, position)

    def begin_push(self, version: int, count: int, loss: float, position: tuple[int, int],
                   payload: np.ndarray) -> OutgoingPush | None:
        """Start a push sent bucket by bucket while ``payload`` is still being written (see
        :meth:`ChannelClient.begin`); None where pushes do not go over the direct channel."""
        if self._channel is None:
            return None
        return self._channel.begin(version, count, loss, position, payload)

    @property
    def order(self) -> tuple[tuple[int, int], ...] | None:
        """The order in which the direct channel sends a payload's buckets (None: no
        channel, or one whose payloads lie in shared memory and are not sent)."""
        if self._channel is None or self._channel.shared is not None:
            return None
        return self._channel.order

    def close(self) -> None:
        """Close the direct channel, if any."""
        if self._channel is not None:
            self._channel.stop()
            self._channel = None

    def call(self, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on the holder; returns something with ``.result(timeout)``."""
        if self._local is not None:
            coroutine = getattr(self._local, method)(*args)
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        if self._loop is not None:
            # Issue and await the actor call on the worker's event loop: one thread hop
            # there and one back, instead of two each way through ActorFuture.result().
            return asyncio.run_coroutine_threadsafe(self._remote(method, args), self._loop)
        return getattr(self.actor, method)(*args)

    async def _remote(self, method: str, args: tuple) -> Any:
        return await getattr(self.actor, method)(*args)

    def wait(self, future: Any, what: str, timeout: float | None = None) -> Any:
        """The result of ``future``, failing clearly if the holder's worker dies or nothing
        comes within ``timeout`` seconds."""
        if isinstance(future, PendingPush):  # checks liveness itself
            return future.result(timeout or self.timeout, what)
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                result = future.result(timeout=min(_SLICE, max(deadline - time.monotonic(),
                                                               0.01)))
                return self._own(result) if isinstance(result, Lease) else result
            except TimeoutError:
                if not self.holder_alive():
                    raise HolderLost(f"the parameter holder's worker {self.address} died "
                                     f"while waiting for {what}") from None
                if time.monotonic() >= deadline:
                    raise TrainerError(f"no answer from the parameter holder for {what} "
                                       f"after {timeout or self.timeout:.0f}s") from None
            except OSError as exc:
                raise HolderLost(f"cannot reach the parameter holder's worker "
                                 f"{self.address}: {exc}") from exc

    def _own(self, lease: Lease) -> tuple[np.ndarray, int]:
        """Copy a leased reply (in-process pushes) into the receive buffer, and give the
        lease back at once: the holder may then update in place."""
        try:
            into = self._into
            if into is None or into.shape != lease.array.shape:
                into = self._into = np.empty_like(lease.array)
            np.copyto(into, lease.array)
            return into, lease.version
        finally:
            lease.release()

    def request(self, method: str, *args: Any, what: str | None = None) -> Any:
        """Call and wait."""
        return self.wait(self.call(method, *args), what or method)

    def holder_alive(self) -> bool:
        try:
            workers = worker_info(self._client or get_client())
        except Exception:  # cannot tell right now: keep waiting until the deadline
            return True
        self.last_workers = workers
        return self.address in workers
