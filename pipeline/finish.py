"""The last, element-wise part of a transform, left to the consumer: batches cross the
network (or the process boundary) in their smallest form and are finished where they are
used.

An image batch of ``uint8`` pixels is a quarter of the bytes of its ``float32`` normal form.
Making the floats on the workers costs every batch four times the serialisation, transfer
and deserialisation; making them on the consumer costs one element-wise pass, on the fetch
thread (so it overlaps the training step) or on the accelerator after the copy.

A transform offers the split with ``consumer_split() -> (transform for the workers,
finish)``; ``finish(tensors) -> tensors`` must give exactly what the whole transform would
have (:class:`~dasktrain.pipeline.images.ImageTransform` with :class:`Normalize` last does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Finish", "split_transform"]

#: A batch's tensors, finished on the consumer.
Finish = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def split_transform(transform: Any) -> tuple[Any, Finish | None]:
    """``(what the workers run, what the consumer runs after)`` for ``transform``; a
    transform that offers no split runs whole on the workers."""
    split = getattr(transform, "consumer_split", None)
    return (transform, None) if split is None else split()
