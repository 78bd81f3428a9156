"""A process's own peak resident memory, as tests and benchmarks compare it."""

from __future__ import annotations

import resource

__all__ = ["peak_resident"]


def peak_resident() -> int:
    """This process's peak resident memory in bytes: Linux's ``VmHWM``, which a new program
    starts afresh.

    Not ``ru_maxrss``: Linux carries the peak of the process that started a program across
    ``exec``, so a Dask worker's would be at least its nanny's process's peak when it
    started it (a LocalCluster's: the driver's, or a test run's), which hides the worker's
    own. Elsewhere than Linux, ``ru_maxrss`` (kilobytes there too on the BSDs, bytes on
    macOS: read as kilobytes, an upper bound).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
