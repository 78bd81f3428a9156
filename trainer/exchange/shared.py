"""Shared memory between a trainer worker and a holder on the same host.

Over the direct channel's local socket (see :mod:`.protocol`) a worker hands the holder one
anonymous memory file holding two regions of a payload's size: the payload it pushes and
the reply it is sent. A push then moves no payload bytes at all: the worker's gradients
already lie in memory the holder reads (its model's ``.grad`` tensors are views of the
first region, see :meth:`FlatModel.adopt`), and the holder writes fresh parameters straight
into the second, which is the worker's model itself. Only the push's header and the reply's
travel on the socket, and they order the accesses: the holder reads the payload between a
header and its reply, and the worker writes it only after the reply came. The holder may
even keep its parameters in the second region (see ``Arithmetic.adopt``): its updates then
land in the worker's model in place, and only while the worker waits for a reply.

The file is a Linux ``memfd``: it has no name, lives as long as someone maps it (a process
that dies takes nothing with it and leaves nothing behind), and is passed over the
authenticated local socket only. It is sealed against shrinking before it is sent, so the
holder's mapping can never lose pages under it (a truncated mapping would kill the holder's
process on the next read); the holder maps only files that carry that seal.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import sys

import numpy as np

__all__ = ["Regions", "offer", "receive_offer"]

_OFFER = struct.Struct("<q")  # bytes of the file (0: no offer)
_SEALS = ("F_ADD_SEALS", "F_GET_SEALS", "F_SEAL_SHRINK", "F_SEAL_GROW")


class Regions:
    """The two float32 regions of a shared file: ``payload`` then ``reply``, ``size``
    values each."""

    def __init__(self, memory: mmap.mmap, size: int) -> None:
        self.memory = memory
        self.size = size
        values = np.frombuffer(memory, dtype=np.float32, count=2 * size)
        self.payload = values[:size]
        self.reply = values[size:]

    @property
    def nbytes(self) -> int:
        return 8 * self.size


def supported() -> bool:
    """Whether this system has sealable anonymous memory files and descriptor passing."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False
    import fcntl
    return all(hasattr(fcntl, name) for name in _SEALS) and hasattr(socket, "send_fds")


def create(size: int) -> tuple[int, Regions]:
    """A new sealed memory file for payloads of ``size`` float32 values, mapped: its
    descriptor (to send, then keep for the next connection) and its regions."""
    import fcntl
    nbytes = 8 * size
    fd = os.memfd_create("dasktrain-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        # Allocated now, not on first touch: a system short of memory fails here, clearly,
        # rather than with SIGBUS in whichever process first writes a page.
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        memory = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, Regions(memory, size)


def offer(sock: socket.socket, fd: int | None, size: int) -> None:
    """Offer the file ``fd`` of payloads of ``size`` values over ``sock`` (None: say that
    no file is offered, so the holder reads bytes from the socket)."""
    if fd is None:
        sock.sendall(_OFFER.pack(0))
    else:
        socket.send_fds(sock, [_OFFER.pack(8 * size)], [fd])


def receive_offer(sock: socket.socket, size: int, timeout: float) -> Regions | None:
    """Receive a worker's :func:`offer` from a blocking ``sock``: the regions, if it
    offered a sealed file of payloads of ``size`` values; None if it offered none or one
    that does not fit (the worker then sends bytes). Raises on a broken connection."""
    sock.settimeout(timeout)
    data, fds, _, _ = socket.recv_fds(sock, _OFFER.size, 1)
    if len(data) != _OFFER.size:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the connection ended before its shared-memory offer")
    (nbytes,) = _OFFER.unpack(data)
    if not fds:
        return None
    fd = fds[0]
    try:
        if nbytes != 8 * size or not _sealed(fd) or os.fstat(fd).st_size != nbytes:
            return None
        return Regions(mmap.mmap(fd, nbytes), size)
    except OSError:
        return None
    finally:
        os.close(fd)  # the mapping keeps the memory


def _sealed(fd: int) -> bool:
    import fcntl
    with contextlib.suppress(OSError):
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    return False
