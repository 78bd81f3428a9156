"""Errors raised for bad datasets and bad preparation requests.

:class:`DatasetError` and :class:`SourceError` are ``ValueError`` subclasses and
:class:`OutputExistsError` a ``FileExistsError``, so callers that catch ``ValueError`` or
``OSError`` for user mistakes (the CLI does) need not know about them.
"""

from __future__ import annotations

from dasktrain.errors import DasktrainError

__all__ = ["DatasetError", "OutputExistsError", "PreparationFailed", "SourceError"]


class DatasetError(DasktrainError, ValueError):
    """A path is not a readable dasktrain dataset, or a dataset fails verification."""


class SourceError(DasktrainError, ValueError):
    """A preparation source is missing, empty, malformed or not numeric."""


class OutputExistsError(DasktrainError, FileExistsError):
    """A preparation's output is there already (or appeared while it ran) and may not be
    replaced: no ``overwrite``, or not a dasktrain dataset. The message names the output."""


class PreparationFailed(DasktrainError, RuntimeError):
    """The cluster could not run a preparation (its workers died again and again, or
    stayed paused for their memory); the message says the likely cause and what to
    change."""
