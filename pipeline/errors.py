"""Errors the pipeline raises in the consumer."""

from __future__ import annotations

from dasktrain.errors import DasktrainError

__all__ = ["PipelineError"]


class PipelineError(DasktrainError, RuntimeError):
    """Data for a batch could not be produced: a transform raised, a chunk is unreadable, the
    cluster lost its workers, or no data arrived within the timeout. The message names the
    block and epoch; the original exception, where there is one, is chained as the cause."""
