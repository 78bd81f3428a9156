"""Errors of gradient-free training."""

from __future__ import annotations

from typing import Any

from dasktrain.errors import DasktrainError

__all__ = ["EvolutionError", "FitnessFailed", "InvalidFitness"]


class EvolutionError(DasktrainError, RuntimeError):
    """An evolution run could not go on; the message says why, and names the last
    checkpoint to resume from where there is one.

    When raised by :meth:`Evolver.fit`, ``history`` holds the
    :class:`~dasktrain.evolve.EvolutionHistory` recorded up to the failure.
    """

    history: Any = None


class InvalidFitness(EvolutionError, ValueError):
    """The reward (or loss) returned what cannot be ranked: not one finite number. The
    message names the member, the generation and what was returned."""


class FitnessFailed(EvolutionError):
    """The reward (or loss) raised an error: the message names the member, the generation
    and the error, ``error`` (also ``__cause__``) is the error itself, and a note holds its
    traceback on the worker.

    Raised on the worker, where the member is known, and pickled to the driver with its
    error (an exception's ``__cause__`` and traceback do not travel with it).
    """

    def __init__(self, message: str, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.error = error
        self.__cause__ = error

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.error), self.__dict__
