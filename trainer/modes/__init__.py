"""Update modes, looked up by name: adding a mode is adding a module and an entry here
(see :mod:`.base` for the hooks a mode implements and the host interface it uses)."""

from __future__ import annotations

from typing import Any

from dasktrain.trainer.modes.asynchronous import AsyncMode
from dasktrain.trainer.modes.average import AverageMode
from dasktrain.trainer.modes.base import Contribution, UpdateMode
from dasktrain.trainer.modes.soft import SoftMode
from dasktrain.trainer.modes.ssp import SSPMode
from dasktrain.trainer.modes.synchronous import SyncMode
from dasktrain.trainer.worker.steps import WorkerStep

__all__ = ["MODES", "Contribution", "UpdateMode", "get_mode", "mode_class",
           "worker_step_class"]

MODES: dict[str, type[UpdateMode]] = {
    "sync": SyncMode,
    "average": AverageMode,
    "soft": SoftMode,
    "ssp": SSPMode,
    "async": AsyncMode,
}


def mode_class(name: str) -> type[UpdateMode]:
    """The class of mode ``name``; a clear error for unknown names."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {sorted(MODES)}") from None


def get_mode(name: str, holder: Any, **options: Any) -> UpdateMode:
    """Mode ``name`` bound to ``holder``, with its options validated."""
    return mode_class(name)(holder, **options)


def worker_step_class(name: str) -> type[WorkerStep]:
    """What the workers of mode ``name`` do per batch (see
    :mod:`dasktrain.trainer.worker.steps`)."""
    return mode_class(name).worker_step
