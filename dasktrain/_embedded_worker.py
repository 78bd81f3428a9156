"""What each worker process of the embedded cluster does first: a Dask preload.

A terminal sends Ctrl-C (SIGINT) to its whole foreground process group. The embedded
cluster's worker processes are children of the command, so they would get it too and die
mid-task, printing tracebacks, while the command itself cleans up; the command alone is
meant to handle it, and then close its cluster. So :mod:`dasktrain._cluster` starts the
workers with SIGINT and SIGTERM blocked (they inherit the block from the thread that
spawns them), and here each worker leaves the terminal's process group for a session of its
own before it unblocks them: signals sent to the group never reach it again. A worker
still ends with its parent however that ends (distributed's nanny closes it, or it exits
when its parent's pipe closes).

A task's error reaches the caller as its exception; the worker's own "Compute Failed" log
record of it would only repeat it on the terminal, with a worker traceback, so it is dropped.
So is a failed sample of Dask's statistical profiler: it reads the frames of threads that
go on running, and on CPython 3.11 that read can race with them and raise from inside
``distributed/profile.py`` (dask/distributed#8163). Only that sample is lost; the traceback
it logs would land on the command's terminal, mid-run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

__all__ = ["TERMINAL_SIGNALS", "dask_setup", "leave_terminal_process_group"]

#: Signals a terminal or ``kill -- -PGID`` sends to a whole process group.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


class _DropComputeFailed(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Compute Failed")


class _DropProfilerRace(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[2] is None:
            return True
        last = record.exc_info[2]
        while last.tb_next is not None:
            last = last.tb_next
        return not last.tb_frame.f_code.co_filename.endswith(_PROFILER_FILE)


_PROFILER_FILE = os.path.join("distributed", "profile.py")


def leave_terminal_process_group() -> None:
    """Move this process into a session of its own, then unblock :data:`TERMINAL_SIGNALS`.

    A signal that arrived for the old group while they were blocked is discarded, not
    delivered: it was meant for the command, which handles it.
    """
    with contextlib.suppress(OSError):  # already a group leader: nothing to leave
        os.setsid()
    if not hasattr(signal, "pthread_sigmask"):
        return
    pending = signal.sigpending() & TERMINAL_SIGNALS
    for signum in pending:
        signal.sigtimedwait({signum}, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)


def dask_setup(worker: Any) -> None:
    """Preload hook, run once in each worker process as it starts."""
    leave_terminal_process_group()
    logging.getLogger("distributed.worker").addFilter(_DropComputeFailed())
    # Tornado logs an exception in a periodic callback (the profiler's) on this logger.
    logging.getLogger("tornado.application").addFilter(_DropProfilerRace())
