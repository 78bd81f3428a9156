"""Named points of a trainer worker's life where fault-injection tests and the chaos benchmark
act: kill the worker's process with a call on its way, at a place they choose rather than
at a moment they hope for.

A hook is installed in a worker process (``client.run(install, point, hook)``) and called
at its point with where the worker is: ``hook(worker=..., epoch=..., **details)``; a hook
that kills the process (``os.kill(os.getpid(), signal.SIGKILL)``) leaves the call it
follows on its way, as a crash would. Without hooks (every real run) a point costs one
dictionary lookup.

Points:

``claim``
    a claim of work has been sent to the holder and its answer not yet read
    (``attempt``: the how-manieth claim of the epoch);
``push``
    a push has been sent and its reply not yet read (``batch``: the batch's mark, its
    global index where work is claimed, else the step; ``last``: it is the worker's last
    of the epoch, as far as it knows: the last step of its stride, or the batch that ends
    the epoch's last run of work);
``boundary``
    the worker has left the epoch and asked for the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["POINTS", "clear", "install", "reached"]

POINTS = ("claim", "push", "boundary")

_HOOKS: dict[str, Callable[..., Any]] = {}


def install(point: str, hook: Callable[..., Any]) -> None:
    """Call ``hook`` at ``point`` in this process (replacing any hook there)."""
    if point not in POINTS:
        raise ValueError(f"point must be one of {POINTS}, got {point!r}")
    _HOOKS[point] = hook


def clear() -> None:
    """Remove every hook of this process."""
    _HOOKS.clear()


def reached(point: str, **where: Any) -> None:
    """The worker is at ``point`` (see the module docstring)."""
    hook = _HOOKS.get(point)
    if hook is not None:
        hook(**where)
