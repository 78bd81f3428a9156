"""Errors of the trainer."""

from __future__ import annotations

from typing import Any

from dasktrain.errors import ClusterStuck, DasktrainError

__all__ = ["Fenced", "HolderLost", "InvalidLoss", "ShardedWorkerLost", "TrainerError",
           "TrainingDiverged", "WorkersPaused"]


class TrainerError(DasktrainError, RuntimeError):
    """Training could not go on; the message says why and what to do.

    When raised by :meth:`Trainer.fit`, ``history`` holds the :class:`History` recorded up to
    the failure (it is also kept as ``trainer.history``).
    """

    history: Any = None


class HolderLost(TrainerError):
    """The parameter holder's worker died; resume from the last checkpoint."""


class InvalidLoss(TrainerError, ValueError):
    """The loss (or ``step``) returned what cannot be trained on, such as a loss per sample
    instead of one scalar; the message says what it returned."""


class TrainingDiverged(TrainerError):
    """Updates became impossible: a non-finite loss or gradient (``on_nonfinite="raise"``),
    or every gradient refused for ``nonfinite_patience`` rounds in a row."""


class WorkersPaused(TrainerError, ClusterStuck):
    """The Dask workers the run needs are paused (memory) or closing, so nothing can run."""


#: Why a call was fenced (see :class:`Fenced`), as a person reads it.
FENCE_REASONS = {
    "superseded": "a newer task of the worker has joined since",
    "unknown": "the holder never gave that incarnation out",
    "lost": "the worker was dropped (its process died or it went silent)",
    "left": "the worker's task has left the fit",
    "absent": "the worker has no task in the fit",
    "done": "the worker has left the epoch",
    "expected": "the worker has not joined the epoch yet",
    "waiting": "the worker takes part from the next epoch on",
}


class Fenced(TrainerError):
    """A call from an incarnation of a trainer worker that is no longer current: every join
    hands out a new incarnation, and the holder acts on no call of an earlier one (see
    :mod:`dasktrain.trainer.holder.roster`). ``reason`` is a key of :data:`FENCE_REASONS`;
    a worker dropped while alive (``"lost"``) joins again, any other stops."""

    def __init__(self, worker: int, incarnation: int, reason: str, what: str = "a call"
                 ) -> None:
        super().__init__(worker, incarnation, reason, what)
        self.worker, self.incarnation, self.reason, self.what = (worker, incarnation,
                                                                 reason, what)

    def __str__(self) -> str:
        why = FENCE_REASONS.get(self.reason, self.reason)
        return (f"{self.what} from worker {self.worker} (incarnation {self.incarnation}) "
                f"refused: {why}")


class ShardedWorkerLost(TrainerError):
    """A trainer worker was lost during a fit whose holder is in shards: a step must reach
    every shard or none, which a worker that died between two shards' pushes cannot
    promise, so the fit stops; resume it from the last checkpoint (every shard's state
    there is of one version)."""
