"""A Dask cluster across the hosts of :mod:`dasktrain._hosts`: ``dask scheduler`` on the first
host, ``dask worker`` processes (each with its nanny, one thread each) on every host, as on
a cluster of machines.

The cluster's addresses exist only inside the hosts, so its client lives there too: a
process on the first host (a :class:`~dasktrain._remote.Remote`) calls :func:`connect`,
which waits for the workers. Each host's workers are one ``dask worker --nworkers N``
command, one process group: :meth:`HostCluster.kill_workers` ends them all at once, as when a
machine dies, and :meth:`HostCluster.start_workers` brings the host back. The scheduler and
the workers log to files in the cluster's directory.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distributed import Client

from dasktrain._hosts import Host, Hosts

__all__ = ["SCHEDULER_PORT", "HostCluster", "connect"]

#: The scheduler's port: the first host's namespace is fresh, so no other process has it.
SCHEDULER_PORT = 8786


class HostCluster:
    """A Dask cluster on ``hosts``: the scheduler on the first, ``workers[k]``
    single-threaded worker processes on host k.

    Parameters
    ----------
    hosts
        Started hosts.
    workers
        Worker processes per host, one number per host (0: none there).
    directory
        Where the processes log, and the workers keep their files.
    environment
        Variables set for the scheduler and the workers, beside this process's own (for
        example ``PYTHONPATH``, so that they import the modules a task's function lives in).
    """

    def __init__(self, hosts: Hosts, workers: Sequence[int], *, directory: str | os.PathLike,
                 environment: Mapping[str, str] | None = None) -> None:
        if len(workers) != len(hosts) or any(n < 0 for n in workers):
            raise ValueError(f"workers must give a number of worker processes for each of "
                             f"the {len(hosts)} hosts, got {list(workers)!r}")
        self.hosts = hosts
        self.workers = list(workers)
        self.directory = Path(directory)
        self.scheduler_address = f"tcp://{hosts[0].address}:{SCHEDULER_PORT}"
        # One thread per process for torch and numpy, as a cluster for training is set up.
        self._environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                             **(environment or {})}
        self._scheduler: subprocess.Popen | None = None
        self._worker_groups: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> HostCluster:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def start(self) -> HostCluster:
        """Start the scheduler and every host's workers (:func:`connect` waits for them)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._scheduler = self._start(
                self.hosts[0], "scheduler",
                ["distributed.cli.dask_scheduler", "--host", self.hosts[0].address,
                 "--port", str(SCHEDULER_PORT), "--no-dashboard"])
            for k in range(len(self.hosts)):
                self.start_workers(k)
        except BaseException:
            self.close()
            raise
        return self

    def start_workers(self, k: int) -> None:
        """Start host ``k``'s worker processes (again, after :meth:`kill_workers`)."""
        if self.workers[k] == 0:
            return
        host = self.hosts[k]
        running = self._worker_groups.get(k)
        if running is not None and running.poll() is None:
            raise RuntimeError(f"the workers of {host.name} are running already")
        self._worker_groups[k] = self._start(
            host, f"workers-{host.name}",
            ["distributed.cli.dask_worker", self.scheduler_address, "--host", host.address,
             "--nworkers", str(self.workers[k]), "--nthreads", "1", "--no-dashboard",
             "--local-directory", str(self.directory / host.name),
             # Without a scheduler for this long they end (their nanny too).
             "--death-timeout", "60"])

    def kill_workers(self, k: int) -> None:
        """SIGKILL every worker process of host ``k`` and its nanny, at once."""
        group = self._worker_groups.pop(k, None)
        if group is not None:
            self.hosts.kill(self.hosts[k], [group])

    def worker_hosts(self) -> dict[str, Host]:
        """Each host by its address (the host part of a worker's address)."""
        return {host.address: host for host in self.hosts}

    def _start(self, host: Host, log: str, module: list[str]) -> subprocess.Popen:
        with open(self.directory / f"{log}.log", "ab") as out:
            return self.hosts.popen(host, [sys.executable, "-m", *module],
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self._environment,
                                    cwd=self.directory)

    def close(self) -> None:
        """Kill the workers and the scheduler."""
        for k in list(self._worker_groups):
            self.kill_workers(k)
        if self._scheduler is not None:
            with contextlib.suppress(IndexError):  # its hosts were closed already
                self.hosts.kill(self.hosts[0], [self._scheduler])
            self._scheduler = None


_clients: dict[str, Client] = {}  # this process's, by scheduler address


def connect(address: str, workers: int, timeout: float) -> Client:
    """A client of the cluster at ``address`` once it has at least ``workers`` workers,
    within ``timeout`` seconds; one per process and address (later calls return it, once
    there are that many workers again)."""
    client = _clients.get(address)
    if client is None:
        client = _clients[address] = Client(address, timeout=timeout)
    client.wait_for_workers(workers, timeout=timeout)
    return client
