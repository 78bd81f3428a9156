"""The trainer worker: one model replica running as a long-lived Dask task.

A worker task secedes from its worker's thread pool (so the pipeline's tasks can use that
thread), builds the model, joins the holder (which hands it the parameters and its place
in the epoch) and trains (:mod:`.epoch`: batch, forward/backward, the mode's step, the
parameters the holder sends back).

One task trains every epoch of a fit (to ``last``), elastic or not: at an epoch's end it
hands the holder its report and asks for the next epoch, keeping its model, connection,
shared memory and pipeline (with its head start into the next epoch); the holder begins
that epoch as soon as the last worker finished this one (:mod:`dasktrain.trainer.holder.epochs`),
with the rank and world it says. A worker the holder dropped while it was alive (it went
silent) learns so from its next call (:class:`~dasktrain.trainer.errors.Fenced`) and joins
again with a new incarnation, as a task Dask runs again would; one whose place another
task of it took stops. A task that fails leaves the holder with its error first, so that
what it claimed goes back to the pool and the History says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pickle
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from distributed import get_worker, secede
from distributed.metrics import context_meter

from dasktrain._malloc import tune_allocator
from dasktrain.pipeline import Pipeline
from dasktrain.trainer.errors import Fenced
from dasktrain.trainer.exchange.sharded import open_handle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.worker.config import LossFunction, WorkerConfig
from dasktrain.trainer.worker.epoch import (
    PLACE,
    AheadOfTheHolder,
    Replica,
    computes_ahead,
    step_for,
    train_epoch,
    trainer_place,
    worker_pipeline,
)
from dasktrain.trainer.worker.notices import (
    capture_warnings,
    taken_warnings,
    watch_this_thread,
)
from dasktrain.trainer.worker.profiler import profiler_paused
from dasktrain.trainer.worker.retire import retiring, training

__all__ = ["LossFunction", "WorkerConfig", "WorkerFailure", "pick_device", "run_worker",
           "trainer_place"]


def pick_device(requested: str | None) -> torch.device:
    """``requested``, else CUDA when this process sees a GPU, else CPU."""
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerFailure:
    """Why a trainer worker's task stopped: what it raised, and where (the worker's
    traceback, as text)."""

    error: BaseException
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> WorkerFailure:
        where = "".join(traceback.format_exception(error))
        try:
            pickle.dumps(error)
        except Exception:  # it must travel to the driver: its type and message do
            error = RuntimeError(f"{type(error).__name__}: {error}")
        return cls(error, where)


def run_worker(config: WorkerConfig, holder: Any, worker: int, first: int,
               last: int) -> dict[str, Any]:
    """Train ``worker`` in every epoch the holder begins, from its current one to
    ``last`` (``first``: the epoch the fit starts with, whose first batches the task reads
    while it builds its model and joins); returns ``{"worker": worker, "epochs": n}``, or
    ``{"worker": worker, "failed": WorkerFailure}`` if it could not, or ``{"worker":
    worker, "surplus": reason}`` if the holder had no place for it. The reports go to the
    holder.

    A failure is returned, not raised: Dask logs every task that raises on its worker
    ("Compute Failed" and the task's traceback, on the user's terminal for a local
    cluster), while the one error to read is the driver's, which raises it
    (:meth:`FitRun._collect`).
    """
    try:
        # Dask meters a task's every exchange (serializing, compressing) into a list kept
        # until the task ends: for a task that runs the whole fit, a list that grows by
        # each message to the holder (5.7 KB an epoch of the W14 soak). Its time is still
        # metered as the task's.
        with context_meter.clear_callbacks():
            return _run_worker(config, holder, worker, first, last)
    except Exception as exc:
        return {"worker": worker, "failed": WorkerFailure.of(exc)}


def _run_worker(config: WorkerConfig, holder: Any, worker: int, first: int, last: int
                ) -> dict[str, Any]:
    secede()  # free the thread for pipeline tasks; this task is not stolen once running
    tune_allocator()
    started = time.perf_counter()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    device = pick_device(config.device)
    PLACE.place = (worker, None)
    # The task starts reading its first batches before it builds the model and joins.
    pipe = _reading_ahead(config, worker, first, device)
    try:
        flat = FlatModel(config.model(), device)
        handle = open_handle(holder, config.timeout)  # one actor, or a list of shards
    except BaseException:
        PLACE.place = None
        if pipe is not None:
            pipe.close()
        raise
    try:
        dask_worker = get_worker()
        address = dask_worker.address
    except ValueError:
        dask_worker = address = None
    capture_warnings()
    watch_this_thread()
    replica = None
    try:
        with training(), profiler_paused(dask_worker if config.pause_dask_profiler
                                         else None):
            # a closing worker waits for training to leave (see .retire)
            replica = Replica(config, handle, flat, device, worker, address)
            replica.pipe, pipe = pipe, None
            return _train_fit(replica, last, started)
    except Exception as exc:
        if replica is not None:
            _leave_failed(replica, exc)
        raise
    finally:
        if pipe is not None:  # failed before the fit took it
            pipe.close()
        PLACE.place = None
        taken_warnings(stop=True)
        handle.close()


def _reading_ahead(config: WorkerConfig, worker: int, epoch: int, device: torch.device
                   ) -> Pipeline | None:
    """The worker's pipeline, already reading the first batches of ``epoch`` (see
    :meth:`Pipeline.start`) while the task builds its model and joins the holder: the
    first epoch's first batch was the one a fit's workers waited for (~10-20 ms). Its
    epoch, rank or cut may still turn out others (a resumed fit, an elastic one, a
    balanced cut): the head start is then dropped. None where work is claimed."""
    if config.assignment == "dynamic" or worker >= config.workers:
        return None
    pipe = worker_pipeline(config, worker, config.workers, device)
    pipe.set_epoch(epoch)
    pipe.start()
    return pipe


def _train_fit(replica: Replica, last: int, started: float) -> dict[str, Any]:
    """Every epoch from the holder's current one to ``last``, in this task."""
    info: dict[str, Any] | None = _join(replica)
    if info.get("surplus"):
        return {"worker": replica.worker, "surplus": "another replica trains there"}
    asked: Future | None = None
    epoch = -1
    epochs = 0
    try:
        while True:
            if info is not None and "wait" in info:  # a part from the next epoch on
                info = replica.handle.next_epoch(int(info["wait"]))
                if info is None:
                    break
            if info is not None:
                epoch = int(info["epoch"])
            try:
                report = train_epoch(replica, info, epoch, started, epoch < last, asked)
            except AheadOfTheHolder as ahead:  # computed ahead on what turned out stale
                info, asked = ahead.answer, None
                continue
            except Fenced as fenced:
                if fenced.reason != "lost":  # another task of this worker took its place
                    return {"worker": replica.worker, "surplus": str(fenced)}
                info, asked = _join(replica), None  # dropped while alive: join again
                if info.get("surplus"):
                    return {"worker": replica.worker, "surplus": "its place was taken"}
                continue
            asked = None
            if report is None:  # the fit ended before this epoch began
                break
            epochs += 1
            if report["retired"] or epoch >= last or retiring():
                _leave(replica, report, retired=report["retired"] or retiring())
                break
            started = time.perf_counter()
            # Leaving and asking for the next epoch are one call: it answers once the
            # holder began the next epoch, as soon as the last worker left this one.
            ask = functools.partial(replica.handle.next_epoch, epoch, report)
            if computes_ahead(replica):
                replica.asker = replica.asker or ThreadPoolExecutor(1, "dasktrain-next")
                asked, info, epoch = replica.asker.submit(ask), None, epoch + 1
                continue
            info = ask()
            if info is None:  # the fit is over (stopped after this epoch)
                break
    finally:
        if replica.pipe is not None:
            replica.pipe.close()
        if replica.asker is not None:
            replica.asker.shutdown(wait=False)
    return {"worker": replica.worker, "epochs": epochs}


