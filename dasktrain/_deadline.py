"""Waiting with a deadline and a liveness check: the one way every part of dasktrain waits.

A wait that could last forever is a deadlock waiting to happen: a worker dies, a cluster
pauses, a client closes. :func:`wait_until` asks for a result in short slices and, between
two slices, calls a check that raises as soon as waiting has become pointless; once the
deadline passes it raises the caller's own timeout error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(get: Callable[[float], T], *, timeout: float,
               expired: Callable[[], BaseException],
               check: Callable[[], None] | None = None, slice_seconds: float = 1.0) -> T:
    """The result of ``get``, within ``timeout`` seconds.

    Parameters
    ----------
    get
        ``get(seconds)`` returns the result, or raises ``TimeoutError`` when none came
        within ``seconds`` (as ``Future.result(timeout=)`` does). Other errors propagate.
    timeout
        Seconds in all.
    expired
        Makes the error raised once the deadline passed (it names what was awaited).
    check
        Called after each slice that brought nothing: raises if waiting is pointless (the
        worker that would answer died, the cluster paused, the client closed).
    slice_seconds
        The longest single ``get``: how soon a failed ``check`` is noticed.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return get(min(slice_seconds, max(deadline - time.monotonic(), 0.01)))
        except TimeoutError:
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                raise expired() from None
