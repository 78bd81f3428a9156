"""Calling the holder from a trainer worker: in-process when they share a process, pushes
over a direct channel (else the actor's RPC) otherwise, and never waiting without a deadline
and a liveness check. After its join, every call of the worker carries the incarnation the
holder handed out (see :mod:`dasktrain.trainer.holder.roster`).

A worker whose channel cannot be reached pushes through the actor, and returns to the
channel as soon as an attempt in the background gets through (see :mod:`.reconnect`); the
holder records both moments as events of the History."""

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
from dasktrain._deadline import wait_until
from dasktrain.trainer import faults
from dasktrain.trainer.errors import HolderLost, TrainerError
from dasktrain.trainer.exchange.arrival import Arrival
from dasktrain.trainer.exchange.client import ChannelClient, PendingPush
from dasktrain.trainer.exchange.reconnect import ChannelRefused, ChannelReturn, ChannelUnavailable
from dasktrain.trainer.exchange.streaming import OutgoingPush
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.arithmetic import Lease

__all__ = ["HolderHandle", "WholePush"]

logger = logging.getLogger(__name__)

_SLICE = 2.0  # seconds between liveness checks while waiting


class HolderHandle:
    """A view of the holder actor from a trainer worker (or the driver, with ``client``).

    When the holder lives in the calling worker's own process, calls go straight to the
    actor object on the worker's event loop: the payload is handed over by reference instead
    of being serialised and sent through a loopback socket. From another process, pushes
    go over the holder's direct channel when :meth:`join` gets one; while it cannot be
    reached they go through the actor, and back over the channel once it can.
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
        # Where replies are received: in-process ones are copied there, and a channel made
        # again receives there (the worker's model, which may have moved into memory
        # shared with the holder over the first channel: see share).
        self._into: np.ndarray | None = None
        self._worker: int | None = None
        self.incarnation = 0  # the holder's for this worker's task, from its join
        self._address: str | None = None  # the worker's Dask address, as it joined
        self._contact: dict[str, Any] | None = None  # the channel's, as join got it
        self._size = 0
        self._return: ChannelReturn[ChannelClient] | None = None  # while on the actor
        self._stream_replies = False  # see stream_replies
        self._lend = False  # see lend_replies
        self._lent: Lease | None = None  # the in-process reply the worker computes on
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
        """Join the holder as ``worker`` (a new incarnation of it); opens the direct channel
        for pushes if offered, whose replies are received into ``into`` when given."""
        info = self.request("join", worker, address, layout,
                            what=f"worker {worker} to join")
        self._into = into
        self._worker, self._address = worker, address
        self.incarnation = int(info.get("incarnation", 0))
        if self._client is None:
            # Resolved here, in the task's thread: the channel's sender thread checks the
            # holder's liveness too, and a worker's client is found from task threads only.
            with contextlib.suppress(ValueError):
                self._client = get_client()
        contact = info.get("channel")
        if contact is not None and self._local is None:
            self.close()
            self._contact = contact
            self._size = layout.size if into is None else len(into)
            try:
                self._channel = self._open_channel()
            except HolderLost:
                raise
            except (OSError, TrainerError) as exc:
                # A firewall may let Dask's ports through and not this one; a flood of
                # connections may have kept this one out for a while.
                self._fall_back(exc)
        return info

    def member_call(self, method: str, *args: Any) -> Any:
        """Start ``method(worker, incarnation, *args)`` on the holder: a call of this
        worker's incarnation, which the holder refuses once it is not current."""
        assert self._worker is not None, "join first"
        return self.call(method, self._worker, self.incarnation, *args)

    def member_request(self, method: str, *args: Any, what: str | None = None) -> Any:
        """:meth:`member_call` and wait."""
        return self.wait(self.member_call(method, *args), what or method)

    def next_epoch(self, after: int, report: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any] | None:
        """Leave epoch ``after`` with ``report`` and get what :meth:`join` answers for the
        next epoch once the holder began it, keeping this worker's channel; None once the
        fit is over for it.

        The holder answers every ``_NEXT_WAIT`` seconds with what the epoch waits for: the
        driver's work at the boundary (validation, callbacks: as long as it takes, the
        holder living on being the sign that the driver does), or the other workers and
        the cluster, which may not take longer than ``timeout`` seconds (default: the
        handle's) in all."""
        worker = self._worker
        seconds = self.timeout if timeout is None else timeout
        since = time.monotonic()
        while True:
            future = self.member_call("next_epoch", after, self._address, _NEXT_WAIT, report)
            if report is not None:
                faults.reached("boundary", worker=worker, epoch=after)
            info = self.wait(future, f"epoch {after + 1} for worker {worker}")
            if not info.get("wait"):
                return None if "end" in info else info
            report = None  # it left with the first question
            if info["wait"] == "driver":
                since = time.monotonic()
            elif time.monotonic() - since > seconds:
                raise TrainerError(
                    f"worker {worker} waited {seconds:.0f}s for epoch {after + 1} to begin: "
                    f"the holder still waits for the {info['wait']} (timeout={seconds:g})")

    def _open_channel(self, **options: Any) -> ChannelClient:
        assert self._contact is not None and self._worker is not None
        channel = ChannelClient(self._contact, self._worker, self._size, self.timeout,
                                self.holder_alive, self._into, **options)
        channel.stream_replies = self._stream_replies
        return channel

    def stream_replies(self) -> None:
        """Have the direct channel receive replies on its own thread from now on (see
        :mod:`.arrival`): :meth:`wait` returns as a reply begins to arrive, and
        :attr:`arrival` tells what has landed."""
        self._stream_replies = True
        if self._channel is not None:
            self._channel.stream_replies = True

    @property
    def arrival(self) -> Arrival | None:
        """The reply still arriving over the direct channel, if any."""
        channel = self._channel
        return None if channel is None else channel.arrival

    def _fall_back(self, exc: BaseException) -> None:
        """Push through the actor from now on, and try to return to the channel in the
        background (unless the holder refused this worker's token)."""
        assert self._contact is not None and self._worker is not None
        if self._channel is not None:
            self._channel.stop()
            self._channel = None
        logger.warning("worker %d cannot reach the holder's channel at %s:%s (%s); pushing "
                       "through the actor meanwhile", self._worker, self._contact["host"],
                       self._contact["port"], exc)
        if not isinstance(exc, ChannelRefused):
            # One attempt each, on a thread of its own: see ChannelReturn.
            self._return = ChannelReturn(lambda: self._open_channel(connect_within=0.0),
                                         ChannelClient.stop)
        self.member_request("exchange_changed", "actor", str(exc),
                            what=f"worker {self._worker}'s move to the actor")

    def _current_channel(self) -> ChannelClient | None:
        """The direct channel, if this worker is on it: one a return attempt made is taken
        here, between pushes."""
        if self._channel is None and self._return is not None:
            back = self._return.poll()
            if back is not None:
                self._return = None
                self._channel = back
                logger.info("worker %d is back on the holder's channel", self._worker)
                self.member_request("exchange_changed", "direct",
                                    what=f"worker {self._worker}'s return to the channel")
        return self._channel

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

    def push(self, version: int, payload: Any, count: int, loss: float,
             position: tuple[int, int]) -> Any:
        """Start a push of this worker's incarnation (see :meth:`ParameterHolder.push`);
        :meth:`wait` for its reply, the parameters (valid until the next push) and their
        version."""
        channel = self._current_channel()
        if channel is not None:
            try:
                return channel.push(version, payload, count, loss, position)
            except ChannelUnavailable as exc:  # nothing was sent: the actor takes it
                self._fall_back(exc)
        if self._local is not None:
            # The reply is leased: copied into ``into`` by :meth:`wait` and given back, or
            # lent (see lend_replies) until now, when the worker is done reading it.
            self._give_back()
            return self.member_call("exchange", version, payload, count, loss, position)
        return self.member_call("push", version, payload, count, loss, position)

    def begin_push(self, version: int, count: int, loss: float, position: tuple[int, int],
                   payload: np.ndarray) -> OutgoingPush | WholePush:
        """Start a push sent bucket by bucket while ``payload`` is still being written (see
        :meth:`ChannelClient.begin`). Where it cannot be (this worker is on the actor for
        now, or its channel shares memory with the holder) the push is sent whole, by
        :meth:`push`, when it is finished."""
        channel = self._current_channel()
        if channel is not None and channel.shared is None:
            try:
                return channel.begin(version, count, loss, position, payload)
            except ChannelUnavailable as exc:  # nothing was sent
                self._fall_back(exc)
        assert self._worker is not None, "join first"
        return WholePush(self, version, count, loss, position, payload)

    @property
    def order(self) -> tuple[tuple[int, int], ...] | None:
        """The order in which the direct channel sends a payload's buckets (None: no
        channel, or one whose payloads lie in shared memory and are not sent)."""
        if self._channel is None or self._channel.shared is not None:
            return None
        return self._channel.order

    def lend_replies(self) -> bool:
        """In the holder's own process, have :meth:`wait` hand over in-process replies
        without copying them: the holder's parameters themselves, leased until the next
        push (or :meth:`close`), which the worker's model then views (see
        :meth:`FlatModel.view`). In lock-step modes every lease is given back before the
        update, which then writes in place; elsewhere an update meanwhile copies first, as
        for any lease. False (nothing changed) where the holder is in another process."""
        self._lend = self._local is not None
        return self._lend

    def _give_back(self) -> None:
        if self._lent is not None:
            lent, self._lent = self._lent, None
            lent.release()

    def close(self) -> None:
        """Close the direct channel, if any, and stop trying to return to it; give back
        a lent reply."""
        self._give_back()
        if self._channel is not None:
            self._channel.stop()
            self._channel = None
        if self._return is not None:
            self._return.stop()
            self._return = None

    def call(self, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on the holder; returns something with ``.result(timeout)``."""
        if self._local is not None:
            return self._on_loop(getattr(self._local, method)(*args), method)
        if self._loop is not None:
            # Issue and await the actor call on the worker's event loop: one thread hop
            # there and one back, instead of two each way through ActorFuture.result().
            return self._on_loop(self._remote(method, args), method)
        return self._actor_call(method, args)

    def _actor_call(self, method: str, args: tuple) -> Any:
        try:
            return getattr(self.actor, method)(*args)
        except RuntimeError as exc:  # Dask's actor, once its worker is known lost
            raise HolderLost(f"the parameter holder's worker {self.address} died: "
                             f"{exc}") from exc

    def _on_loop(self, coroutine: Any, method: str) -> Any:
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError as exc:  # the loop closed: this Dask worker is going away
            coroutine.close()  # never scheduled: no "was never awaited" warning at exit
            raise TrainerError(f"cannot call the holder's {method}: this Dask worker is "
                               "closing") from exc

    async def _remote(self, method: str, args: tuple) -> Any:
        return await self._actor_call(method, args)

    def wait(self, future: Any, what: str, timeout: float | None = None) -> Any:
        """The result of ``future``, failing clearly if the holder's worker dies or nothing
        comes within ``timeout`` seconds."""
        if isinstance(future, PendingPush):  # checks liveness itself
            return future.result(timeout or self.timeout, what)
        seconds = timeout or self.timeout

        def check() -> None:
            if not self.holder_alive():
                raise HolderLost(f"the parameter holder's worker {self.address} died "
                                 f"while waiting for {what}")

        try:
            result = wait_until(
                lambda left: future.result(timeout=left), timeout=seconds, check=check,
                slice_seconds=_SLICE,
                expired=lambda: TrainerError(f"no answer from the parameter holder for "
                                             f"{what} after {seconds:.0f}s"))
        except OSError as exc:
            raise HolderLost(f"cannot reach the parameter holder's worker "
                             f"{self.address}: {exc}") from exc
        return self._own(result) if isinstance(result, Lease) else result

    def _own(self, lease: Lease) -> tuple[np.ndarray, int]:
        """Copy a leased reply (in-process pushes) into the receive buffer, and give the
        lease back at once: the holder may then update in place. Lent instead (see
        :meth:`lend_replies`): kept until the next push."""
        if self._lend:
            self._give_back()
            self._lent = lease
            return lease.array, lease.version
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


#: Seconds one question for the next epoch waits at the holder before it is asked again
#: (the driver's work at the boundary may take long: validation, callbacks).
_NEXT_WAIT = 10.0


class WholePush:
    """A push begun as one sent bucket by bucket (see :meth:`HolderHandle.begin_push`) that
    goes whole once the payload is finished: the same calls, nothing sent early."""

    def __init__(self, handle: HolderHandle, version: int, count: int,
                 loss: float, position: tuple[int, int], payload: np.ndarray) -> None:
        self._handle = handle
        self._push = (version, payload, count, loss, position)

    def ready(self, bucket: int) -> None:
        """Nothing is sent before :meth:`finish`."""
        del bucket

    def finish(self) -> Any:
        """Send the push; :meth:`HolderHandle.wait` for its reply."""
        return self._handle.push(*self._push)
