"""The feeder: the thread that submits an epoch's units as prefetch frees up, queues them for
the consumer in order, and then starts on the next epoch.

Who owns what, and when:

* The feeder alone submits, and alone holds the window reads it shares between units and
  the head start it builds (:mod:`dasktrain.pipeline.ahead`).
* Each unit it submits passes to the consumer through a queue, in order; ``None`` ends the
  epoch, an exception in its place says why it ended early.
* The consumer never touches the feeder's state. It says, through two events, that it reads
  no more (``stop``) or that it consumed the whole epoch (``finishing``: the head start may
  use the prefetch that is free, and no more), then waits a little for the feeder to end.
* When it ends, the feeder settles one future, and whichever side moves it first owns what
  is left (the head start and what is still queued): if the consumer still waits, the
  feeder hands the head start over and the consumer drains the queue; if the consumer gave
  up waiting (it cancelled the future), the feeder releases both itself. So nothing is
  released while the other thread may still add to it.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import queue
import threading
from collections.abc import Callable, Sequence

from dasktrain.pipeline.ahead import HeadStart, submit_ahead
from dasktrain.pipeline.budget import PrefetchBudget, unit_rows
from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.fetch import Tensors
from dasktrain.pipeline.plan import EpochPlan, Unit
from dasktrain.pipeline.stats import PipelineStats
from dasktrain.pipeline.submit import Submitted, Submitter, forget_windows, release
from dasktrain.pipeline.tasks import EpochContext

__all__ = ["Feeder", "Queued"]

logger = logging.getLogger(__name__)

#: A unit on its way to the consumer: its work, and its batches coming in as tensors.
Queued = tuple[Submitted, concurrent.futures.Future[Sequence[Tensors]]]

_END_WAIT = 5.0  # seconds the consumer waits for the feeder to end (a few submissions)


class Feeder:
    """Submits ``units`` of ``plan`` on its own thread and queues them for the consumer.

    Parameters
    ----------
    plan, units
        The epoch and this consumer's units of it, from where the iteration starts.
    carried
        A head start of this epoch whose units are ``units``' first: they are queued as they
        are and keep their share of ``budget`` (it was made without it). It is the feeder's.
    submitter, budget, stats
        How to submit, the prefetch bound, and the counters of units in flight.
    plan_for
        Plans another epoch, for a head start into the next one; None: no head start.
    claim
        Work claimed on demand instead of ``units``: called (on the feeder's thread, with
        the event that says the consumer stopped) for the next unit once ``budget`` has a
        slot free (each unit takes 1), None when the epoch has no more for this consumer.
    """

    def __init__(self, plan: EpochPlan, units: list[Unit], carried: HeadStart | None,
                 submitter: Submitter, budget: PrefetchBudget, stats: PipelineStats, *,
                 plan_for: Callable[[int], EpochPlan] | None,
                 claim: Callable[[threading.Event], Unit | None] | None = None) -> None:
        self._plan = plan
        self._units = units
        self._claim = claim
        self.handed: list[Unit] = []
        """The units queued so far, in order (the consumer reads the one it is given)."""
        self._carried = carried
        self._submitter = submitter
        self._budget = budget
        self._stats = stats
        self._plan_for = plan_for
        self._queue: queue.Queue[Queued | BaseException | None] = queue.Queue()
        self._stop = threading.Event()  # the consumer reads no more
        self._finishing = threading.Event()  # the consumer used up the whole epoch
        self._done: concurrent.futures.Future[HeadStart | None] = concurrent.futures.Future()
        # Run in the creator's context: the tasks it submits carry the creator's Dask
        # annotations (a fit's span, a user's own), as tasks submitted in place would.
        self._thread = threading.Thread(target=contextvars.copy_context().run,
                                        args=(self._run,), name="dasktrain-feeder",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def running(self) -> bool:
        """Whether the feeder's thread still runs (one that ended late releases its own
        work: see :meth:`finish`)."""
        return self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        """Stop the feeder and wait up to ``timeout`` seconds for its thread to end."""
        self._stop.set()
        self._thread.join(timeout)

    # -- the consumer's side ------------------------------------------------------------
    def has_next(self) -> bool:
        """Whether a unit (or the end of the epoch) is queued for the consumer."""
        return not self._queue.empty()

    def next_unit(self, timeout: float) -> Queued | None:
        """The next unit in order, or None once the epoch is all handed over."""
        try:
            if self._claim is not None:
                # A claim may wait long for work (others hold the rest of the epoch); each
                # of its calls has its own deadline, so the thread's life is the check.
                item = self._get_while_alive()
            else:
                # Submission is quick, so the feeder answers well within the timeout; the
                # fetch itself waits with a deadline and a liveness check.
                item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise PipelineError(f"the pipeline's feeder gave nothing for {timeout:.0f}s in "
                                f"epoch {self._plan.epoch}") from None
        if isinstance(item, BaseException):
            raise PipelineError(f"submitting work for epoch {self._plan.epoch} failed: "
                                f"{item}") from item
        return item

    def _get_while_alive(self) -> Queued | BaseException | None:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise PipelineError(f"the pipeline's feeder of epoch {self._plan.epoch} "
                                        "ended without a word") from None

    def finish(self, completed: bool) -> HeadStart | None:
        """End the iteration: the head start into the next epoch, if the feeder made one
        and ended in time; what it still held is released either way."""
        # A consumed epoch lets the feeder use the prefetch it freed for the next epoch
        # (a few quick submissions); an interrupted one stops it at once.
        (self._finishing if completed else self._stop).set()
        try:
            head = self._done.result(timeout=_END_WAIT)
        except TimeoutError:
            self._stop.set()
            if self._done.cancel():
                logger.debug("the feeder of epoch %d is late; it releases its own work",
                             self._plan.epoch)
                return None
            head = self._done.result()  # it was just ending: it hands over now
        self._stop.set()
        self._take_back()
        return head

    # -- the feeder's thread ------------------------------------------------------------
    def _run(self) -> None:
        head: HeadStart | None = None
        fetcher = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dasktrain-fetch")
        try:
            if self._feed(fetcher) and self._plan_for is not None:
                submitter = self._submitter
                head = submit_ahead(
                    self._plan_for, self._plan.epoch + 1, submitter, self._budget,
                    self._stop, self._finishing, self._stats,
                    # Brought in now, by this epoch's fetch threads (they finish their work
                    # after shutdown): the next epoch's first batch is then here.
                    lambda future, plan, unit: submitter.fetched(future, plan, unit, fetcher))
        finally:
            fetcher.shutdown(wait=False, cancel_futures=self._stop.is_set())
            if self._done.set_running_or_notify_cancel():
                self._done.set_result(head)
            else:  # the consumer stopped waiting: what is left is this thread's to release
                self._take_back()
                if head is not None:
                    self._stats.add_in_flight(-head.release())

    def _feed(self, fetcher: concurrent.futures.ThreadPoolExecutor) -> bool:
        """Submit units as prefetch frees up and queue them with their fetch. True once
        every unit is queued; False if the consumer stopped or submitting failed.

        All data work (task submission, transfer, conversion) happens off the consumer's
        thread; the consumer only takes ready batches.
        """
        plan, submitter = self._plan, self._submitter
        carried = list(self._carried.submitted) if self._carried is not None else []
        coming = list(self._carried.fetched) if self._carried is not None else []
        windows = self._carried.windows if self._carried is not None else {}
        queued = 0
        context: EpochContext | None = None  # made once a unit needs submitting
        try:
            if self._claim is not None:
                return self._feed_claimed(fetcher, submitter.context(plan))
            for i, unit in enumerate(self._units):
                fetched = None
                if i < len(carried):
                    future = carried[i][1]
                    fetched = coming[i] if i < len(coming) else None
                else:
                    if not self._budget.take(unit_rows(plan, unit), self._stop):
                        return False
                    # Not before: the head start's units go to the consumer first.
                    context = context or submitter.context(plan)
                    future = submitter.submit(context, plan, unit, windows)
                    self._stats.add_in_flight(1)
                forget_windows(windows, unit.window)
                self.handed.append(unit)
                self._queue.put((future, fetched or submitter.fetched(future, plan, unit,
                                                                      fetcher)))
                queued = i + 1
            return True
        except BaseException as exc:  # handed to the consumer, which raises it
            self._queue.put(exc)
            return False
        finally:
            self._queue.put(None)
            for fetched in coming[queued:]:
                fetched.cancel()
            for _, future in carried[queued:]:  # never handed to the consumer
                release(future)
                self._stats.add_in_flight(-1)

    def _feed_claimed(self, fetcher: concurrent.futures.ThreadPoolExecutor,
                      context: EpochContext) -> bool:
        """:meth:`_feed` for work claimed on demand: claim a unit only when a prefetch slot
        is free, so that a slow consumer holds few units nobody else can take."""
        assert self._claim is not None
        plan, submitter = self._plan, self._submitter
        windows: dict = {}
        while self._budget.take(1, self._stop):
            try:
                unit = self._claim(self._stop)
            except BaseException:
                self._budget.release(1)
                raise
            if unit is None:
                self._budget.release(1)
                return not self._stop.is_set()
            future = submitter.submit(context, plan, unit, windows)
            # Claims come mostly in order: a window behind this one is let go (one given
            # back later is read again, which costs a read, never a batch).
            forget_windows(windows, unit.window)
            self._stats.add_in_flight(1)
            self.handed.append(unit)
            self._queue.put((future, submitter.fetched(future, plan, unit, fetcher)))
        return False

    # -- either side, whichever owns the end -------------------------------------------
    def _take_back(self) -> None:
        """Release the units still queued: nobody will use them."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                future, fetched = item
                release(future)
                fetched.cancel()
                self._stats.add_in_flight(-1)
