"""Two hosts on this machine with a Dask cluster across them, for the tests of the paths
between hosts (see :mod:`dasktrain._hosts`).

``from tests.common.hosts import two_hosts_fixture`` makes the fixture ``two_hosts`` (one per
module) available in a test module: host A runs the scheduler, two worker processes and the
driver, host B two worker processes. The code under test runs in the driver, a process on
host A (where the cluster's addresses are), through :meth:`TwoHosts.run`. The tests are
skipped, with the reason, where network namespaces cannot be made (not Linux, not root, no
``unshare``/``nsenter``/``ip``, or making one fails). Everything the fixture made is gone
when it ends, a failed test's too, and if the test process is killed its hosts end with it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dasktrain._host_cluster import HostCluster, connect
from dasktrain._hosts import Host, Hosts, HostsUnavailable, unavailable
from dasktrain._remote import Remote
from tests.common.builders import REPO
from tests.common.training import mse

WORKERS = (2, 2)  # worker processes on host A and on host B
CALL_TIMEOUT = 120.0  # seconds a call on the driver may take
# Variables of every process on the hosts: the tests' modules import there (a task's
# function travels by name), one torch thread each, and no cloud metadata service asked.
ENVIRONMENT = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", "AWS_EC2_METADATA_DISABLED": "true"}


@dataclasses.dataclass
class TwoHosts:
    hosts: Hosts
    cluster: HostCluster
    driver: Remote

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def host_of(self, address: str) -> Host:
        """The host of a Dask worker's address."""
        return self.cluster.worker_hosts()[address.partition("://")[2].rpartition(":")[0]]

    def run(self, function: Callable[..., Any], *args: Any, timeout: float = CALL_TIMEOUT,
            **kwargs: Any) -> Any:
        """``function(client, *args, **kwargs)`` run on host A, ``client`` the cluster's,
        once all its workers are there."""
        return self.driver.call(_with_client, function, self.cluster.scheduler_address,
                                sum(self.cluster.workers), args, kwargs, timeout=timeout)


def _with_client(function: Callable[..., Any], address: str, workers: int, args: tuple,
                 kwargs: dict) -> Any:
    return function(connect(address, workers, CALL_TIMEOUT), *args, **kwargs)


def start_hosts(count: int = 2) -> Hosts:
    """Started hosts, or the test is skipped with the reason they cannot be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no hosts of network namespaces here: {reason}")
    try:
        return Hosts(count).start()
    except HostsUnavailable as exc:
        pytest.skip(f"no hosts of network namespaces here: {exc}")


@pytest.fixture(scope="module", name="two_hosts")
def two_hosts_fixture(tmp_path_factory):
    hosts = start_hosts(2)
    with hosts, \
            HostCluster(hosts, WORKERS, directory=tmp_path_factory.mktemp("hosts"),
                        environment=ENVIRONMENT) as cluster, \
            Remote(hosts, hosts[0], environment=ENVIRONMENT, cwd=REPO) as driver:
        yield TwoHosts(hosts, cluster, driver)


_CALLS: collections.Counter = collections.Counter()


def kill_host_once(output: torch.Tensor, target: torch.Tensor, marker: str, calls: int,
                   hostname: str) -> torch.Tensor:
    """MSE; on host ``hostname``, the ``calls``-th call in a process kills the process
    group it is in, once per test (``marker`` file): every worker process of the host and
    their nannies (one ``dask worker`` command, see :class:`HostCluster`), as when the
    machine dies."""
    if socket.gethostname() == hostname:
        _CALLS[marker] += 1
        if _CALLS[marker] >= calls and not Path(marker).exists():
            Path(marker).touch()
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return mse(output, target)
