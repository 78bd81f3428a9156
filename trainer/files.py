"""Writing a run's output files so that a reader never finds half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dasktrain._durable import fsync_directory

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling and a rename.

    An interrupted write leaves the previous file (or none), never a truncated one; the
    directory is flushed after the rename so a completed write survives a power cut.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other readers
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return target
