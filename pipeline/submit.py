"""Sending a unit's work where it runs: named, prioritised Dask tasks on the cluster (a window
shared by several units is read once), or read threads of the consuming process."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from distributed import Client, Future, get_worker

from dasktrain._cluster import declares_gpu
from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.fetch import Tensors, WindowCell, compute_here, fetch_unit
from dasktrain.pipeline.finish import Finish
from dasktrain.pipeline.plan import EpochPlan, Unit
from dasktrain.pipeline.tasks import (
    ArraysRef,
    EpochContext,
    Transform,
    assemble_batches,
    claim_read,
    drop_claim,
    load_unit,
    load_window,
    read_ahead,
)

__all__ = ["CONSUMER_THREADS", "PLACEMENTS", "LocalReaders", "Submitted", "Submitter",
           "forget_windows", "inside_task", "placement_kwargs", "release"]

PLACEMENTS = ("auto", "anywhere", "local", "consumer")
#: Threads that read blocks where the consumer reads them itself (placement "consumer").
CONSUMER_THREADS = 2
#: An epoch's first groups read one at a time where the consumer reads (see LocalReaders).
IN_TURN = 3
#: Seconds a read ahead waits for the one before it (it runs, and always ends: a bound
#: only against a read that hangs).
READ_WAIT = 300.0
#: A unit's work: a Dask future on the cluster, a thread's future in this process.
Submitted = Future | concurrent.futures.Future


class LocalReaders:
    """The read threads of placement "consumer": :data:`CONSUMER_THREADS` that make each
    unit's batches, and as many that read the units' groups ahead, in the order the units
    come. A group serves several units; a unit's thread that waits for another thread's read
    of its group is idle, and where the units' threads did all the reading, the units next
    in line were the same group's, so one group was read at a time. Read ahead, the next
    groups are read meanwhile (one core each), and a unit's thread cuts its batches out."""

    def __init__(self) -> None:
        self.units = concurrent.futures.ThreadPoolExecutor(
            CONSUMER_THREADS, thread_name_prefix="dasktrain-read")
        self.groups = concurrent.futures.ThreadPoolExecutor(
            CONSUMER_THREADS, thread_name_prefix="dasktrain-read-ahead")
        # Per epoch, its first groups and when each read is over.
        self._turns: collections.OrderedDict[str, dict[int, threading.Event]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()  # the feeders of two epochs may submit at once

    def read_ahead(self, context: EpochContext, group: int) -> None:
        """Read ``group`` ahead of its units, which wait for this read from now on. An
        epoch's first :data:`IN_TURN` groups are read one after the other, each on both
        cores (zarr decodes a read's chunks in threads of its own): the first batch waits
        for the first, and the consumer is through the first groups before two reads at
        once, each on a core, finish."""
        claim = claim_read(context, group)
        if claim is None:
            return
        with self._lock:
            turns = self._turns.setdefault(context.digest, {})
            while len(self._turns) > 8:  # a few epochs (this one, the next's head start)
                self._turns.popitem(last=False)
            after = turns[next(reversed(turns))] if turns else None
            done = threading.Event() if len(turns) < IN_TURN else None
            if done is not None:
                turns[group] = done
        try:
            future = self.groups.submit(_read_in_turn, context, group, claim, after, done)
        except RuntimeError:
            # Shut down meanwhile (the pipeline closed under its feeder): nobody reads the
            # group now. The claim goes, or the windows of another pipeline of this
            # process that need the group (a replica beside it, on the same data) would
            # wait for a read that never comes.
            _drop(context, group, claim, done)
            raise
        future.add_done_callback(functools.partial(_if_cancelled, context, group, claim,
                                                   done))

    def shutdown(self, wait: bool) -> None:
        for pool in (self.groups, self.units):
            pool.shutdown(wait=wait, cancel_futures=True)


def _read_in_turn(context: EpochContext, group: int, claim: threading.Event,
                  after: threading.Event | None, done: threading.Event | None) -> None:
    """:func:`read_ahead` once ``after`` is set (the read before it is over)."""
    try:
        if after is not None:
            after.wait(READ_WAIT)
        read_ahead(context, group, claim)
    finally:
        if done is not None:
            done.set()


def _if_cancelled(context: EpochContext, group: int, claim: threading.Event,
                  done: threading.Event | None, future: concurrent.futures.Future) -> None:
    """A read cancelled before it ran (the pipeline closed): its units, and the reads in
    turn after it, go on."""
    if future.cancelled():
        _drop(context, group, claim, done)


def _drop(context: EpochContext, group: int, claim: threading.Event,
          done: threading.Event | None) -> None:
    """A claimed read that will not run: its units, and the reads in turn after it, go
    on."""
    drop_claim(context, group, claim)
    if done is not None:
        done.set()


def release(future: Submitted) -> None:
    """Let go of a unit's result: a Dask future is released, a local one cancelled."""
    if isinstance(future, Future):
        future.release()
    else:
        future.cancel()


def inside_task() -> bool:
    """Whether this thread runs a Dask task (a worker's): there nothing closes the cluster."""
    try:
        get_worker()
    except ValueError:
        return False
    return True


def placement_kwargs(placement: str, client: Client | None) -> dict[str, Any]:
    """The workers a unit's tasks may run on. Call it on the consumer's thread: inside a Dask
    task the worker (and its client) are only visible from the task's own thread."""
    if placement == "consumer":
        return {}
    if placement == "local":
        try:
            return {"workers": [get_worker().address], "allow_other_workers": False}
        except ValueError:
            raise PipelineError("placement='local' needs the consumer to run on a Dask "
                                "worker (e.g. inside a trainer task)") from None
    assert client is not None, "placement 'anywhere' submits through a client"
    # Any worker, but named: the scheduler never holds restricted tasks in its queue of
    # root-ish tasks. Unrestricted, a burst of blocks is partly queued there and partly sent
    # to workers at once (Dask decides per task, by the size and dependencies of its group),
    # and the ones sent ahead run before earlier blocks still queued, so the next batch
    # waits. Sent at once, each worker runs its blocks in priority order; the pipeline
    # bounds what is in flight itself (``prefetch``).
    workers = client.scheduler_info(n_workers=-1)["workers"]
    # Workers that declare a GPU run the model replicas: a block task there would share the
    # replica's process, and so its interpreter lock, with the loop that feeds the GPU.
    # Blocks go to the CPU-only workers where there are any.
    cpu_only = [a for a, w in workers.items() if not declares_gpu(w)]
    named = sorted(cpu_only or workers)
    return {"workers": named, "allow_other_workers": True} if named else {}


@dataclasses.dataclass(frozen=True, slots=True)
class Submitter:
    """What the feeder needs to submit units, fixed on the consumer's thread before the
    feeder starts and only read afterwards (by the feeder, and by fetch threads)."""

    placement: str
    """``"anywhere"``, ``"local"`` or ``"consumer"`` (``"auto"`` is resolved before)."""
    token: str
    """Names the pipeline's tasks (the same on every rank)."""
    rank: int
    world_size: int
    ref: ArraysRef
    transform: Transform | None
    device: torch.device
    timeout: float
    """Seconds to wait for one unit."""
    client: Client | None = None
    """The cluster's client; None for ``placement="consumer"``."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """From :func:`placement_kwargs`."""
    local: LocalReaders | None = None
    """The read threads of ``placement="consumer"``."""
    finish: Finish | None = None
    """The transform's part left to this process, run where the batches arrive (on the CPU;
    :class:`~dasktrain.pipeline.fetch.Delivery` runs it after the copy to an accelerator)."""

    @property
    def readers(self) -> int:
        """Processes that read the units (the read threads, where the consumer reads)."""
        if self.placement == "consumer":
            return CONSUMER_THREADS
        return max(1, len(self.kwargs.get("workers", ())))

    def context(self, plan: EpochPlan) -> EpochContext:
        if self.placement == "consumer":
            return EpochContext.here(f"{self.token}-{plan.epoch}", self.ref, plan,
                                     self.transform)
        return EpochContext.pack(self.ref, plan, self.transform)

    def submit(self, context: EpochContext, plan: EpochPlan, unit: Unit,
               windows: dict[int, Any]) -> Submitted:
        """Start a unit's work. ``windows`` holds the window reads already submitted for
        this epoch (a shared window is read by one task, or where the consumer reads, one
        :class:`WindowCell`); it grows here."""
        if self.placement == "consumer":
            assert self.local is not None, "placement 'consumer' reads in local threads"
            cells = None
            if not unit.exclusive:
                cells = []
                for w in unit.windows:
                    cell = windows.get(w)
                    if not (isinstance(cell, WindowCell) and cell.serves(context)):
                        cell = windows[w] = WindowCell(context, w)
                    cells.append(cell)
            for group in dict.fromkeys(plan.window_spans[w].group for w in unit.windows):
                self.local.read_ahead(context, group)
            delivered: concurrent.futures.Future[Sequence[Tensors]] = \
                concurrent.futures.Future()
            task = self.local.units.submit(compute_here, context, unit, self.device,
                                           self.finish, cells, self.timeout, delivered)
            # Cancelled before it ran (the pipeline closed): so are its batches.
            task.add_done_callback(lambda task: task.cancelled() and delivered.cancel())
            return delivered
        client = self.client
        assert client is not None, "a Dask placement submits through a client"
        epoch = plan.epoch
        # Named by the batches too: units claimed on demand cut one window into several.
        shares = "" if plan.shares is None else "x".join(map(str, plan.shares))
        key = (f"dasktrain-batches-{self.token}-{epoch}-{self.rank}of{self.world_size}"
               f"{shares}-{unit.window}-{unit.batches[0]}-{unit.batches[-1]}")
        # Submissions in a burst (or from inside a task) share one scheduler generation,
        # which would leave their order to chance: ask for consumption order explicitly.
        kwargs = {"priority": -(epoch * (plan.num_batches + 1) + unit.batches[0]),
                  **self.kwargs}
        if unit.exclusive:
            return client.submit(load_unit, context, unit.window, unit.pieces, key=key,
                                 **kwargs)
        # The window is shared (with other ranks, or with a neighbouring unit): one task
        # reads it, one per unit cuts the batches.
        for w in unit.windows:
            if w not in windows:
                # In the units' task group: one group for all of a pipeline's reads.
                windows[w] = client.submit(
                    load_window, context, w,
                    key=f"dasktrain-batches-{self.token}-{epoch}-window-{w}", **kwargs)
        return client.submit(assemble_batches, unit.pieces, unit.windows,
                             *[windows[w] for w in unit.windows], key=key, **kwargs)

    def fetched(self, future: Submitted, plan: EpochPlan, unit: Unit,
                fetcher: concurrent.futures.ThreadPoolExecutor
                ) -> concurrent.futures.Future[Sequence[Tensors]]:
        """The unit's batches as tensors in this process: read here, the unit's own future;
        from the cluster, a fetch thread brings them in (see :func:`fetch_unit`)."""
        if self.placement == "consumer":
            return future
        delivered: concurrent.futures.Future[Sequence[Tensors]] = concurrent.futures.Future()
        fetcher.submit(fetch_unit, self.client, future, plan, unit, self.timeout,
                       self.device, self.finish, delivered)
        return delivered


def forget_windows(windows: dict[int, Any], current: int) -> None:
    """Keep a window's future only while a later unit may still need it; the scheduler keeps
    it for the submitted batch tasks that depend on it."""
    for w in [w for w in windows if w < current]:
        del windows[w]
