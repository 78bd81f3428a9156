"""glibc's allocator thresholds in a Dask worker process, set where distributed froze them.

distributed starts every worker process with ``MALLOC_TRIM_THRESHOLD_=65536`` (to hand
freed memory back to the system soon). Setting that variable also turns off glibc's
adaptive mmap threshold, which then stays at 128 KiB: every larger buffer is a fresh mmap,
page-faulted in and unmapped again when freed. Training is full of such buffers (autograd's
temporaries of each layer, batches, chunks read), so in a worker a forward and backward pass
of a 0.5 M-parameter MLP took 14 ms against 9.3 ms in a plain process.

:func:`tune_allocator` therefore sets, at run time and once per process, the values glibc's
own adaptive thresholds reach in a plain process (mmap from 32 MiB, trim at twice that) --
the same values :data:`dasktrain._cluster.WORKER_MALLOC_ENVIRONMENT` gives the embedded
cluster's workers from their start. It does so only where it finds distributed's stock
setting: a user who configured the allocator (another value, ``MALLOC_MMAP_THRESHOLD_``, or
glibc's malloc tunables) keeps their choice. The process's environment is left as it is:
writing to it while other threads read it is unsafe.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

__all__ = ["ARENA_MAX", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "give_back_freed", "tune_allocator"]

MMAP_THRESHOLD = 32 * 2**20
ARENA_MAX = 2
TRIM_THRESHOLD = 64 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_STOCK_TRIM = "65536"  # what distributed sets when nobody configured the allocator

_lock = threading.Lock()
_done = False


def tune_allocator() -> bool:
    """Set this process's allocator thresholds if it runs with distributed's stock setting
    (see the module's docstring); True if they were set now or before."""
    global _done
    with _lock:
        if _done:
            return True
        if not sys.platform.startswith("linux") \
                or os.environ.get("MALLOC_TRIM_THRESHOLD_") != _STOCK_TRIM \
                or "MALLOC_MMAP_THRESHOLD_" in os.environ \
                or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
            return False
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            # mallopt returns 1 on success; a libc without it (musl) has no such symbol.
            _done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
                libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        return _done


def give_back_freed() -> None:
    """Hand the memory this process freed back to the system: glibc's free pages in every
    arena (``malloc_trim``) and the unused memory of pyarrow's pool, where pyarrow is loaded.

    For measuring (the soak benchmark asks each worker once, at its end): what a process's
    resident memory holds beyond what it uses. Not called on a task's path: with it after
    every preparing task, a worker of the test suite's forked cluster once stopped
    answering for minutes in a Parquet preparation (not shown to be the cause, but not
    worth the risk: the Parquet reader, not the trim, is what bounds that memory).
    """
    if "pyarrow" in sys.modules:
        with contextlib.suppress(Exception):  # a pool without the call: nothing to give
            sys.modules["pyarrow"].default_memory_pool().release_unused()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # musl has no malloc_trim
            ctypes.CDLL(None).malloc_trim(0)
