"""A trainer worker's connection to the holder's direct channel: one blocking socket whose
every transfer keeps a deadline and notices a dead holder.

A transfer blocks at most ``_SLICE`` seconds at a time; after a slice that moved nothing it
asks whether the holder's worker still lives, so a dead holder fails a wait at once and a
silent one at the deadline. This slicing is done per system call rather than through
:func:`dasktrain._deadline.wait_until`: a transfer that moves some bytes and then stalls is
one wait with one deadline, and the socket's timeout is only set when it changes, as every
bucket of a push passes through here.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

from dasktrain.trainer.errors import HolderLost, TrainerError

__all__ = ["HolderLink", "Wait"]

_SLICE = 2.0  # seconds between liveness checks while a transfer makes no progress
_LOST_GRACE = 1.0  # seconds the scheduler has to report a dead holder after a dropped connection


class Wait:
    """A deadline and what it is for (for the error that says it passed)."""

    __slots__ = ("deadline", "seconds", "what")

    def __init__(self, seconds: float, what: str) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.what = what


class HolderLink:
    """One connection to the holder (see :meth:`local` and :meth:`tcp`), used by one thread
    at a time.

    ``alive`` tells whether the holder's worker still exists; ``host`` names the holder in
    errors.
    """

    def __init__(self, sock: socket.socket, timeout: float, host: str,
                 alive: Callable[[], bool]) -> None:
        self.sock = sock
        self._timeout: float | None = timeout  # the socket's, as last set
        self._host = host
        self._alive = alive

    @classmethod
    def local(cls, name: str, timeout: float, host: str, alive: Callable[[], bool]
              ) -> HolderLink | None:
        """A connection to the holder's local socket ``name``; None where it cannot be
        reached (another host, or another network namespace): that fails at once."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(name)
        except OSError:
            sock.close()
            return None
        return cls(sock, timeout, host, alive)

    @classmethod
    def tcp(cls, address: tuple[str, int], timeout: float, alive: Callable[[], bool]
            ) -> HolderLink:
        """A TCP connection to the holder at ``address``."""
        sock = socket.create_connection(address, timeout=timeout)
        return cls(sock, timeout, f"{address[0]}:{address[1]}", alive)

    def send(self, data: bytes | memoryview, wait: Wait) -> None:
        view = memoryview(data)
        sent = 0
        while sent < view.nbytes:
            self._set_timeout(wait)
            try:
                sent += self.sock.send(view[sent:])
            except TimeoutError:
                self._check_alive(wait.what)
            except OSError as exc:
                raise self._lost(exc) from exc

    def recv_into(self, view: memoryview, wait: Wait, handshake: bool = False) -> None:
        """Fill ``view``. ``handshake``: a connection not yet accepted, which the holder
        may close for a newer one (see :mod:`.admission`): its end is an OSError to retry
        at once, not a lost connection whose holder is given time to be found dead."""
        got = 0
        while got < view.nbytes:
            self._set_timeout(wait)
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                self._check_alive(wait.what)
                continue
            except OSError as exc:
                if handshake:
                    raise
                raise self._lost(exc) from exc
            if n == 0:
                if handshake:
                    raise ConnectionError("connection closed by the holder before it was "
                                          "accepted")
                raise self._lost(ConnectionError("connection closed by the holder"))
            got += n

    def _set_timeout(self, wait: Wait) -> None:
        """Block at most a slice, or what is left of the deadline; fails once it passed.
        (Set only when it changes: every transfer of a push loops through here.)"""
        left = wait.deadline - time.monotonic()
        if left <= 0:
            self.close()
            raise TrainerError(f"no answer from the parameter holder ({self._host}) for "
                               f"{wait.what} after {wait.seconds:.0f}s")
        seconds = min(_SLICE, left)
        if seconds != self._timeout:
            self.sock.settimeout(seconds)
            self._timeout = seconds

    def _check_alive(self, what: str) -> None:
        if not self._alive():
            self.close()
            raise HolderLost(f"the parameter holder's worker ({self._host}) died while "
                             f"waiting for {what}")

    def _lost(self, exc: BaseException) -> TrainerError:
        """The error for a dropped connection: HolderLost only if the holder's worker is
        gone. A process that dies drops its connections at the moment the scheduler learns
        of it, so it is given a moment to tell (a poll of ``alive``, not a wait on a result:
        nothing here for :func:`~dasktrain._deadline.wait_until` to ask in slices)."""
        self.close()
        deadline = time.monotonic() + _LOST_GRACE
        while self._alive():
            if time.monotonic() >= deadline:
                return TrainerError(f"lost the connection to the parameter holder "
                                    f"({self._host}), whose worker is still alive: {exc}")
            time.sleep(_LOST_GRACE / 10)
        return HolderLost(f"the parameter holder's worker ({self._host}) died: {exc}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
