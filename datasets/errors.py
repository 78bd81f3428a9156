"""Errors raised for bad datasets and bad preparation requests.

Both are ``ValueError`` subclasses so callers that catch ``ValueError`` for user mistakes
(the CLI does) need not know about them.
"""

from __future__ import annotations

from dasktrain.errors import DasktrainError

__all__ = ["DatasetError", "SourceError"]


class DatasetError(DasktrainError, ValueError):
    """A path is not a readable dasktrain dataset, or a dataset fails verification."""


class SourceError(DasktrainError, ValueError):
    """A preparation source is missing, empty, malformed or not numeric."""
