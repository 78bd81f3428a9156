"""The head start into the next epoch: its first units, submitted with the prefetch the
current epoch frees once it is all submitted, and brought into the consumer's process as
they are done, so that the next epoch's first batch is here when it begins.

A head start has one owner at a time. The feeder builds it alone, unseen while it grows,
and hands it over once, when it will add nothing more (see
:class:`~dasktrain.pipeline.feeder.Feeder`); from then on only the pipeline touches it: it
keeps it for the next iteration, or releases it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import distributed
from distributed import Future

from dasktrain.pipeline.budget import PrefetchBudget, unit_rows
from dasktrain.pipeline.fetch import Tensors
from dasktrain.pipeline.plan import EpochPlan, Unit
from dasktrain.pipeline.stats import PipelineStats
from dasktrain.pipeline.submit import Submitted, Submitter, forget_windows, release

__all__ = ["HeadStart", "start_now", "submit_ahead"]

logger = logging.getLogger(__name__)


#: A unit's batches coming in as tensors (see Submitter.fetched).
Fetched = concurrent.futures.Future[Sequence[Tensors]]


@dataclasses.dataclass
class HeadStart:
    """Units of the next epoch submitted while the current one finished."""

    epoch: int
    rank: int
    world_size: int
    submitted: list[tuple[Unit, Submitted]] = dataclasses.field(default_factory=list)
    fetched: list[Fetched] = dataclasses.field(default_factory=list)
    """Each submitted unit's batches coming into this process, where they are fetched."""
    # Window reads shared by the units (a Dask future, or the consumer's WindowCell).
    windows: dict[int, Any] = dataclasses.field(default_factory=dict)
    rows: int = 0
    """Of the prefetch budget, held by the submitted units."""

    def continues(self, epoch: int, rank: int, world_size: int, units: list[Unit]) -> bool:
        """Whether an iteration over ``units`` of ``epoch`` can start with these units."""
        return ((self.epoch, self.rank, self.world_size) == (epoch, rank, world_size)
                and units[:len(self.submitted)] == [unit for unit, _ in self.submitted])

    def release(self, drain: float = 0.0) -> int:
        """Let go of everything submitted; returns the number of units that were held.

        With ``drain``, first let what was submitted finish, for up to that many seconds
        (a head start is a few units): its tasks and the fetches receiving their results.
        A released unit's tasks that already run on a worker run on, and a fetch may be
        receiving one; a pipeline that closes waits for them, so that the cluster, which
        may close next, cuts off no task and no transfer.
        """
        units = len(self.submitted)
        if drain:
            _drain([future for _, future in self.submitted], self.fetched, drain)
        for fetched in self.fetched:
            fetched.cancel()
        for _, future in self.submitted:
            release(future)
        for future in self.windows.values():
            future.release()
        self.submitted.clear()
        self.fetched.clear()
        self.windows.clear()
        return units


def _drain(submitted: list[Submitted], fetched: list[Fetched], seconds: float) -> None:
    """Wait up to ``seconds`` in all for units' tasks (Dask's or this process's) to finish,
    then for the fetches already receiving them (those not started are cancelled)."""
    deadline = time.monotonic() + seconds
    remote = [f for f in submitted if isinstance(f, Future)]
    with contextlib.suppress(Exception):  # timed out, or a cluster gone: nothing to wait for
        distributed.wait(remote, timeout=seconds)
    local = [f for f in submitted if not isinstance(f, Future)]
    running = [f for f in fetched if not f.cancel()]
    concurrent.futures.wait([*local, *running], timeout=max(deadline - time.monotonic(), 0))


def submit_ahead(plan_for: Callable[[int], EpochPlan], epoch: int, submitter: Submitter,
                 budget: PrefetchBudget, stop: threading.Event, finishing: threading.Event,
                 stats: PipelineStats,
                 fetch: Callable[[Submitted, EpochPlan, Unit], Fetched] | None = None
                 ) -> HeadStart:
    """Runs on the feeder: submit ``epoch``'s first units while the consumer finishes the
    current one, each as soon as prefetch is free, until the consumer stops, or is done and
    none is left (``finishing``); ``fetch`` starts bringing each in. Returns what was
    submitted, perhaps nothing."""
    head = HeadStart(epoch, submitter.rank, submitter.world_size)
    try:
        plan = plan_for(epoch)
        context = submitter.context(plan)
        for unit in plan.units(submitter.rank, submitter.world_size):
            rows = unit_rows(plan, unit)
            if not budget.take(rows, stop, finishing):
                break
            future = submitter.submit(context, plan, unit, head.windows)
            forget_windows(head.windows, unit.window)
            head.submitted.append((unit, future))
            if fetch is not None:
                head.fetched.append(fetch(future, plan, unit))
            head.rows += rows
            stats.add_in_flight(1)
    except Exception:  # only a head start: the next epoch submits the rest itself
        logger.debug("submitting epoch %d ahead failed", epoch, exc_info=True)
    return head


def start_now(plan_for: Callable[[int], EpochPlan], epoch: int, submitter: Submitter,
              rows: int, stats: PipelineStats) -> HeadStart:
    """A head start into ``epoch`` before anything iterates it (see
    :meth:`~dasktrain.pipeline.loader.Pipeline.start`): its first units within ``rows`` of
    prefetch, submitted now, and brought in by fetch threads of their own."""
    finishing = threading.Event()
    finishing.set()  # submit what the prefetch holds now, without waiting for more
    fetcher = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dasktrain-fetch")
    try:
        return submit_ahead(
            plan_for, epoch, submitter, PrefetchBudget(rows), threading.Event(), finishing,
            stats, lambda future, plan, unit: submitter.fetched(future, plan, unit, fetcher))
    finally:
        fetcher.shutdown(wait=False)  # its threads finish the fetches first
