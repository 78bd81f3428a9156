"""An evolution run's checkpoint: its settings, generation, state and history in one file.

Written with the trainer's checkpoint writer (:mod:`dasktrain.trainer.driver.checkpoint`):
atomically, and read back without running any code from the file. A resume continues the
same run: the state is the driver's, bit for bit, and every random choice of a generation is
a function of the run's seed and the generation, so 2 + 2 generations with a checkpoint
between are the 4 generations of one fit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dasktrain._durable import StorageOptions
from dasktrain.evolve.view.history import EvolutionHistory
from dasktrain.trainer.driver.checkpoint import load_checkpoint, save_checkpoint

__all__ = ["EVOLUTION_CHECKPOINT", "check_resumable", "load_evolution", "save_evolution"]

EVOLUTION_CHECKPOINT = "dasktrain.evolve/1"


def save_evolution(path: str | os.PathLike, *, settings: dict[str, Any], generation: int,
                   state: dict[str, Any], history: EvolutionHistory,
                   storage_options: StorageOptions | None = None) -> Path | str:
    """Write the run after ``generation`` generations; returns the file written."""
    return save_checkpoint(path, {"kind": EVOLUTION_CHECKPOINT, "settings": settings,
                                  "generation": generation, "state": state,
                                  "history": history.to_dict()},
                           storage_options=storage_options)


def load_evolution(path: str | os.PathLike,
                   storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_evolution`."""
    saved = load_checkpoint(path, storage_options=storage_options)
    if saved.get("kind") != EVOLUTION_CHECKPOINT:
        raise ValueError(f"{path} is not an evolution checkpoint (a Trainer's? those resume "
                         "with Trainer.fit)")
    return saved


def check_resumable(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Refuse to resume a run under other settings, naming the first that differs."""
    for key in sorted(set(saved) | set(mine)):
        if saved.get(key) != mine.get(key):
            raise ValueError(f"cannot resume: the checkpoint has {key}={saved.get(key)!r}, "
                             f"this evolver {key}={mine.get(key)!r}")
