"""Errors of the trainer."""

from __future__ import annotations

__all__ = ["HolderLost", "TrainerError"]


class TrainerError(RuntimeError):
    """Training could not go on; the message says why and what to do."""


class HolderLost(TrainerError):
    """The parameter holder's worker died; resume from the last checkpoint."""
