"""Errors of the trainer."""

from __future__ import annotations

from typing import Any

from dasktrain.errors import DasktrainError

__all__ = ["HolderLost", "InvalidLoss", "TrainerError", "TrainingDiverged", "WorkersPaused"]


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


class WorkersPaused(TrainerError):
    """The Dask workers the run needs are paused (memory) or closing, so nothing can run."""
