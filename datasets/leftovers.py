"""Leftovers of earlier preparations of the same output, and which of them may go.

A preparation builds under a name of its own beside its output (``.NAME.tmp-TOKEN``, with
its scratch ``.NAME.scratch-TOKEN``, for a local directory; ``dasktrain-build-TOKEN`` and
``...-scratch`` under a URL). A run that is killed (SIGKILL, a lost machine) leaves them
behind; the next preparation of the same output to succeed removes those of every build
that is neither its own nor in use.

A local build is in use while the process running it holds an exclusive ``flock`` on its
directory: the kernel drops the lock when that process ends, however it ends, so a lock
that can be taken marks a dead build. The directory is locked under a private name and only
then renamed to its ``.tmp-`` name, so no build is ever seen unlocked while it starts.
Object storage has no such locks: there a publish removes every other build (one
preparation per URL at a time, see :mod:`dasktrain.datasets.remote`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["leftovers", "lock_directory", "locked_by_another"]


def leftovers(names: Iterable[str], build_of: Callable[[str], str | None], own: str,
              in_use: Callable[[str], bool] = lambda build: False) -> list[str]:
    """The names among ``names`` that belong to builds other than ``own`` not in use.

    ``build_of(name)`` is the build a name belongs to (a build and its scratch share one),
    or None for a name that is no build's; ``in_use(build)`` is asked once per build.
    """
    builds: dict[str, list[str]] = {}
    for name in names:
        build = build_of(name)
        if build is not None and build != own:
            builds.setdefault(build, []).append(name)
    return sorted(name for build, found in builds.items() if not in_use(build)
                  for name in found)


def lock_directory(path: Path) -> int:
    """Hold an exclusive lock on directory ``path`` until the returned descriptor is
    closed (or this process ends)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def locked_by_another(path: Path) -> bool:
    """Whether another open of directory ``path`` holds a lock on it (False if it is gone).

    A lock that cannot be tested (a file system without ``flock``) counts as held: a build
    is never removed on a guess.
    """
    try:
        fd = lock_directory(path)
    except FileNotFoundError:
        return False
    except OSError:  # BlockingIOError: held; anything else: cannot tell
        return True
    with contextlib.suppress(OSError):
        os.close(fd)
    return False
