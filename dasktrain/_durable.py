"""Making renames durable: flush a directory's entries to disk after publishing into it."""

from __future__ import annotations

import os

__all__ = ["fsync_directory"]


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush a directory's entries (renames, new files) to disk, where the system allows.

    A file renamed into place is durable only once its directory is: after a power cut the
    directory may otherwise still list the older file, or none.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows, where directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)
