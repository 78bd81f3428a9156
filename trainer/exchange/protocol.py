"""The direct channel's wire: what the holder's :mod:`.server` and a worker's :mod:`.client`
both have to agree on.

Dask's actor calls cost milliseconds each (a message through the worker's RPC layer, a
task-like dispatch, serialisation into frames and back), several times what the bytes take
on the wire. Pushes, the only calls made every step, therefore go over a plain socket of
their own: a fixed header, then the raw float32 payload, received straight into a buffer
that is reused step after step. Everything else (joining, progress, checkpoints) stays on
the actor.

One connection, in order:

1. the worker sends :data:`HELLO` (its token, number and incarnation); the holder answers
   :data:`ACCEPTED`, or :data:`REFUSED` for a token that is not this incarnation's (every
   push on the connection is then the incarnation's, and is refused with
   :data:`FENCED` once a newer one joined or it was dropped);
2. on a local socket only, the worker offers shared memory (see :mod:`.shared`) and the
   holder answers :data:`ACCEPTED` if it takes it, anything else if not;
3. then, push after push: :data:`PUSH` and the payload's bytes in the slices of the
   channel's :data:`Order` (none when they lie in shared memory); the holder answers
   :data:`REPLY` and the parameters' bytes (none when it wrote them into shared memory),
   or a status other than :data:`OK` and the error's message.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["ACCEPTED", "CONNECT_TIMEOUT", "FENCED", "HELLO", "OK", "PUSH", "REFUSED", "REPLY",
           "TOKEN_BYTES", "TRAINER_ERROR", "VALUE_ERROR", "Order", "check_order", "tune"]

TOKEN_BYTES = 16
HELLO = struct.Struct(f"<{TOKEN_BYTES}sqq")  # token, worker, incarnation
# version, count, loss, epoch, batches, payload bytes (-1: no batch this step)
PUSH = struct.Struct("<qqdqqq")
# status, version, bytes of the parameters (or of the error message)
REPLY = struct.Struct("<qqq")
# Statuses of a reply; FENCED's message is the reason (see dasktrain.trainer.errors.Fenced).
OK, VALUE_ERROR, TRAINER_ERROR, FENCED = 0, 1, 2, 3
ACCEPTED = b"\x01"
REFUSED = b"\x02"  # a wrong token: the worker does not try again
CONNECT_TIMEOUT = 10.0  # seconds for one attempt to connect and be accepted
# Keep-alive probes (seconds idle, seconds apart, count): a peer that vanished without a
# reset is noticed in about two minutes instead of the system's two hours.
_KEEPALIVE = (60, 10, 6)

Order = tuple[tuple[int, int], ...]  # (start, stop) slices of a payload, as they travel


def check_order(order: Order, size: int) -> None:
    """An order must cover every value of a payload exactly once."""
    ends = [0]
    for start, stop in sorted(order):
        if start != ends[-1] or stop <= start:
            break
        ends.append(stop)
    if ends[-1] != size or len(ends) != len(order) + 1:
        raise ValueError(f"a payload order must tile [0, {size}) with (start, stop) slices, "
                         f"got {order!r}")


def tune(sock: socket.socket) -> None:
    """Set a connected TCP socket up for small headers and a peer that may vanish."""
    if sock.family == socket.AF_UNIX:  # same host: no delay to turn off, no peer to vanish
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), _KEEPALIVE,
                           strict=True):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
