"""A trainer worker's pipeline, kept in its process from one epoch's task to the next.

Each epoch of a fit is one task per trainer worker. A pipeline made afresh in every task
opens the dataset again and waits for its first batch, and one made with a head start
into the next epoch would throw that head start away when its task ends. The pipeline of
a rank with a fixed share of the epoch (``assignment="static"``, and every lock-step run)
is therefore kept here between the fit's tasks that run in the same process: the next
epoch's task takes it back with its head start in flight, and its first batch is
usually there already.

A kept pipeline belongs to one fit (its holder) and rank. It is taken out while a task
uses it, so two tasks never share one, and put back only after a whole epoch. The last
epoch's is not kept (nothing would take it up); any other fit's task in the process
closes what an earlier fit left (one stopped early by a callback, or failed).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from dasktrain.pipeline import Pipeline

__all__ = ["fit_key", "keep", "take"]

_KEPT: dict[tuple[Hashable, int, int], Pipeline] = {}
_LOCK = threading.Lock()


def fit_key(holder: Any) -> Hashable:
    """What names a fit in its tasks: its holder actor's key, or its shards' keys."""
    return tuple(h.key for h in holder) if isinstance(holder, (list, tuple)) else holder.key


def take(fit: Hashable, worker: int, world: int) -> Pipeline | None:
    """The pipeline ``worker`` of ``world`` kept in this process for ``fit``, if any;
    pipelines kept for other fits are closed."""
    with _LOCK:
        stale = [_KEPT.pop(k) for k in [k for k in _KEPT if k[0] != fit]]
        found = _KEPT.pop((fit, worker, world), None)
    for pipe in stale:
        pipe.close()
    return found


def keep(fit: Hashable, worker: int, world: int, pipe: Pipeline) -> None:
    """Keep ``pipe`` (at an epoch's end, its head start into the next in flight) for the
    next epoch's task of ``worker`` in this process."""
    with _LOCK:
        replaced = _KEPT.pop((fit, worker, world), None)
        _KEPT[(fit, worker, world)] = pipe
    if replaced is not None and replaced is not pipe:
        replaced.close()
