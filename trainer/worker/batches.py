"""Where a trainer worker's batches of an epoch come from: its stride of the epoch plan
(a rank's own share, in lock-step modes padded to the epoch's steps), or runs of batches it
claims from the holder as its pipeline has room (:mod:`dasktrain.trainer.holder.claims`).

A claim the holder refuses (the worker's incarnation is over: it was dropped, or another
task of it took its place) reaches the epoch's loop as itself, not as the pipeline's error,
so that the worker joins again or stops; a worker that finds nothing to claim for
``timeout`` seconds while the epoch is not done fails with an error naming it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.plan import run_pieces
from dasktrain.trainer import faults
from dasktrain.trainer.errors import Fenced, TrainerError
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.worker.retire import retiring

__all__ = ["claim", "next_item", "stride"]


def stride(batches: Iterator[Any], start: int, mine: int, steps: int
            ) -> Generator[tuple[int, Any], None, None]:
    """A static rank's steps ``start..steps``: ``(position after it, batch)``, the batch
    None for the steps of a lock-step epoch in which this rank has none left."""
    for step in range(start, steps):
        yield step + 1, (next(batches) if step < mine else None)
    for _ in batches:  # let the pipeline finish its epoch bookkeeping (nothing is left)
        pass


def next_item(items: Iterator[Any]) -> Any:
    """The next item of the epoch, or None at its end; a claim the holder refused (this
    worker's incarnation is over) is raised as itself, not as the pipeline's error."""
    try:
        return next(items, None)
    except PipelineError as exc:
        if isinstance(exc.__cause__, Fenced):
            raise exc.__cause__ from None
        raise


def claim(handle: HolderHandle, worker: int, epoch: int, run_ends: set[int], timeout: float,
           stop: threading.Event) -> range | None:
    """The next run of global batches ``worker`` claims from the holder (on the pipeline's
    feeder thread), its last batch added to ``run_ends``; None once the epoch has no more
    work for it. Nothing free for ``timeout`` seconds while the epoch is not done (others
    hold the rest and neither push it nor die) is an error naming the worker."""
    since = time.monotonic()
    attempt = 0
    while not stop.is_set() and not retiring():  # a retiring worker claims no more
        future = handle.member_call("claim", epoch)
        attempt += 1
        faults.reached("claim", worker=worker, epoch=epoch, attempt=attempt)
        run = handle.wait(future, f"work for worker {worker}")
        if run is None:
            return None
        if run:
            claimed = range(run[0], run[1])
            pieces = run_pieces(claimed, run[2] if len(run) > 2 else None)
            run_ends.update(part.stop - 1 for part in pieces)
            return claimed
        # []: nothing free now, but what others hold may come back (a worker dies): ask again
        if time.monotonic() - since > timeout:
            raise TrainerError(f"worker {worker} found no work to claim in epoch {epoch} for "
                               f"{timeout:.0f}s although the epoch is not done: the workers "
                               f"holding the rest neither pushed it nor left "
                               f"(timeout={timeout:g})")
    return None
