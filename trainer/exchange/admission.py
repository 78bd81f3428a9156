"""The connections the holder's channel keeps while they have yet to present a token.

The channel's port is open to anyone who reaches the host, so a connection holds one of the
holder's worker's descriptors from the moment it is accepted until it presents its worker's
token (or its hello deadline passes). :class:`WaitingRoom` bounds how many do at once.

When the room is full a newcomer pushes the *oldest* connection out, rather than being
turned away. Turning newcomers away let a flood of silent connections keep every slot for
their whole hello deadline, and a real worker reconnecting meanwhile was refused and fell
back to the actor's calls. A worker sends its token the moment it connects, so it leaves the
room long before ``capacity`` newer connections could push it out; a silent connection is
the one that grows old there. The descriptors held stay bounded all the same, and an
authenticated connection never counts: it has left the room.

:class:`Members` keeps each worker's one connection once its token is presented,
:class:`Refusals` keeps the warnings of refused connections few, and :func:`local_listener`
opens the local socket workers on the holder's host connect to.
"""

from __future__ import annotations

import logging
import math
import secrets
import socket
import sys
import time

__all__ = ["Members", "Refusals", "WaitingRoom", "local_listener"]

_LOG_EVERY = 60.0  # seconds between warnings of refused connections


class WaitingRoom:
    """At most ``capacity`` connections waiting to present a token, oldest first.

    Used from the holder's event loop only (no lock).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a waiting room holds at least one connection, got {capacity}")
        self.capacity = capacity
        # Insertion-ordered: the first key is the connection accepted longest ago.
        self._waiting: dict[socket.socket, None] = {}

    def enter(self, sock: socket.socket) -> socket.socket | None:
        """Let ``sock`` wait; the connection it pushed out (to be shut by the caller), or
        None while there was room."""
        pushed_out = None
        if len(self._waiting) >= self.capacity:
            pushed_out = next(iter(self._waiting))
            del self._waiting[pushed_out]
        self._waiting[sock] = None
        return pushed_out

    def leave(self, sock: socket.socket) -> None:
        """``sock`` presented its token, or ended (a second call is harmless)."""
        self._waiting.pop(sock, None)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, sock: object) -> bool:
        return sock in self._waiting


def local_listener() -> socket.socket | None:
    """A listening socket in Linux's abstract namespace (no file to clean up, gone with the
    process), or None where there is none. Its random name is only learnt through the
    actor, and a connection to it still has to present a worker's token."""
    if not sys.platform.startswith("linux"):
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0dasktrain-channel-{secrets.token_hex(16)}")
        listener.listen(64)
        listener.setblocking(False)
    except OSError:
        listener.close()
        return None
    return listener


class Members:
    """Each worker's authenticated connection, with the incarnation it serves.

    A worker that connects again was restarted: its old connection may never see an end (a
    vanished machine sends no reset) and holds a payload-sized buffer, so it is given back
    to be closed. A superseded incarnation (its process lives on: retiring, or dropped while
    silent) that connects after its successor has no place: closing the successor's
    connection would fail a worker that lives. Used from the holder's event loop only.
    """

    def __init__(self) -> None:
        self._by_worker: dict[int, tuple[socket.socket, int]] = {}

    def superseding(self, worker: int, incarnation: int) -> int | None:
        """The newer incarnation of ``worker`` that is connected, if any."""
        held = self._by_worker.get(worker)
        return held[1] if held is not None and held[1] > incarnation else None

    def enter(self, worker: int, incarnation: int, sock: socket.socket
              ) -> socket.socket | None:
        """``sock`` serves ``worker``'s ``incarnation`` from now on; the connection it
        replaces, to close."""
        held = self._by_worker.get(worker)
        self._by_worker[worker] = (sock, incarnation)
        return held[0] if held is not None and held[0] is not sock else None

    def leave(self, worker: int, sock: socket.socket) -> None:
        """``sock`` has ended (a newer connection of the worker stays)."""
        if self._by_worker.get(worker, (None,))[0] is sock:
            del self._by_worker[worker]

    def __len__(self) -> int:
        return len(self._by_worker)


class Refusals:
    """Warns of refused connections at most once every ``_LOG_EVERY`` seconds, counting the
    rest: a flood of connections must not become a flood of log lines."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._quiet_until = -math.inf
        self._unreported = 0

    def note(self, why: str) -> None:
        now = time.monotonic()
        if now < self._quiet_until:
            self._unreported += 1
            return
        others = (f"; {self._unreported} more closed since the last warning"
                  if self._unreported else "")
        self._logger.warning("parameter holder: closed a push connection: %s%s (further "
                             "ones in the next %.0fs are only counted)", why, others,
                             _LOG_EVERY)
        self._quiet_until = now + _LOG_EVERY
        self._unreported = 0
