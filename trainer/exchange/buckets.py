"""Gradient buckets: pushing a gradient while backward is still computing it.

Backward produces the gradients of the last layers first. A push that waited for the whole
backward would leave the wire idle for most of the step and then put the whole transfer on
the step's critical path, as PyTorch DDP's gradient buckets avoid for its all-reduce. So
the direct channel sends a payload in *buckets*: runs of whole tensors of at least
``BUCKET_BYTES``, taken from the end of the parameters towards their start (the order in
which backward finishes them), then the model's buffers (final once forward ran). A worker
sends each bucket as soon as backward has finished every tensor in it
(:class:`GradientReadiness`, from ``register_post_accumulate_grad_hook``); the holder
receives the buckets in the same order into the same places, so what arrives is the same
payload, byte for byte, whichever way it was sent.

The holder decides the order (:func:`bucket_order`) and hands it to each worker with its
channel contact, so the two sides cannot disagree. Buckets hold whole tensors: a tensor is
finished all at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from dasktrain.trainer.flat import FlatLayout

__all__ = ["BUCKET_BYTES", "GradientReadiness", "bucket_of", "bucket_order", "reply_order"]

BUCKET_BYTES = 1 << 20
"""Bytes from which a run of tensors makes a bucket: large enough that a send costs more
than its call, small enough that the first one leaves early in backward."""

Order = tuple[tuple[int, int], ...]


def bucket_order(layout: FlatLayout, payload_size: int,
                 bucket_bytes: int = BUCKET_BYTES) -> Order:
    """The ``(start, stop)`` slices of a payload in the order they travel.

    Parameters from the last tensor to the first, cut into runs of whole tensors of at least
    ``bucket_bytes`` (the run at the start of the parameters may be smaller), then the
    buffers as one slice. A payload that is not gradients-then-buffers (``payload_size``
    other than the layout's size: parameters with optimizer state) travels in one piece.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    if payload_size != layout.size:
        return ((0, payload_size),)
    order: list[tuple[int, int]] = []
    stop = layout.num_params
    for _, start, _, _ in reversed(layout.param_segments()):
        if (stop - start) * 4 >= bucket_bytes:
            order.append((start, stop))
            stop = start
    if stop > 0:
        order.append((0, stop))
    if layout.num_buffers:
        order.append((layout.num_params, layout.size))
    return tuple(order)


def bucket_of(order: Order, start: int, stop: int) -> int:
    """The index in ``order`` of the slice holding the tensor at ``[start, stop)``
    (buckets hold whole tensors)."""
    return next(i for i, (lo, hi) in enumerate(order) if lo <= start and stop <= hi)


class GradientReadiness:
    """Tells, during backward, which buckets of ``order`` have every gradient in them.

    Hooks are put on ``params`` (the model's trainable parameters, in layout order) once;
    :meth:`arm` before a backward says whom to tell (``on_ready(bucket)``, called from the
    backward, in whatever order buckets finish) and :meth:`disarm` after it. A bucket
    without parameters (the buffers) is ready at once. Parameters that take no part in a
    backward never report: the caller sends whatever is left after the backward returns.
    """

    def __init__(self, params: Sequence[torch.Tensor], layout: FlatLayout, order: Order
                 ) -> None:
        segments = layout.param_segments()
        if len(segments) != len(params):
            raise ValueError(f"{len(params)} parameters for a layout of {len(segments)}")
        self.order = order
        self._bucket_of: list[int] = []
        self._sizes = [0] * len(order)
        for _, start, stop, _ in segments:
            bucket = bucket_of(order, start, stop)
            self._bucket_of.append(bucket)
            self._sizes[bucket] += 1
        self._left: list[int] = []
        self._on_ready: Callable[[int], None] | None = None
        self._lock = threading.Lock()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(params)]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[index]

        def finished(_: torch.Tensor) -> None:
            with self._lock:
                if self._on_ready is None:
                    return
                self._left[bucket] -= 1
                ready = self._left[bucket] == 0
                on_ready = self._on_ready
            if ready:
                on_ready(bucket)

        return finished

    def arm(self, on_ready: Callable[[int], None]) -> None:
        """Report buckets to ``on_ready`` during the next backward."""
        with self._lock:
            self._left = list(self._sizes)
            self._on_ready = on_ready
        for bucket, size in enumerate(self._sizes):
            if size == 0:
                on_ready(bucket)

    def disarm(self) -> None:
        with self._lock:
            self._on_ready = None

    def remove(self) -> None:
        """Take the hooks off the model."""
        self.disarm()
        for handle in self._handles:
            handle.remove()


def reply_order(order: Order) -> Order:
    """The slices of a reply (parameters then buffers) in the order they travel: the
    reverse of the gradients' (``order``), so the buffers come first, then the parameters
    from the first tensor to the last, the order in which a forward pass reads them (see
    :mod:`.arrival`)."""
    return tuple(reversed(order))
