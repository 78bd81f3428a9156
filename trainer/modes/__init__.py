"""Update modes, looked up by name: adding a mode is adding a module and an entry here."""

from __future__ import annotations

from typing import Any

from dasktrain.trainer.modes.asynchronous import AsyncMode
from dasktrain.trainer.modes.base import Contribution, UpdateMode
from dasktrain.trainer.modes.synchronous import SyncMode

__all__ = ["MODES", "Contribution", "UpdateMode", "get_mode", "mode_class"]

MODES: dict[str, type[UpdateMode]] = {"sync": SyncMode, "async": AsyncMode}


def mode_class(name: str) -> type[UpdateMode]:
    """The class of mode ``name``; a clear error for unknown names."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {sorted(MODES)}") from None


def get_mode(name: str, holder: Any, **options: Any) -> UpdateMode:
    """Mode ``name`` bound to ``holder``, with its options validated."""
    return mode_class(name)(holder, **options)
