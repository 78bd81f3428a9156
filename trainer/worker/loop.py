"""The trainer worker: one model replica running as a long-lived Dask task.

A worker task secedes from its worker's thread pool (so the pipeline's tasks can use that
thread), builds the model, joins the holder (which hands it the parameters and its place
in the epoch) and trains (:mod:`.epoch`: batch, forward/backward, the mode's step, the
parameters the holder sends back).

One task trains every epoch of a fit (``last``): at an epoch's end it hands the holder
its report and asks for the next epoch, keeping its model, connection, shared memory and
pipeline (with its head start into the next epoch); the holder begins that epoch as soon
as the last worker finished this one (:mod:`dasktrain.trainer.holder.turns`). An elastic
run, whose workers change in number at epoch starts, runs one task per epoch instead.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time
import traceback
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from distributed import get_worker, secede

from dasktrain._malloc import tune_allocator
from dasktrain.pipeline import Pipeline
from dasktrain.trainer.exchange.sharded import open_handle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.worker import kept
from dasktrain.trainer.worker.config import LossFunction, WorkerConfig
from dasktrain.trainer.worker.epoch import (
    PLACE,
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
from dasktrain.trainer.worker.retire import training

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


def run_worker(config: WorkerConfig, holder: Any, worker: int, epoch: int,
               world: int | None = None, last: int | None = None) -> dict[str, Any]:
    """Train ``worker``'s share of ``epoch`` (of ``world`` workers' strides, by default
    ``config.workers``, where work is not claimed); returns its counters, or
    ``{"worker": worker, "failed": WorkerFailure}`` if it could not, or
    ``{"worker": worker, "surplus": True}`` if the holder had no place for it.

    With ``last``, train the holder's current epoch and every one after it up to
    ``last`` in this task (a task Dask runs again after its worker died starts where the
    holder is); the reports go to the holder, and it returns ``{"worker": worker,
    "epochs": n}``.

    A failure is returned, not raised: Dask logs every task that raises on its worker
    ("Compute Failed" and the task's traceback, on the user's terminal for a local
    cluster), while the one error to read is the driver's, which raises it
    (:meth:`FitRun._collect`).
    """
    try:
        return _run_worker(config, holder, worker, epoch, world or config.workers, last)
    except Exception as exc:
        return {"worker": worker, "failed": WorkerFailure.of(exc)}


def _run_worker(config: WorkerConfig, holder: Any, worker: int, epoch: int, world: int,
                last: int | None) -> dict[str, Any]:
    secede()  # free the thread for pipeline tasks; this task is not stolen once running
    tune_allocator()
    started = time.perf_counter()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    device = pick_device(config.device)
    PLACE.place = (worker, None)
    # A fit's task starts reading its first batches before it builds the model and joins.
    pipe = _reading_ahead(config, worker, epoch, world, device) if last is not None else None
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
    try:
        with training(), profiler_paused(dask_worker if config.pause_dask_profiler
                                         else None):
            # a closing worker waits for training to leave (see .retire)
            replica = Replica(config, handle, flat, device, worker, address)
            if last is None:
                return _train(replica, epoch, world, started, kept.fit_key(holder))
            kept.take(kept.fit_key(holder), -1, -1)  # closes what other fits left
            replica.pipe, pipe = pipe, None
            return _train_fit(replica, last, started)
    finally:
        if pipe is not None:  # failed before the fit took it
            pipe.close()
        PLACE.place = None
        taken_warnings(stop=True)
        handle.close()


def _reading_ahead(config: WorkerConfig, worker: int, epoch: int, world: int,
                   device: torch.device) -> Pipeline | None:
    """The worker's pipeline, already reading the first batches of ``epoch`` (see
    :meth:`Pipeline.start`) while the task builds its model and joins the holder: the
    first epoch's first batch was the one a fit's workers waited for (~10-20 ms). Its
    epoch, rank or cut may still turn out others (a resumed fit, an elastic one, a
    balanced cut): the head start is then dropped. None where work is claimed."""
    if config.assignment == "dynamic":
        return None
    pipe = worker_pipeline(config, min(worker, world - 1), world, device)
    pipe.set_epoch(epoch)
    pipe.start()
    return pipe


def _train(replica: Replica, epoch: int, world: int, started: float, fit: Hashable
           ) -> dict[str, Any]:
    """One epoch's task: join, train ``epoch``, leave."""
    config, worker = replica.config, replica.worker
    info = _join(replica, epoch, epoch)
    if info.get("surplus"):
        return {"worker": worker, "epoch": epoch, "surplus": True}
    claimed = config.assignment == "dynamic"
    rank = min(worker, world - 1)
    # A static rank's pipeline lives on in this process between the fit's epoch tasks
    # (see .kept), with a head start into the next epoch unless this is the last one.
    following = not claimed and epoch + 1 < len(config.epoch_steps)
    replica.pipe = None if claimed else kept.take(fit, rank, world)
    report = train_epoch(replica, info, epoch, world, started, following)
    _leave(replica, report)
    if following and not report["retired"]:
        kept.keep(fit, rank, world, replica.pipe)
    return report


