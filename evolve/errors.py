"""Errors of gradient-free training."""

from __future__ import annotations

from typing import Any

from dasktrain.errors import DasktrainError

__all__ = ["EvolutionError", "InvalidFitness"]


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
