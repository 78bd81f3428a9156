"""Hosts on one machine, for tests and benchmarks: Linux network namespaces, each with its own
address, hostname and loopback, joined by a bridge.

On one machine every process shares one network stack, so the paths a cluster of several
machines takes (the holder's channel over TCP, shards spread over hosts, a whole host that
dies) are never the ones chosen. A network namespace is another host as far as a process can
tell: its own interfaces, addresses, routes and ports, and its own abstract local sockets (a
local socket of one is out of reach from another, as from another machine); a UTS namespace
gives it its own hostname. They still share the machine's CPUs, memory and files: a dataset
on local disk is seen from every host, as on a shared file system.

How a host is made. A *keeper* process (``unshare --net --uts``) owns the host's namespaces:
it sets the hostname, brings loopback up and then waits on its stdin. Every process of the
host enters them with ``nsenter --target KEEPER --net --uts``. The first host holds a bridge
named ``eth0`` with the address 192.0.2.1; every other host k is joined to it by a veth pair
whose end in host k is named ``eth0`` and has 192.0.2.(k+1). The addresses are from
192.0.2.0/24 (TEST-NET-1, RFC 5737: for documentation, routed nowhere) and exist only inside
these namespaces: nothing (interface, address, route) is added outside them, and from a host
nothing but the other hosts can be reached.

Nothing outlives its maker. A keeper exits when its stdin closes, that is when the process
that made it ends, however it ends; a process started on a host (:meth:`Hosts.popen`) gets
SIGKILL when the thread that started it ends (``setpriv --pdeathsig``, where util-linux has
it: start them from a thread that lives as long as they should, such as the main thread),
and Dask's worker processes exit with their nanny. The kernel removes a namespace, with the
links in it, when its last process ends. :meth:`Hosts.close` does all of this at once and
waits until it is done.

Linux only, as root (CAP_SYS_ADMIN and CAP_NET_ADMIN); :func:`unavailable` says why not
elsewhere, and :class:`HostsUnavailable` when making a namespace fails all the same.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = ["INTERFACE", "SUBNET", "Host", "Hosts", "HostsUnavailable", "unavailable"]

#: The first three octets of every host's address (TEST-NET-1, RFC 5737).
SUBNET = "192.0.2"
#: The name of each host's interface to the others (the same on every host, so that a
#: setting such as ``GLOO_SOCKET_IFNAME`` is one value for all).
INTERFACE = "eth0"
#: The most hosts one bridge joins (their addresses end in .1 to .254).
MAX_HOSTS = 254

_TOOLS = ("unshare", "nsenter", "ip")
_START_TIMEOUT = 10.0  # seconds for a keeper to set its host up, or a command to run
_STOP_TIMEOUT = 10.0  # seconds for killed processes to be gone
_POLL = 0.01  # seconds between looks at /proc while processes are going
# The keeper: a hostname, loopback up, "ready", then nothing until its stdin closes.
_KEEPER = 'hostname "$0" && ip link set lo up && echo ready && exec cat >/dev/null'


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine, or None where they may (making them can
    still fail, with :class:`HostsUnavailable`)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"no {', '.join(missing)} on PATH (util-linux's unshare and nsenter, "
                "iproute2's ip)")
    return None


@dataclass(frozen=True, slots=True)
class Host:
    """One host: the namespaces of its keeper process."""

    name: str
    """Its hostname."""
    address: str
    """Its IPv4 address, on :data:`INTERFACE`."""
    keeper: int
    """The process id of its keeper, whose namespaces are the host's."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["nsenter", f"--target={self.keeper}", "--net", "--uts", "--", *argv]


