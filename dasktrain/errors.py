"""The base of every error dasktrain raises on purpose.

Part of the ground beneath the components: each component's errors derive from
:class:`DasktrainError` and keep their older base (``ValueError`` for bad input,
``RuntimeError`` for a run that cannot go on), so ``except ValueError`` written before the
base existed still catches them.
"""

from __future__ import annotations

__all__ = ["ClusterStuck", "DasktrainError"]


class DasktrainError(Exception):
    """Raised by dasktrain: ``except dt.DasktrainError`` catches every error it raises on
    purpose (a bad dataset or source, a pipeline that cannot produce a batch, a run that
    cannot go on, a bad run config), and none of the errors of user code it runs."""


class ClusterStuck(DasktrainError, RuntimeError):
    """The Dask workers a job's tasks wait on are paused (their memory) or closing, and
    have been for seconds with nothing done: the job would wait for ever. The message gives
    each stuck worker's memory and what to change."""
