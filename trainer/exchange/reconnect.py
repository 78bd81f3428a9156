"""A trainer worker's way (back) onto the holder's direct channel.

A connection to the channel can fail for a moment: the holder's worker is busy, or a flood
of connections pushed this one out before it presented its token (see :mod:`.admission`).
One failure used to send a worker to the actor's calls, several times slower, for the rest
of its epoch. Now a worker

* connects with retries (:func:`connect_retrying`): an attempt that the holder closes
  before accepting it, or does not answer in time, is made again after a pause that
  doubles from 50 ms to 1 s, until ``within`` seconds have passed. What retrying would not
  mend fails at once: a token the holder refuses (it stays wrong), a holder whose worker
  died, and a port that refuses connections or cannot be reached (nothing listens, or a
  firewall stands between; the attempts in the background below still look again);
* having given up, pushes through the actor and tries to return in the background
  (:class:`ChannelReturn`): one attempt after ``first_after`` seconds, then after intervals
  that double up to ``longest``. Each attempt is a single connection made on a thread of
  its own, at most one at a time, so the training thread only asks, per push, whether an
  attempt has succeeded: a channel that never comes back costs one connection attempt every
  ``longest`` seconds and nothing on the step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from dasktrain.trainer.errors import HolderLost, TrainerError

__all__ = ["ChannelRefused", "ChannelReturn", "ChannelUnavailable", "connect_retrying"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FIRST_PAUSE = 0.05  # seconds before the second attempt; doubles up to _LONGEST_PAUSE
_LONGEST_PAUSE = 1.0
# An attempt never gets less than this to be answered, even with little left of ``within``:
# a hello answered in 1.9 s is slow, not refused.
_LEAST_ATTEMPT = 2.0
RETURN_FIRST = 1.0  # seconds on the actor before the first attempt to return
RETURN_LONGEST = 30.0  # the longest interval between attempts to return


class ChannelUnavailable(TrainerError):
    """The direct channel cannot be reached now. Raised before any byte of a push was sent:
    the push can go through the actor instead."""


class ChannelRefused(ChannelUnavailable):
    """The holder refused the worker's token: connecting again would not help."""


def connect_retrying(attempt: Callable[[float], T], within: float, longest: float,
                     dead: Callable[[], HolderLost | None] = lambda: None) -> T:
    """``attempt(timeout)`` until it succeeds, for up to ``within`` seconds (at least once),
    each given at most ``longest`` seconds. After a failed attempt ``dead()`` says whether
    the holder's worker is gone (an error to raise) before another is made.

    Raises
    ------
    ChannelUnavailable
        Every attempt failed, or one failed in a way that retrying would not mend (the
        port refused the connection or cannot be reached); the last failure is its cause.
    ChannelRefused, HolderLost
        At once: retrying would not help.
    """
    deadline = time.monotonic() + within
    pause = _FIRST_PAUSE
    while True:
        left = deadline - time.monotonic()
        try:
            return attempt(min(longest, max(left, _LEAST_ATTEMPT)))
        except (HolderLost, ChannelRefused):
            raise
        except (OSError, TrainerError) as exc:
            gone = dead()
            if gone is not None:
                raise gone from exc
            transient = isinstance(exc, (ConnectionError, TimeoutError, TrainerError)) and \
                not isinstance(exc, ConnectionRefusedError)
            if not transient:
                raise ChannelUnavailable(f"cannot connect to the parameter holder's "
                                         f"channel: {exc}") from exc
            if deadline - time.monotonic() < pause:
                raise ChannelUnavailable(f"no connection to the parameter holder's channel "
                                         f"within {within:g}s: {exc}") from exc
            logger.debug("connecting to the holder's channel failed (%s); again in %.2fs",
                         exc, pause)
            time.sleep(pause)  # a back-off between attempts
            pause = min(2 * pause, _LONGEST_PAUSE)


class ChannelReturn(Generic[T]):
    """Attempts, in the background, to connect again to a channel a worker fell back from.

    ``connect()`` makes one attempt (returning the connection or raising); ``close`` ends a
    connection made after nobody wants it any more. Call :meth:`poll` before each push
    through the actor: it starts an attempt when one is due and returns the connection once
    one succeeded (then this object is spent). :meth:`stop` when the worker is done.
    """

    def __init__(self, connect: Callable[[], T], close: Callable[[T], None],
                 first_after: float = RETURN_FIRST, longest: float = RETURN_LONGEST) -> None:
        if not 0 < first_after <= longest:
            raise ValueError(f"need 0 < first_after <= longest, got {first_after!r} and "
                             f"{longest!r}")
        self._connect = connect
        self._close = close
        self._interval = first_after
        self._longest = longest
        self._due = time.monotonic() + first_after
        self._attempt: concurrent.futures.Future[T] | None = None
        self.attempts = 0
        """Attempts started so far."""
        self.refused: ChannelRefused | None = None
        """Set once the holder refused the token: no more attempts are made."""
        self._stopped = False

    def poll(self) -> T | None:
        """The connection, once an attempt made it (once only); else None, after starting
        an attempt if one is due."""
        attempt = self._attempt
        if attempt is not None:
            if not attempt.done():
                return None
            self._attempt = None
            error = attempt.exception()
            if error is None:
                return attempt.result()
            if isinstance(error, ChannelRefused):
                self.refused = error
            logger.debug("returning to the holder's channel failed (%s); again in %.0fs",
                         error, self._interval)
            self._due = time.monotonic() + self._interval
            self._interval = min(2 * self._interval, self._longest)
            return None
        if self.refused is None and not self._stopped and time.monotonic() >= self._due:
            self._start()
        return None

    def _start(self) -> None:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        self._attempt = future
        self.attempts += 1

        def run() -> None:
            try:
                future.set_result(self._connect())
            except BaseException as exc:  # handed to poll, in the worker's thread
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True, name="dasktrain-channel-return").start()

    def stop(self) -> None:
        """Make no more attempts; a connection an attempt still makes is closed."""
        attempt, self._attempt = self._attempt, None
        self._stopped = True
        if attempt is not None:
            attempt.add_done_callback(self._discard)

    def _discard(self, attempt: concurrent.futures.Future[T]) -> None:
        if attempt.exception() is None:
            self._close(attempt.result())
