"""The holder's numbers: the master buffer, the optimizer, averaging, and the serial section.

The master state is one flat float32 buffer, parameters then the model's buffers. Replies
hand workers that buffer itself, under a *lease*: a lease is taken before a send and
released after it, and an update that finds the current buffer leased first copies it to a
free one and writes there (copy on write). So a worker never receives a half-written
buffer, and in lock-step modes, where every lease is released before the next update can
start, no update copies anything.

Serial section: updates, leases, snapshots and restores run one at a time, in order. Models
over ``INLINE_SIZE`` values run them on one private thread (the event loop keeps serving
heartbeats and transfers meanwhile); smaller ones on the event loop itself, where the work
takes less than the hand-off to a thread would add.

The average of large payloads (:mod:`.mean`), its finiteness check and a plain SGD step
are computed in two halves at once, the second on a helper thread: in lock-step modes every
worker waits for the update, so a core that would idle takes half of those passes over
memory. The check is made on each half of the average as it is written, while it is still
in cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dasktrain.trainer.exchange.landing import Landing
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.mean import Means
from dasktrain.trainer.optim import OptimizerConfig
from dasktrain.trainer.optim.flat import FlatOptimizer
from dasktrain.trainer.worker.compute import clip_gradient

__all__ = ["INLINE_SIZE", "SPLIT_SIZE", "Arithmetic", "Lease", "all_finite"]

logger = logging.getLogger(__name__)

INLINE_SIZE = 1 << 20  # payload elements up to which the serial section runs on the loop
SPLIT_SIZE = 1 << 20  # payload elements from which averages are computed in two halves
_SPARE_BUFFERS = 4  # released copies kept for reuse (fresh allocations cost page faults)


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: one reduction instead of an elementwise mask; a sum
    that overflows is re-checked."""
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


@dataclasses.dataclass(eq=False, slots=True)
class Lease:
    """Parameters (then buffers) of ``version``, unchanged until :meth:`release`."""

    array: np.ndarray
    version: int
    _release: Callable[[], None] | None

    def release(self) -> None:
        """Give the buffer back (idempotent); the array must not be read afterwards."""
        if self._release is not None:
            release, self._release = self._release, None
            release()


