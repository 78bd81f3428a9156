"""Noticing, within seconds, a cluster on which the trainer's tasks cannot run.

The watch itself is :class:`dasktrain._watch.PauseWatch`, shared with preparations; the
trainer's raises :class:`WorkersPaused` and says what a trainer worker needs.
"""

from __future__ import annotations

from distributed import Client

from dasktrain._watch import PauseWatch
from dasktrain.trainer.errors import WorkersPaused

__all__ = ["TRAINER_MEMORY_HINT", "trainer_watch"]

TRAINER_MEMORY_HINT = ("a trainer worker's process needs about 400 MiB for Python, Dask and "
                       "PyTorch, plus its model replica and prefetch x block size; the "
                       "holder's worker also keeps the parameters and optimizer state")


def trainer_watch(client: Client) -> PauseWatch:
    """The watch a fit's driver checks while it waits."""
    return PauseWatch(client, WorkersPaused, TRAINER_MEMORY_HINT)
