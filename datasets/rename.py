"""Move a directory into place only if nothing is there: the atomic step of a local publish.

``os.rename`` of a directory onto an existing empty directory replaces it, and onto a
non-empty one fails with a platform's choice of error; between a check that the path is
free and the rename, another process may publish there. So the move itself must refuse:

* **Linux**: ``renameat2(..., RENAME_NOREPLACE)`` (glibc 2.28, Linux 3.15): the kernel moves
  the directory or fails with ``EEXIST``, in one step, whatever is at the target.
* **macOS**: ``renamex_np(..., RENAME_EXCL)``, the same promise.
* **Elsewhere**, or on a file system that refuses the flag (some network and FUSE file
  systems answer ``EINVAL``): the target is claimed with ``os.mkdir`` (atomic: it fails if
  anything is there) and the directory renamed over that empty claim. Two publishes still
  cannot both succeed; a reader may see the empty directory for the instant between the two
  steps, and a process killed in that instant leaves it behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["rename_no_replace"]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1  # Linux, <linux/fs.h>
_RENAME_EXCL = 4  # macOS, <stdio.h>
#: Errors saying the flag (or the call) is not supported here, not that the move failed.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


@functools.cache
def _native() -> Callable[[bytes, bytes], int] | None:
    """The C call that renames without replacing, as ``call(source, target) -> 0 or -1``
    (errno set), or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        call = libc.renameat2
        return lambda source, target: call(_AT_FDCWD, source, _AT_FDCWD, target,
                                           _RENAME_NOREPLACE)
    if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        call = libc.renamex_np
        return lambda source, target: call(source, target, _RENAME_EXCL)
    return None


def rename_no_replace(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move ``source`` to ``target`` in one step, unless anything is at ``target``.

    Raises
    ------
    FileExistsError
        Something (a file, a directory, empty or not, a link) is at ``target``; ``source``
        is where it was.
    """
    source, target = Path(source), Path(target)
    call = _native()
    if call is not None:
        if call(os.fsencode(source), os.fsencode(target)) == 0:
            return
        code = ctypes.get_errno()
        if code not in _UNSUPPORTED:
            raise OSError(code, os.strerror(code), str(source), None, str(target))
    os.mkdir(target)  # the claim: FileExistsError if anything is there
    try:
        os.rename(source, target)  # over our own empty directory
    except BaseException:
        os.rmdir(target)
        raise