class Hosts:
    """``count`` hosts joined by a bridge, made by :meth:`start` (or ``with``) and removed,
    with every process on them, by :meth:`close`.

    Parameters
    ----------
    count
        How many hosts; the first holds the bridge.
    name
        The start of their hostnames: ``{name}-a-{token}``, ``{name}-b-{token}``, ... with
        a token of this run, so that the hosts of two runs are never mistaken for each other
        in logs.
    """

    def __init__(self, count: int = 2, *, name: str = "dasktrain") -> None:
        if not isinstance(count, int) or not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"count must be between 1 and {MAX_HOSTS} hosts, got {count!r}")
        self.count = count
        self.token = secrets.token_hex(3)
        self._name = name
        self._hosts: list[Host] = []
        self._keepers: list[subprocess.Popen] = []
        self._started: list[tuple[Host, subprocess.Popen]] = []
        # Processes started here die with the thread that started them, where this exists.
        self._guard = (["setpriv", "--pdeathsig", "KILL", "--"]
                       if shutil.which("setpriv") else [])

    # -- making them ------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        return self if self._hosts else self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def start(self) -> Hosts:
        """Make the hosts and the bridge between them; :class:`HostsUnavailable` where
        namespaces cannot be made."""
        if self._hosts:
            raise RuntimeError("these hosts are started already")
        reason = unavailable()
        if reason is not None:
            raise HostsUnavailable(reason)
        try:
            for k in range(self.count):
                self._hosts.append(self._keep(k))
            self._link()
        except BaseException:
            self.close()
            raise
        return self

    def _keep(self, k: int) -> Host:
        """Start host ``k``'s keeper and wait until its hostname is set and loopback up."""
        letters = _letters(k)
        name = f"{self._name}-{letters}-{self.token}"
        keeper = subprocess.Popen(
            [*self._guard, "unshare", "--net", "--uts", "--", "sh", "-c", _KEEPER, name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._keepers.append(keeper)
        line = _read_line(keeper.stdout, _START_TIMEOUT)
        if line != b"ready\n":
            with contextlib.suppress(subprocess.TimeoutExpired):
                keeper.wait(timeout=_START_TIMEOUT)
            why = _tail(keeper.stderr) if keeper.poll() is not None else "no answer"
            raise HostsUnavailable(f"cannot make a network namespace (unshare --net --uts): "
                                   f"{why or f'exit status {keeper.returncode}'}")
        return Host(name=name, address=f"{SUBNET}.{k + 1}", keeper=keeper.pid)

    def _link(self) -> None:
        """The bridge in the first host, a veth pair from it to each other host."""
        first = self._hosts[0]
        commands = [f"link add {INTERFACE} type bridge",
                    f"addr add {first.address}/24 dev {INTERFACE}",
                    f"link set {INTERFACE} up"]
        for k, host in enumerate(self._hosts[1:], start=1):
            commands += [f"link add port{k} type veth peer name {INTERFACE} netns "
                         f"{host.keeper}",
                         f"link set port{k} master {INTERFACE} up"]
        self._ip(first, commands)
        for host in self._hosts[1:]:
            self._ip(host, [f"addr add {host.address}/24 dev {INTERFACE}",
                            f"link set {INTERFACE} up"])

    def _ip(self, host: Host, commands: list[str]) -> None:
        done = subprocess.run(host.command(["ip", "-batch", "-"]), input="\n".join(commands),
                              capture_output=True, text=True, timeout=_START_TIMEOUT)
        if done.returncode != 0:
            raise HostsUnavailable(f"cannot link the hosts ({'; '.join(commands)}): "
                                   f"{done.stderr.strip()}")

    def limit_rate(self, rate: str) -> None:
        """Limit every link between the hosts to ``rate`` each way (tc's units, such as
        ``"3gbit"``): a real network's bandwidth. Unlimited, a link between namespaces moves
        bytes as fast as the processors copy them, so its transfers cost CPU time rather
        than time on a wire that the processors may spend computing."""
        if not self._hosts:
            raise RuntimeError("start the hosts first")
        if not shutil.which("tc"):
            raise HostsUnavailable("no tc here to limit the links' rate")
        first = self._hosts[0]
        ends = [(first, f"port{k}") for k in range(1, len(self._hosts))]
        ends += [(host, INTERFACE) for host in self._hosts[1:]]
        for host, device in ends:
            argv = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "50ms"]
            done = subprocess.run(host.command(argv), capture_output=True, text=True,
                                  timeout=_START_TIMEOUT)
            if done.returncode != 0:
                raise ValueError(f"cannot limit the links to {rate!r}: "
                                 f"{done.stderr.strip()}")

    # -- using them -------------------------------------------------------------------------
    def __getitem__(self, index: int) -> Host:
        return self._hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts)

    def __len__(self) -> int:
        return len(self._hosts)

    def popen(self, host: Host, argv: Sequence[str], **options: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a process group of its own (``options`` go to
        :class:`subprocess.Popen`); :meth:`kill` and :meth:`close` end it, and all it
        started."""
        if host not in self._hosts:
            raise ValueError(f"{host.name} is not one of these hosts")
        process = subprocess.Popen([*self._guard, *host.command(argv)],
                                   start_new_session=True, **options)
        self._started.append((host, process))
        return process

    def processes(self, host: Host) -> list[int]:
        """The process ids on ``host``, besides its keeper."""
        return self._others(host) or []

    def _others(self, host: Host) -> list[int] | None:
        """The processes on ``host`` besides its keeper; None once the keeper ended. (A
        namespace is known by the numbers of its inode, which the kernel may give to a new
        one once it is gone: while the keeper lives, they are this host's alone.)"""
        keeper = self._keepers[self._hosts.index(host)]
        if keeper.poll() is not None:
            return None
        try:
            space = _namespace(host.keeper)
        except OSError:
            return None
        return [pid for pid in _pids_in(space) if pid != host.keeper]

    def kill(self, host: Host, processes: Sequence[subprocess.Popen] | None = None) -> None:
        """SIGKILL ``processes`` (default: every process on ``host``), with everything each
        started, and wait until they are gone. As a machine whose processes all die at once:
        its connections are closed (a machine cut off the network would leave them
        unanswered instead)."""
        mine = [p for h, p in self._started if h == host]
        targets = mine if processes is None else list(processes)
        for process in targets:
            # Its group, with what it started; only while it is not reaped (until then its
            # number, which is the group's, cannot be another process's).
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in targets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_STOP_TIMEOUT)
        self._started = [(h, p) for h, p in self._started if p not in targets]
        if processes is None:  # also what left its group: the namespace holds them all
            _kill_until_gone(lambda: self._others(host) or [], f"the processes on {host.name}")

    def close(self) -> None:
        """Kill every process on the hosts, end the keepers and wait until the namespaces
        are gone (with them the bridge and the links)."""
        for host in self._hosts:  # while the keepers live: see _others
            self.kill(host)
        for keeper in self._keepers:
            with contextlib.suppress(OSError):
                keeper.stdin.close()  # its `cat` ends, and with it the keeper
        for keeper in self._keepers:
            try:
                keeper.wait(timeout=_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                keeper.kill()
                keeper.wait(timeout=_STOP_TIMEOUT)
            for stream in (keeper.stdout, keeper.stderr):
                stream.close()
        # Nothing else was left in their namespaces: with the keepers they are gone.
        self._keepers.clear()
        self._hosts.clear()


def _letters(k: int) -> str:
    """a, b, ..., z, ba, bb, ...: a host's letter(s) by its number."""
    letters = ""
    while True:
        k, digit = divmod(k, 26)
        letters = chr(ord("a") + digit) + letters
        if k == 0:
            return letters


def _namespace(pid: int) -> tuple[int, int]:
    """The identity of process ``pid``'s network namespace."""
    found = os.stat(f"/proc/{pid}/ns/net")
    return found.st_dev, found.st_ino


def _pids_in(space: tuple[int, int]) -> list[int]:
    """The live processes in network namespace ``space``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _namespace(int(entry)) == space:
                    found.append(int(entry))
            except OSError:  # gone, or a zombie (which holds no namespace)
                continue
    return found


def _kill_until_gone(pids: Callable[[], list[int]], what: str) -> None:
    """SIGKILL the processes ``pids()`` lists until it lists none; RuntimeError if some
    are still there after :data:`_STOP_TIMEOUT` seconds."""
    deadline = time.monotonic() + _STOP_TIMEOUT
    while left := pids():
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} {left} still run {_STOP_TIMEOUT:.0f}s after SIGKILL")
        time.sleep(_POLL)  # they are the kernel's to reap now: nothing to wait on but /proc


def _read_line(stream: BinaryIO, timeout: float) -> bytes:
    """A line from ``stream`` (a pipe), or what came before the deadline or its end."""
    deadline = time.monotonic() + timeout
    line = b""
    fd = stream.fileno()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line


def _tail(stream: BinaryIO) -> str:
    """The last line a finished process wrote to ``stream``."""
    lines = stream.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""