def _train_fit(replica: Replica, last: int, started: float) -> dict[str, Any]:
    """Every epoch from the holder's current one to ``last``, in this task."""
    info: dict[str, Any] | None = _join(replica, None, None)
    assert info is not None  # (typed for the epochs after, whose answer may not be in yet)
    if info.get("surplus"):
        if replica.pipe is not None:
            replica.pipe.close()
        return {"worker": replica.worker, "surplus": True}
    epoch, world = int(info["epoch"]), int(info["world"])
    asked: Future | None = None
    epochs = 0
    try:
        while True:
            report = train_epoch(replica, info, epoch, world, started, epoch < last, asked)
            if report is None:  # the fit ended before this epoch began
                break
            epochs += 1
            if report["retired"] or epoch >= last:
                _leave(replica, report)
                break
            started = time.perf_counter()
            # Leaving and asking for the next epoch are one call: it answers once the
            # holder began the next epoch, as soon as the last worker left this one.
            ask = functools.partial(replica.handle.next_epoch, replica.worker, epoch,
                                    replica.address, report)
            if computes_ahead(replica):
                replica.asker = replica.asker or ThreadPoolExecutor(1, "dasktrain-next")
                asked, info, epoch = replica.asker.submit(ask), None, epoch + 1
                continue
            info = ask()
            if info is None:  # the fit is over (stopped after this epoch)
                break
            epoch, world = int(info["epoch"]), int(info["world"])
    finally:
        if replica.pipe is not None:
            replica.pipe.close()
        if replica.asker is not None:
            replica.asker.shutdown(wait=False)
    return {"worker": replica.worker, "epochs": epochs}


def _leave(replica: Replica, report: dict[str, Any]) -> None:
    worker = replica.worker
    replica.handle.request("leave", worker, report["retired"], report,
                           what=f"worker {worker} to leave")


def _join(replica: Replica, epoch: int | None, task_epoch: int | None) -> dict[str, Any]:
    """Join the holder (as a task of ``task_epoch``, or of the whole fit: None); the
    worker's step is made for ``epoch`` (None: the first the holder names)."""
    flat = replica.flat
    replica.strategy = strategy = step_for(replica.config, flat, epoch or 0)
    info = replica.handle.join(replica.worker, replica.address, flat.layout,
                               into=strategy.receive_buffer(), epoch=task_epoch)
    if not info.get("surplus"):
        replica.handle.share(strategy.adopt)  # on the holder's host: pushes copy nothing
        # In the holder's process: the model reads the holder's parameters themselves.
        if strategy.view_replies() and not replica.handle.lend_replies():
            strategy.views = False
    return info
