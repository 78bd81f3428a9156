"""Checkpoints: one file that holds the whole run, written atomically, read safely.

The file is a ``torch.save`` of plain containers, numbers, strings and tensors only, and it
is read with ``torch.load(weights_only=True)``: loading a checkpoint never runs code from it.
A local file is written to a temporary sibling, flushed to disk and renamed over the old one,
and the directory is flushed after the rename, so a crash or power cut mid-write leaves the
previous checkpoint intact and a completed save survives. On object storage (``s3://``,
``gs://``...) the file is serialised in memory and uploaded in one PUT, which replaces the
object atomically: never a partial checkpoint under its key.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from dasktrain._durable import (
    StorageOptions,
    is_url,
    join,
    local_path,
    read_bytes,
    strip_url,
    write_bytes_atomic,
)

__all__ = ["CHECKPOINT_FORMAT", "checkpoint_file", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FORMAT = 1
_NAME = "checkpoint.pt"


def checkpoint_file(path: str | os.PathLike) -> Path | str:
    """The checkpoint file of ``path``: a directory holds ``checkpoint.pt``.

    A local path gives a :class:`~pathlib.Path`, a URL (``s3://bucket/run``) a string.
    """
    if is_url(path):
        text = strip_url(os.fspath(path))
        return text if text.endswith(".pt") else join(text, _NAME)
    path = Path(local_path(path))
    return path / _NAME if path.suffix != ".pt" else path


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any], *,
                    storage_options: StorageOptions | None = None) -> Path | str:
    """Write ``state`` atomically; returns the file written.

    ``storage_options`` go to fsspec for URLs; without them, its configuration and the
    environment (e.g. AWS credentials) apply.
    """
    target = checkpoint_file(path)
    payload = {"format": CHECKPOINT_FORMAT, **state}
    # Serialised first, then written whole: one atomic write, local or at a URL (an
    # object store takes a whole object in one PUT).
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_bytes_atomic(target, buffer.getvalue(), storage_options)
    return target


def load_checkpoint(path: str | os.PathLike, *,
                    storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (no code is unpickled)."""
    target = checkpoint_file(path)
    if isinstance(target, str):
        try:
            source: Any = io.BytesIO(read_bytes(target, storage_options))
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"no checkpoint at {target}") from None
    elif not target.is_file():
        raise FileNotFoundError(f"no checkpoint at {target}")
    else:
        source = target
    try:
        state = torch.load(source, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ValueError(f"{target} is not a readable dasktrain checkpoint: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{target} is not a dasktrain checkpoint of format "
                         f"{CHECKPOINT_FORMAT}")
    return state
