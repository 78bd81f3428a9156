"""A stop asked for by a signal, which Python may have swallowed.

The command line turns Ctrl-C (and SIGTERM) into an exception in its signal handler. But an
exception raised while Python runs a garbage-collector callback (distributed registers one),
a ``__del__`` or a weakref callback is printed as "Exception ignored" and lost, and the run
goes on as if nothing had happened. So the handler also records the stop here, and the step
that makes a result visible (publishing a dataset) checks it: an interrupted build never
lands where a good one is expected.
"""

from __future__ import annotations

__all__ = ["check", "clear", "request"]

_requested: type[BaseException] | None = None


def request(exception: type[BaseException]) -> None:
    """Record that a stop, to be raised as ``exception``, was asked for."""
    global _requested
    _requested = exception


def clear() -> None:
    """Forget a recorded stop (a new command starts)."""
    global _requested
    _requested = None


def check() -> None:
    """Raise the recorded stop, if one was asked for and went unnoticed."""
    if _requested is not None:
        raise _requested
