"""Dask's statistical profiler, paused on a worker while it trains.

Every ``distributed.worker.profile.interval`` (10 ms by default) a Dask worker walks the
stack of each thread running a task and merges it into its profile, holding the GIL. A
trainer task's stack is deep (its loop, the model's modules, the hooks backward calls) and
its step needs the GIL between torch's operations, so the walk slows it: in W4's large
model, forward and backward took 30.2 ms per step in one worker and 27.5 ms in the other
with the profiler on, 27.7 and 27.1 ms with it off. So a trainer task pauses the profiler
of its worker while it runs (``Trainer(pause_dask_profiler=True)``, the default) and
starts it again once the last trainer task of that worker has ended; the dashboard's
profile then shows the rest of the cluster's work, not the training loop's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["profiler_paused"]

_lock = threading.Lock()
_pausing: dict[int, int] = {}  # id of a worker -> its trainer tasks pausing its profiler


@contextlib.contextmanager
def profiler_paused(worker: Any | None) -> Iterator[None]:
    """Pause the statistical profiler of ``worker`` (a ``distributed.Worker``; None, or
    one without a running profiler: nothing to do) for the duration."""
    callback = None if worker is None else worker.periodic_callbacks.get("profile")
    if callback is None:
        yield
        return
    key = id(worker)
    with _lock:
        first = key not in _pausing
        # A profiler someone else stopped is left as it is.
        mine = not first or callback.is_running()
        if mine:
            _pausing[key] = _pausing.get(key, 0) + 1
    if not mine:
        yield
        return
    if first:  # the callback belongs to the worker's event loop
        worker.loop.add_callback(callback.stop)
    try:
        yield
    finally:
        with _lock:
            _pausing[key] -= 1
            last = _pausing[key] == 0
            if last:
                del _pausing[key]
        if last:
            with contextlib.suppress(RuntimeError):  # the worker's loop is closing
                worker.loop.add_callback(callback.start)