def _leave(replica: Replica, report: dict[str, Any], retired: bool) -> None:
    worker = replica.worker
    replica.handle.member_request("leave", retired, report, None,
                                  what=f"worker {worker} to leave")


def _leave_failed(replica: Replica, error: BaseException) -> None:
    """Leave the holder with ``error`` (best effort: the holder may be what failed), so
    that what this worker claimed goes back to the pool and the History says why."""
    with contextlib.suppress(Exception):
        if replica.handle.incarnation:
            replica.handle.member_request(
                "leave", False, None, f"{type(error).__name__}: {error}",
                what=f"worker {replica.worker} to leave")


def _join(replica: Replica) -> dict[str, Any]:
    """Join the holder (again, after a drop: a new incarnation); the worker's step is
    made for the epoch the holder names."""
    flat = replica.flat
    replica.strategy = strategy = step_for(replica.config, flat, 0)
    info = replica.handle.join(replica.worker, replica.address, flat.layout,
                               into=strategy.receive_buffer())
    if not info.get("surplus"):
        replica.handle.share(strategy.adopt)  # on the holder's host: pushes copy nothing
        # In the holder's process: the model reads the holder's parameters themselves.
        if strategy.view_replies() and not replica.handle.lend_replies():
            strategy.views = False
    return info
