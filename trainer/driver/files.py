"""Writing a run's output files so that a reader never finds half of one."""

from __future__ import annotations

import os
from pathlib import Path

from dasktrain._durable import write_bytes_atomic

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling and a rename.

    An interrupted write leaves the previous file (or none), never a truncated one; the
    directory is flushed after the rename so a completed write survives a power cut.
    """
    target = Path(path)
    write_bytes_atomic(target, data.encode() if isinstance(data, str) else data)
    return target