class Arithmetic:
    """Master parameters and buffers, their optimizer, and the updates applied to them."""

    def __init__(self, layout: FlatLayout, initial: np.ndarray,
                 optimizer: OptimizerConfig, total_steps: int | None,
                 clip: tuple[float | None, float | None] = (None, None),
                 names: Sequence[str] | None = None) -> None:
        self.layout = layout
        self.clip = clip  # (global norm, value) the applied gradient is clipped to
        self.lr_factor = 1.0  # times the schedule (ReduceLROnPlateau)
        self.optimizer_config = optimizer
        self.total_steps = total_steps
        self._flat = torch.from_numpy(np.array(initial, dtype=np.float32))
        # ``names``: the whole model's parameters, when ``layout`` holds a shard's slice.
        self._optim = FlatOptimizer(optimizer, self._flat[: layout.num_params],
                                    layout.param_segments(), names)
        self._optimizer = self._optim.optimizer
        self.updates = 0  # optimizer steps taken (the schedule's step counter)
        self._lock = threading.Lock()  # lease counts: released from any thread
        self._leases: dict[int, int] = {}  # id of a leased buffer -> leases on it
        self._spare: list[torch.Tensor] = []
        # Where master states may live that the holder does not own (see adopt): never
        # taken for spares, whose copies would land in a worker's model.
        self._foreign: set[int] = set()
        # The reply regions of workers that share memory with the holder (see adopt), with
        # the incarnation whose connection offered each.
        self._regions: dict[int, tuple[int, np.ndarray]] = {}
        self.threaded = layout.size > INLINE_SIZE
        # Calls of serially not yet returned (counted on the event loop, the only caller).
        self._in_flight = 0
        self._moves: set[asyncio.Task] = set()  # master states leaving a region (pending)
        self._closed = False  # no update follows: the serial thread is shut down
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dasktrain-holder") if self.threaded else None
        self._helper = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dasktrain-holder-half") if layout.size >= SPLIT_SIZE \
            else None
        self.means = Means(layout.size, self._in_halves)  # a round's, into a scratch buffer

    # -- the serial section ------------------------------------------------------------
    async def serially(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in order with every other call of this method."""
        if self._executor is None:
            return fn(*args)
        self._in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn,
                                                                    *args)
        finally:
            self._in_flight -= 1

    async def promptly(self, fn: Callable[..., Any], *args: Any) -> Any:
        """:meth:`serially`, for something quick (a lease, a look at the version): on the
        event loop at once where nothing runs or waits on the serial thread, which saves
        two hand-offs between threads (each a wake-up; ~0.1-0.3 ms on a busy host)."""
        if not self._in_flight:
            return fn(*args)
        return await self.serially(fn, *args)

    def close(self) -> None:
        self._closed = True
        self.means.close()
        for pool in (self._executor, self._helper):
            if pool is not None:
                pool.shutdown(wait=False)

    def _in_halves(self, size: int, fn: Callable[[slice], Any], start: int = 0
                   ) -> list[Any]:
        """``fn`` of each part of ``[start, size)``: two halves at once where a helper
        thread is kept and the range is large, else the whole."""
        if self._helper is None or size - start < SPLIT_SIZE // 2:
            return [fn(slice(start, size))]
        half = (start + size) // 2
        later = self._helper.submit(fn, slice(half, size))
        try:
            first = fn(slice(start, half))
        finally:
            second = later.result()
        return [first, second]

    def all_finite(self, values: torch.Tensor) -> bool:
        """Whether every value is finite (:func:`all_finite`, in halves at once); for the
        average just returned by :meth:`average`, from the sums taken as it was written."""
        if self.means.written_finite(values):
            return True
        return all(self._in_halves(len(values), lambda part: all_finite(values[part])))

    # -- reading -----------------------------------------------------------------------
    @property
    def parameters(self) -> torch.Tensor:
        """The current parameters (a view: read it inside the serial section)."""
        return self._flat[: self.layout.num_params]

    @property
    def buffers(self) -> torch.Tensor:
        return self._flat[self.layout.num_params:]

    @property
    def flat(self) -> torch.Tensor:
        """Parameters then buffers (a view: read it inside the serial section)."""
        return self._flat

    def lease(self, version: int) -> Lease:
        """The current state under a lease (call inside the serial section)."""
        buffer = self._flat
        key = id(buffer)
        with self._lock:
            self._leases[key] = self._leases.get(key, 0) + 1

        def release() -> None:
            with self._lock:
                left = self._leases[key] - 1
                if left:
                    self._leases[key] = left
                else:
                    del self._leases[key]
                    if buffer is not self._flat and len(self._spare) < _SPARE_BUFFERS \
                            and buffer.data_ptr() not in self._foreign:
                        self._spare.append(buffer)

        return Lease(buffer.numpy(), version, release)

    def _writable(self) -> None:
        """Copy the master state to a free buffer first if a lease still reads it."""
        with self._lock:
            if id(self._flat) not in self._leases:
                return
        self._to_a_free_buffer()

    def _to_a_free_buffer(self) -> None:
        """Copy the master state to a buffer of the holder's own (a spare, else a new one)
        and keep it there (inside the serial section)."""
        with self._lock:  # a spare is never the master state (see lease's release)
            fresh = self._spare.pop() if self._spare else torch.empty_like(self._flat)
        fresh.copy_(self._flat)
        self._flat = fresh
        # The optimizer's state is keyed by the Parameter objects, not their storage.
        self._optim.repoint(fresh[: self.layout.num_params])

    def region_shared(self, worker: int, incarnation: int, region: np.ndarray,
                      attached: bool) -> None:
        """``worker``'s ``incarnation`` has its model in ``region``, memory shared with
        this process (``attached``), or no longer (its connection ended): see
        :meth:`adopt_for`. Call from the event loop."""
        with self._lock:
            if attached:
                held = self._regions.get(worker)
                if held is None or held[0] <= incarnation:  # an older one's comes late
                    self._regions[worker] = (incarnation, region)
                return
            held = self._regions.get(worker)
            if held is not None and held[1] is region:
                del self._regions[worker]
        # Its worker may live on and write into it (a reply that came by the actor, a
        # rejoin's parameters): the master state must not stay there.
        if self._executor is None:
            self._move_out_of(region)
        elif not self._closed:  # in order with the updates, counted as in flight (promptly)
            task = asyncio.get_running_loop().create_task(
                self.serially(self._move_out_of, region))
            self._moves.add(task)
            task.add_done_callback(self._moved)

    def _moved(self, task: asyncio.Task) -> None:
        self._moves.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the holder closed
            logger.debug("holder: moving the parameters out of a region failed",
                         exc_info=task.exception())

    async def forsake(self, worker: int) -> None:
        """``worker``'s incarnation is over (lost, left, superseded) although its process
        may live on: its region is adopted no more, and the master state leaves it, in
        order with the updates (await it before anything is sent to the worker's next
        incarnation: its join writes the parameters it is sent into its model)."""
        with self._lock:
            held = self._regions.pop(worker, None)
        if held is not None and not self._closed:
            await self.serially(self._move_out_of, held[1])

    def _move_out_of(self, region: np.ndarray) -> None:
        """Copy the master state to memory of the holder's own if it lies in ``region``
        (inside the serial section)."""
        if self._flat.data_ptr() == region.ctypes.data:
            self._to_a_free_buffer()

    def adopt_for(self, worker: int, incarnation: int) -> None:
        """Keep the master state in the region of ``worker``'s ``incarnation``, if it
        shares one (see :meth:`adopt`), while it waits for the reply to its push (so does
        not read it); call inside the serial section. Only that incarnation's own region:
        a superseded one's reply must not land in the model of its successor, which may be
        writing its parameters there."""
        with self._lock:
            regions = {w: region for w, (_, region) in self._regions.items()}
            held = self._regions.get(worker)
        if held is not None and held[0] == incarnation:
            del regions[worker]
            self.adopt(held[1], list(regions.values()))

    def adopt(self, into: np.ndarray, others: Sequence[np.ndarray] = ()) -> bool:
        """Keep the master state in ``into`` from now on (call inside the serial section,
        when its owner does not read it): the shared memory a worker's model lives in (see
        :mod:`dasktrain.trainer.exchange.shared`), so that its replies need no copy and
        updates land in its model in place. The state is copied there once; copy-on-write
        may move it out again, and a later call moves it back. Not where the master state
        is in another worker's memory (``others``; no moving back and forth), nor for a
        model with buffers, which its forward pass writes into that memory. Whether the
        master state is in ``into`` now."""
        current = self._flat
        if current.data_ptr() == into.ctypes.data:
            return True
        if self.layout.num_buffers or into.dtype != np.float32 \
                or into.shape != tuple(current.shape) or not into.flags.writeable \
                or any(current.data_ptr() == o.ctypes.data for o in others):
            return False
        target = torch.from_numpy(into)
        target.copy_(current)
        with self._lock:
            self._foreign.add(target.data_ptr())
            # The buffer left behind: a spare unless a lease still reads it (it becomes
            # one when that lease is given back) or it is a worker's.
            if id(current) not in self._leases and len(self._spare) < _SPARE_BUFFERS \
                    and current.data_ptr() not in self._foreign:
                self._spare.append(current)
            self._flat = target
        self._optim.repoint(target[: self.layout.num_params])
        return True

    # -- updates -----------------------------------------------------------------------
    def average(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
                overflow_safe: bool = False) -> torch.Tensor | None:
        """See :meth:`Means.average`."""
        return self.means.average(payloads, weights, overflow_safe)

    def begin_mean(self, payloads: Sequence[np.ndarray], weights: Sequence[float],
                   landings: Sequence[Landing | None]) -> None:
        """See :meth:`Means.begin`."""
        self.means.begin(payloads, weights, landings)

    @property
    def early_means(self) -> int:
        """Averages found written by a mean begun early."""
        return self.means.early_means

    def lr(self, scale: float = 1.0) -> float:
        """The learning rate of the next step, times ``scale``."""
        return self.optimizer_config.lr_at(self.updates, self.total_steps) * scale \
            * self.lr_factor

    def step(self, payload: torch.Tensor, lr_scale: float = 1.0,
             first_moment: float | None = None) -> None:
        """One optimizer step on the gradient part of ``payload``; its buffer part becomes
        the model's buffers (batch-norm statistics are averaged like gradients).

        ``lr_scale`` multiplies the learning rate of this step only: unlike scaling the
        gradient, it scales the step under every optimizer (Adam normalises a gradient's
        size away). ``first_moment`` replaces the optimizer's momentum (Adam's first beta)
        for this step (None: the configured one; see :meth:`FlatOptimizer.set_first_moment`)."""
        self._writable()
        n = self.layout.num_params
        grad = payload[:n]
        if self.clip != (None, None):
            # Into the scratch buffer: the payload may be a received buffer or a mode's.
            scratch = self.means.buffer[:n]
            if scratch.data_ptr() != grad.data_ptr():
                scratch.copy_(grad)
            grad = clip_gradient(scratch, *self.clip)
        self._optim.step(grad, self.lr(lr_scale), first_moment,
                         self._in_halves if self._helper is not None else None)
        self.updates += 1
        if self.layout.num_buffers:
            self._flat[n:].copy_(payload[n:])

    def set_state(self, values: torch.Tensor) -> None:
        """Set parameters then buffers outright (parameter averaging); no optimizer step."""
        self._writable()
        with torch.no_grad():
            self._flat.copy_(values[: self.layout.size])

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"params": self.parameters.clone(),
                "buffers": self.buffers.clone(),
                "optimizer": copy.deepcopy(self._optimizer.state_dict()),
                "updates": self.updates, "lr_factor": self.lr_factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._writable()
        with torch.no_grad():
            self._flat[: self.layout.num_params].copy_(state["params"])
            self.buffers.copy_(state["buffers"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
        self.lr_factor = float(state.get("lr_factor", 1.0))
