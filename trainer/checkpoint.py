"""Checkpoints: one file that holds the whole run, written atomically, read safely.

The file is a ``torch.save`` of plain containers, numbers, strings and tensors only, and it
is read with ``torch.load(weights_only=True)``: loading a checkpoint never runs code from it.
It is written to a temporary sibling, flushed to disk and renamed over the old one, and the
directory is flushed after the rename, so a crash or power cut mid-write leaves the previous
checkpoint intact and a completed save survives.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dasktrain._durable import fsync_directory

__all__ = ["CHECKPOINT_FORMAT", "checkpoint_file", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FORMAT = 1
_NAME = "checkpoint.pt"


def checkpoint_file(path: str | os.PathLike) -> Path:
    """The checkpoint file of ``path``: a directory holds ``checkpoint.pt``."""
    path = Path(path)
    return path / _NAME if path.suffix != ".pt" else path


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically; returns the file written."""
    target = checkpoint_file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": CHECKPOINT_FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return target


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (no code is unpickled)."""
    target = checkpoint_file(path)
    if not target.is_file():
        raise FileNotFoundError(f"no checkpoint at {target}")
    try:
        state = torch.load(target, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ValueError(f"{target} is not a readable dasktrain checkpoint: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{target} is not a dasktrain checkpoint of format "
                         f"{CHECKPOINT_FORMAT}")
    return state
