"""The weighted mean of a round's payloads, into the holder's scratch buffer.

Large payloads are averaged in two halves at once (the holder's helper thread takes the
second), and the sums of the parts are kept for the finiteness check that follows. A
round's mean may also be begun while its last payloads arrive (:meth:`Means.begin`, see
:mod:`.early`); the round's :meth:`Means.average` then takes it over and finds it written.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dasktrain.trainer.exchange.landing import Landing
from dasktrain.trainer.holder.early import EarlyMean, lower_priority

__all__ = ["Means", "as_tensor"]

#: ``in_halves(size, fn, start=0)``: ``fn`` of each part of ``[start, size)``, the parts at
#: once where a helper thread is kept (see ``Arithmetic._in_halves``).
InHalves = Callable[..., list[Any]]


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array`` without a copy (received buffers may be read-only; they are
    only ever read)."""
    if array.flags.writeable:  # the common case, without the cost of catching warnings
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class Means:
    """Weighted means of payloads of ``size`` values, into one buffer (:attr:`buffer`,
    also the holder's scratch for a clipped gradient)."""

    def __init__(self, size: int, in_halves: InHalves) -> None:
        self.buffer = torch.empty(size, dtype=torch.float32)
        # The sums of the last average's parts, for the finiteness check that follows it.
        self._sums: tuple[torch.Tensor, list[float]] | None = None
        self._in_halves = in_halves
        self._lock = threading.Lock()  # the mean begun early: taken from two threads
        # A round's mean begun before the round closed (see .early), and its thread.
        self._early: EarlyMean | None = None
        self._early_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.early_means = 0  # averages found written by a mean begun early

    def written_finite(self, values: torch.Tensor) -> bool:
        """Whether ``values`` is the average just written and the sums of its parts are
        finite, so every value is (once: the sums go with the asking)."""
        sums, self._sums = self._sums, None
        return sums is not None and sums[0] is values and all(map(math.isfinite, sums[1]))

    def close(self) -> None:
        self.drop_early()
        if self._early_thread is not None:
            self._early_thread.shutdown(wait=False)

    def average(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
                overflow_safe: bool = False) -> torch.Tensor | None:
        """The ``weights``-weighted mean of ``payloads`` (a scratch buffer, valid until the
        next call). ``overflow_safe``: as a weighted sum, which stays finite for finite
        payloads; the running mean takes differences, which overflow near the float32
        limit."""
        self._sums = None
        with self._lock:
            early, self._early = self._early, None
        if early is not None and not overflow_safe and len(payloads) > 1:
            part = self._part(payloads, weights, overflow_safe=False)
            # What the early mean left is written at full speed (in halves).
            sums = early.finish(payloads, weights,
                                lambda start, stop: self._in_halves(stop, part, start))
            if sums is not None:
                self.early_means += 1
                self._sums = (self.buffer, sums)
                return self.buffer
        if early is not None:
            early.stop()
        if not payloads:
            return None
        if len(payloads) == 1:
            return as_tensor(payloads[0])
        weighted_sum = self._part(payloads, weights, overflow_safe)
        self._sums = (self.buffer, self._in_halves(len(self.buffer), weighted_sum))
        return self.buffer

    def begin(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
              landings: Sequence[Landing | None]) -> None:
        """Begin :meth:`average` of ``payloads`` with ``weights`` on a low-priority thread,
        slice by slice as each is in every payload still arriving (``landings``: None for
        one already whole); the next :meth:`average` of them takes it over (see
        :mod:`.early`). Call from the event loop, while nothing else averages."""
        self.drop_early()
        early = EarlyMean(payloads, weights, landings,
                          self._part(payloads, weights, overflow_safe=False))
        if self._early_thread is None:
            self._early_thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="dasktrain-holder-early", initializer=lower_priority)
        with self._lock:
            self._early = early
        self._early_thread.submit(early.run)

    def drop_early(self) -> None:
        """Stop a mean begun early that no update took."""
        with self._lock:
            early, self._early = self._early, None
        if early is not None:
            early.stop()

    def _part(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
              overflow_safe: bool) -> Callable[[slice], float]:
        """What writes one part of the weighted mean of ``payloads`` into the average's
        buffer and returns its sum (the same values whatever the parts)."""
        total = float(sum(weights))
        out = self.buffer
        tensors = [as_tensor(p) for p in payloads]
        if overflow_safe or total <= 0:
            total = total or 1.0

            def weighted_sum(part: slice) -> float:
                torch.mul(tensors[0][part], weights[0] / total, out=out[part])
                for tensor, weight in zip(tensors[1:], weights[1:], strict=True):
                    out[part].add_(tensor[part], alpha=weight / total)
                return float(out[part].sum())
        else:
            # A running weighted mean, one pass per further payload: after each step ``out``
            # is the mean of the payloads so far (lerp: out + w * (g - out)).
            def weighted_sum(part: slice) -> float:
                seen = weights[0] + weights[1]
                torch.lerp(tensors[0][part], tensors[1][part],
                           weights[1] / seen if seen else 0.5, out=out[part])
                for tensor, weight in zip(tensors[2:], weights[2:], strict=True):
                    seen += weight
                    if weight:
                        out[part].lerp_(tensor[part], weight / seen)
                return float(out[part].sum())
        return weighted_sum
