"""One ``fit`` on a cluster: place the holder, run the worker tasks, watch them.

The driver (the process that called ``fit``) never touches gradients. It starts the holder
actor, submits one worker task per trainer worker for the whole fit, elastic or not, and
while they run it polls the holder for progress (a small message every half second), which
also serves as the liveness check: a dead holder fails the fit at once with the checkpoint
to resume from; a dead trainer worker is the holder's business (its roster drops it) and
Dask's (the task is run again and joins with a new incarnation). How many trainer workers
run, and where, is :mod:`.elastic`'s decision; in an elastic run the driver starts a task
on each Dask worker the cluster gains and, where work is claimed on demand, drops and
cancels the one whose Dask worker left (its claims go back at once).

The holder ends each epoch and begins the next one queued
(:mod:`dasktrain.trainer.holder.epochs`): the driver learns of the end from the holder,
with a snapshot of the boundary for its validation, callbacks and checkpoint, while the
workers train on. It queues the next epoch when the epoch starts, or only after the
epoch-end callbacks that may steer the run (stop it, change the learning rate) returned.
Which checkpoints the run writes, and when (the boundaries, and the marks every
``checkpoint_every`` updates, never backwards), is :mod:`.run_checkpoints`' decision.

:class:`FitRun` stays one piece of some 430 lines: its methods are the steps of one run
that all read and move the same state (the holder's handle and liveness, the fit's tasks,
the epoch it runs), and the failure paths between them (a lost holder, a failed worker)
need all of it at once. What the run records (the History, its log, the progress bar)
lives in :mod:`.run_records`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from distributed import Client, Future, wait
from distributed.client import FutureCancelledError

from dasktrain._cluster import declares_gpu, worker_info
from dasktrain._deadline import wait_until
from dasktrain._durable import StorageOptions
from dasktrain.pipeline import Pipeline
from dasktrain.trainer.driver.elastic import WorkerPlaces, replica_hosts
from dasktrain.trainer.driver.loadable import check_loadable
from dasktrain.trainer.driver.run_checkpoints import RunCheckpoints, StateNotHandedOver
from dasktrain.trainer.driver.run_records import RunRecords
from dasktrain.trainer.driver.watch import trainer_watch
from dasktrain.trainer.errors import (
    HolderLost,
    ShardedWorkerLost,
    TrainerError,
    TrainingDiverged,
)
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.exchange.sharded import HolderShards
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.holder.shards import shard_workers
from dasktrain.trainer.view.history import History
from dasktrain.trainer.worker.loop import WorkerConfig, WorkerFailure, run_worker
from dasktrain.trainer.worker.retire import RetireWatch

__all__ = ["FitRun"]

logger = logging.getLogger(__name__)

_POLL = 0.5  # seconds between progress polls of the holder
_GATHER = 10.0  # seconds to fetch a finished task's report, in elastic runs
_FRESH = 0.25  # seconds a liveness check of the holder stands for the next call


class FitRun:
    """The cluster side of one :meth:`Trainer.fit`."""

    def __init__(self, client: Client, holder_config: HolderConfig,
                 worker_config: WorkerConfig, *, holder_worker: str | None, timeout: float,
                 checkpoint: str | None, checkpoint_every: int | None,
                 checkpoint_extra: Callable[[], dict[str, Any]], history: History,
                 progress: Any,
                 on_records: Callable[[dict[str, list]], Any] | None = None,
                 shards: int = 1, storage_options: StorageOptions | None = None,
                 min_workers: int | None = None) -> None:
        self.client = client
        self.worker_config = worker_config
        self.timeout = timeout
        self.records = RunRecords(history, checkpoint, storage_options, progress, on_records)
        self.checkpoints = RunCheckpoints(checkpoint, checkpoint_every, checkpoint_extra,
                                          storage_options, self.records)
        self._pauses = trainer_watch(client)
        self._plans: Pipeline | None = None
        self.shares: dict[int, int] = {}  # batches of the epoch taken per worker (dynamic)
        self.member_addresses: dict[int, str] = {}  # where each worker joined from
        self.member_states: dict[int, str] = {}  # each worker's, as the holder sees it
        self.work_left: int | None = None  # batches of the epoch not done (dynamic)
        self.epoch = 0  # the epoch the driver runs (its boundary not yet saved)
        self.holder_epoch = 0  # the holder's (it may be in the next already)
        self.epoch_state = "idle"  # the holder's epoch machine's, or "short" of workers
        self.applied_samples: int | None = None  # what the holder applied in the epoch
        self.applied_loss: float | None = None  # their mean loss
        workers = worker_info(client)
        if not workers:
            raise TrainerError("the Dask cluster has no workers")
        self.addresses = sorted(workers)
        self._places = WorkerPlaces(client, min_workers or worker_config.workers,
                                    worker_config.workers, sorted(replica_hosts(workers)),
                                    timeout)
        if self._places.elastic:  # a retired worker's trainer then leaves before it goes
            client.register_plugin(RetireWatch())
        else:  # an elastic run has one trainer worker per Dask worker
            _warn_if_oversubscribed(worker_config, replica_hosts(workers))
        self._gpu = any(map(declares_gpu, workers.values()))
        if holder_worker is not None and holder_worker not in workers:
            raise ValueError(f"holder_worker {holder_worker!r} is not a worker of this "
                             f"cluster; workers: {self.addresses}")
        check_loadable(client, {"the model, its optimizer and mode": holder_config,
                                "the loss, metrics, step, transform and data": worker_config},
                       workers)
        if shards == 1:
            targets = [holder_worker or self._places.holder_place(workers)]
            configs = [holder_config]
        else:  # spread over the hosts (see dasktrain.trainer.holder.shards)
            targets = shard_workers(self.addresses, shards, holder_worker)
            configs = [dataclasses.replace(holder_config, shard=(k, shards))
                       for k in range(shards)]
        self._holder_futures: list[Future] = [
            client.submit(ParameterHolder, config, actor=True, workers=[target],
                          allow_other_workers=False, pure=False)
            for config, target in zip(configs, targets, strict=True)]
        try:
            actors = [self._await_holder(future, target, timeout)
                      for future, target in zip(self._holder_futures, targets, strict=True)]
        except BaseException:
            for future in self._holder_futures:
                future.cancel()
            raise
        self.holder_address = ", ".join(targets)
        # What the worker tasks get: the actor, or the list of shards.
        self.holder: Any = actors[0] if shards == 1 else actors
        self._handle: HolderHandle | HolderShards = (
            HolderHandle(actors[0], timeout, client) if shards == 1 else
            HolderShards(actors, timeout, client))
        self._alive_at = float("-inf")  # when the holder was last seen alive
        self._fit_tasks: dict[Future, int] = {}  # tasks that last the fit, and their worker
        self._started = False  # the fit's tasks were started
        self.steered = False  # callbacks hold each next epoch: the holder's state is taken then

    @property
    def version(self) -> int:
        """The holder's version as last seen (what the run's log files events under)."""
        return self.records.version

    @version.setter
    def version(self, version: int) -> None:
        self.records.version = version

    def _await_holder(self, future: Future, target: str, timeout: float) -> Any:
        """The holder actor once it is built, failing within seconds if its worker is
        paused (it would never start)."""
        try:
            return wait_until(
                lambda left: future.result(timeout=left), timeout=timeout,
                check=lambda: self._pauses.check(None, "starting the parameter holder"),
                expired=lambda: TrainerError(f"the parameter holder did not start on "
                                             f"{target} within {timeout:.0f}s"))
        except TrainerError:
            raise
        except Exception as exc:
            raise TrainerError(f"could not start the parameter holder on {target}: "
                               f"{type(exc).__name__}: {exc}") from exc

    # -- holder calls from the driver --------------------------------------------------
    def call(self, method: str, *args: Any) -> Any:
        """Call the holder and wait, failing fast if its worker is gone."""
        # A liveness check is a question to the scheduler: the calls at an epoch's boundary
        # follow each other within milliseconds, and the wait for the answer checks again.
        if time.monotonic() - self._alive_at > _FRESH and not self.holder_alive():
            self._holder_lost()
        try:
            return self._handle.request(method, *args)
        except HolderLost:
            self._holder_lost()

    def holder_alive(self) -> bool:
        alive = self._handle.holder_alive()
        if alive:
            self._alive_at = time.monotonic()
        return alive

    def _holder_lost(self) -> None:
        try:  # a state the holder handed over just before it died is still worth keeping
            self._take_checkpoint(ask_next=False)
        except Exception:
            logger.debug("no checkpoint from the lost holder", exc_info=True)
        where = self._resume_hint()
        who = (self._handle.describe_lost() if isinstance(self._handle, HolderShards) else
               f"the parameter holder's worker {self.holder_address}")
        raise HolderLost(f"{who} died at version {self.version}; {where}")

    def _resume_hint(self) -> str:
        return (f"resume with fit(..., resume={str(self.last_checkpoint)!r})"
                if self.last_checkpoint else
                "no checkpoint was written yet (pass checkpoint= to fit to have one)")

    # -- epochs ------------------------------------------------------------------------
    def run_epoch(self, epoch: int, fresh: bool, last: int, queue_next: bool = True
                  ) -> list[dict[str, Any]]:
        """Run ``epoch`` (of a fit whose last epoch is ``last``) until the holder finds it
        complete; returns the workers' reports. The first call starts the fit's tasks;
        ``queue_next``: let the next epoch begin as soon as this one is complete (else
        :meth:`queue` it)."""
        self.epoch = epoch
        try:
            if not self._fit_tasks and not self._started:
                self._start_fit(epoch, fresh, last)
            if queue_next and epoch < last:
                self.queue(epoch + 1)
            short_since: float | None = None
            while True:
                end = self.call("epoch_end", epoch, _POLL)
                self._check_fit_tasks()
                if end is None and not self._fit_tasks:
                    # Each worker's task ended: if this epoch is not over by now, it never
                    # will be (a task leaves the epoch before it ends).
                    end = self.call("epoch_end", epoch, _GATHER)
                    if end is None:
                        raise TrainerError(f"every trainer worker's task ended before "
                                           f"epoch {epoch} did")
                if end is not None:
                    break
                self.poll()
                if self._places.elastic:
                    self._follow_cluster(last)
                    short_since = self._short_of_workers(epoch, short_since)
        except BaseException as exc:
            self._stop_workers(list(self._fit_tasks), exc)
            self._release_fit_tasks()
            raise
        self.poll()
        # Taken at the epoch's end: the holder may be in the next epoch already.
        self.shares = {int(w): int(n) for w, n in end["shares"].items()}
        self.applied_samples = end.get("samples")
        self.applied_loss = end.get("loss")
        return end["reports"]

    def _start_fit(self, epoch: int, fresh: bool, last: int) -> None:
        """Begin the fit's first epoch with the workers there are, and start their tasks."""
        self._started = True
        present, _ = self._places.start(epoch)
        self.call("begin_epoch", epoch, fresh, self._work(epoch), present, self._keep)
        self._fit_tasks = {self._start(w, epoch, last, address): w
                           for w, address in self._places.placed.items()}

    def _short_of_workers(self, epoch: int, since: float | None) -> float | None:
        """Fail once the next epoch has waited ``timeout`` seconds for the least workers of
        an elastic run; returns since when it waits (None: it does not)."""
        if self.epoch_state != "short":
            return None
        now = time.monotonic()
        since = now if since is None else since
        if now - since > self.timeout:
            places = self._places
            raise TrainerError(f"the cluster did not reach {places.least} Dask worker(s) for "
                               f"epoch {epoch} within {self.timeout:.0f}s (workers=("
                               f"{places.least}, {places.most}))")
        return since

    @property
    def _keep(self) -> str:
        """What the holder keeps of each epoch's end for the driver (see boundary)."""
        return "state" if self.checkpoints.path and not self.steered else "params"

    def queue(self, epoch: int) -> None:
        """Let ``epoch`` begin as soon as the one before is complete (now, if it is)."""
        self.call("queue_epoch", epoch, self._work(epoch), self._keep)

    def boundary(self, epoch: int) -> tuple[Any, dict[str, Any] | None]:
        """The parameters (then buffers) at the end of ``epoch``, and the holder's whole
        state then where the run checkpoints (None where callbacks steer: the state to
        keep is the holder's once they returned)."""
        state = self.call("boundary", epoch)
        self.records.boundary_version = int(state["version"])
        values = torch.cat([state["params"], state["buffers"]]).numpy()
        return values, (state if self._keep == "state" else None)

    def finish(self, stopped: bool = False) -> None:
        """The fit is over: workers waiting for another epoch end their tasks; ``stopped``
        early, workers that began the next epoch are stopped at once."""
        if not self._fit_tasks:
            return
        if stopped and not self.steered:  # the next epoch began: it is not kept
            self._stop_workers(list(self._fit_tasks), TrainerError("the fit was stopped"))
            self._release_fit_tasks()
            return
        try:
            self.call("end_fit", "the fit is over")
            if self._places.elastic:  # a task pinned to a Dask worker that left never ends
                self._let_gone_go(worker_info(self.client))
            try:
                done = wait(list(self._fit_tasks), timeout=_GATHER).done
            except TimeoutError:  # those still running are stopped below
                done = {f for f in self._fit_tasks if f.done()}
            busy = [f for f in self._fit_tasks if f not in done]
            if busy:
                self._stop_workers(busy, TrainerError("the fit was stopped"))
            for future in done:
                self._collect(future, self._fit_tasks[future])
            self.poll()  # what the holder recorded as the workers left, for the History
        finally:
            self._release_fit_tasks()

    def _check_fit_tasks(self) -> None:
        """A task that ended before the fit did: its failure ends the fit; one Dask gave
        up on is no longer waited for; one that stepped aside or retired is let go."""
        for future in [f for f in self._fit_tasks if f.done()]:
            worker = self._fit_tasks.pop(future)
            try:
                self._collect(future, worker, give_up="give_up")
            finally:
                future.release()

    def _release_fit_tasks(self) -> None:
        # A finished task whose result Dask keeps runs again if its worker dies.
        for future in self._fit_tasks:
            future.release()
        self._fit_tasks = {}

    def _start(self, worker: int, first: int, last: int, address: str) -> Future:
        """Submit ``worker``'s task for the fit (from epoch ``first`` to ``last``), placed
        on ``address`` if it can run there."""
        extra = {"resources": {"GPU": 1}} if self._gpu else {}
        # A run that grows keeps one replica per Dask worker: a task whose worker goes is
        # cancelled (see _follow_cluster), not run again beside another.
        return self.client.submit(
            run_worker, self.worker_config, self.holder, worker, first, last,
            pure=False, key=f"dasktrain-trainer-{worker}-fit-{time.time_ns()}",
            workers=[address], allow_other_workers=not self.grows, **extra)

    def _follow_cluster(self, last: int) -> None:
        """Start a task on each Dask worker the cluster gained (it joins the holder: claims
        work at once, or, where ranks own a stride, takes part from the next epoch on);
        where work is claimed, drop and cancel the tasks whose Dask worker left (their
        claims go back to the pool now, not once the holder's watchdog finds them gone)."""
        workers = self._handle.last_workers or worker_info(self.client)
        if self.grows:
            self._let_gone_go(workers)
        if self.work_left == 0 and self.holder_epoch >= last:
            return  # nothing left to hand out in the fit
        for w, address in self._places.gained(set(self._fit_tasks.values()),
                                              self.member_addresses, workers).items():
            self._fit_tasks[self._start(w, self.epoch, last, address)] = w

    def _let_gone_go(self, workers: dict[str, dict[str, Any]]) -> None:
        """Drop and cancel the tasks whose Dask worker left ``workers`` (pinned there, they
        would wait for it for ever)."""
        by_worker = {w: f for f, w in self._fit_tasks.items()}
        for w in self._places.gone(set(by_worker), workers):
            future = by_worker.pop(w)
            del self._fit_tasks[future]
            self.client.cancel(future)
            future.release()
            self.call("drop", w, f"its Dask worker {self._places.placed[w]} left the cluster")

    @property
    def grows(self) -> bool:
        """Workers the cluster adds mid-epoch take work at once, and those it loses hand
        theirs back at once (a range of workers, and work claimed on demand)."""
        return self._places.elastic and self.worker_config.assignment == "dynamic"

    def _work(self, epoch: int) -> tuple[int, list[int]] | None:
        """The epoch's batches and claim bounds, where workers claim work on demand."""
        config = self.worker_config
        if config.assignment != "dynamic":
            return None
        if self._plans is None:  # plans only: it never iterates, so it needs no cluster
            self._plans = Pipeline(config.data, config.batch_size, **config.pipeline_options)
        plan = self._plans.plan(epoch)
        return plan.num_batches, plan.claim_bounds()

    def _collect(self, future: Future, worker: int, give_up: str = "drop"
                 ) -> list[dict[str, Any]]:
        try:
            # Done: the report is there to fetch, unless the Dask worker holding it left
            # meanwhile (retired, or killed): Dask would then run the whole task again to
            # recompute it. The holder has its work on record: it is let go instead.
            report = future.result(timeout=_GATHER)
        except TimeoutError:
            self.client.cancel(future)
            self.records.add_events([f"worker {worker}: its task's answer was lost with its "
                                     "Dask worker"])
            return []
        except (FutureCancelledError, Exception) as exc:
            if type(exc).__name__ == "KilledWorker":
                # Its process died more often than Dask retries; the others carry on, and
                # the barrier must not wait for it any longer.
                self.records.add_events([f"worker {worker} given up: {exc}"])
                self.call(give_up, worker, "its task was given up (KilledWorker)")
                return []
            failure = WorkerFailure(exc, "")  # Dask's own (cancelled, lost): no traceback
        else:
            if report.get("surplus"):  # no place for it (see ParameterHolder.join)
                return []
            failure = report.get("failed")
            if failure is None:
                return [report]
        # Raised here, outside the handler: the worker's error is not chained below ours.
        raise self._failed(worker, failure)

    def _failed(self, worker: int, failure: WorkerFailure) -> BaseException:
        """The error that ends the fit when ``worker``'s task failed: the holder's reason
        if it has one (divergence, its death), the worker's own error if it is ours (it
        says what to do), else a :class:`TrainerError` carrying the worker's traceback."""
        error = failure.error
        if isinstance(error, HolderLost) or not self.holder_alive():
            self._holder_lost()
        self.poll()  # the holder's own reason (divergence) says more than the worker's
        if isinstance(error, TrainerError):
            return error
        wrapped = TrainerError(f"trainer worker {worker} failed: {type(error).__name__}: "
                               f"{error}")
        wrapped.__cause__ = error
        if failure.traceback:
            wrapped.add_note(f"in trainer worker {worker}:\n{failure.traceback.rstrip()}")
        return wrapped

    def _stop_workers(self, futures: list[Future], exc: BaseException) -> None:
        self._on_living("abort", f"the fit stopped: {type(exc).__name__}: {exc}")
        self.client.cancel(futures)

    def poll(self) -> None:
        """Fetch the holder's progress into the History; checkpoint when it is time."""
        progress = self.call("progress")
        self.records.take(progress)
        self.epoch_state = progress.get("epoch_state", "running")
        self.holder_epoch = int(progress["epoch"])
        self.shares = {int(w): int(n) for w, n in progress["shares"].items()}
        self.member_addresses = {int(w): a for w, a in progress["addresses"].items() if a}
        self.member_states = {int(w): s for w, s in progress["members"].items()}
        self.work_left = progress["work_left"]
        if progress["diverged"] is not None:
            raise TrainingDiverged(progress["diverged"])
        if isinstance(progress.get("error"), ShardedWorkerLost):
            raise ShardedWorkerLost(f"{progress['error']}: {self._resume_hint()}")
        # The liveness check before the progress call has just fetched the workers.
        self._pauses.check(self.version, f"training (epoch {progress['epoch']})",
                           self._handle.last_workers)
        self.records.show_progress(progress)
        self._take_checkpoint()
        self.records.hand_on(progress)

    def _take_checkpoint(self, ask_next: bool = True) -> None:
        """Write the state the holder handed over at the last ``checkpoint_every`` mark,
        and ask for the next one (``ask_next=False``: the holder is lost; see
        :meth:`RunCheckpoints.take`)."""
        ask = (lambda version: self._handle.call("state_at", version)) if ask_next else None
        try:
            self.checkpoints.take(self.epoch, self.version, ask)
        except StateNotHandedOver:
            if ask_next and not self.holder_alive():
                self._holder_lost()
            raise
        except HolderLost:  # lost at the boundary: what it handed over is written
            self._holder_lost()

    def save(self, complete_epochs: int | None,
             holder_state: dict[str, Any] | None = None) -> None:
        """Write the run's checkpoint (``complete_epochs=None``: mid-epoch) of the holder's
        current state, or of ``holder_state`` taken before."""
        if not self.checkpoints.path:
            return
        if holder_state is None:
            holder_state = self.call("state_dict")
        self.checkpoints.write(holder_state, complete_epochs)
        if complete_epochs is not None:
            self.epoch = complete_epochs  # a state of the next epoch may be written now
            self._take_checkpoint()

    @property
    def last_checkpoint(self) -> Path | None:
        """The checkpoint file last written in this fit."""
        return self.checkpoints.last

    def parameters(self) -> Any:
        params, version = self.call("pull")
        self.version = version
        return params

    def close(self) -> None:
        self.checkpoints.forget()
        if self._fit_tasks:  # the fit failed between two epochs: its workers train on
            self._stop_workers(list(self._fit_tasks), TrainerError("the fit failed"))
            self._release_fit_tasks()
        self._on_living("close")
        for future in self._holder_futures:
            future.release()

    def _on_living(self, method: str, *args: Any) -> None:
        """Best effort: ``method`` (abort, close) on the holder, or on every shard still
        alive when one died (the others must not keep their sockets and threads)."""
        try:
            if isinstance(self._handle, HolderShards):
                self.holder_alive()  # refreshes which shards live
                self._handle.call_living(method, *args)
            elif self.holder_alive():
                self._handle.call(method, *args).result(timeout=10)
        except Exception:  # the holder may be the thing that failed
            logger.debug("could not %s the holder", method, exc_info=True)


def _warn_if_oversubscribed(config: WorkerConfig, workers: dict[str, dict[str, Any]]) -> None:
    threads = sum(int(w.get("nthreads") or 1) for w in workers.values())
    if config.workers <= threads:
        return
    sharing = -(-config.workers // len(workers))
    warnings.warn(
        f"{config.workers} trainer workers on a cluster of {threads} worker thread(s) in "
        f"{len(workers)} process(es): up to {sharing} trainer tasks share one Dask worker "
        f"process, each with {config.torch_threads or 'all'} torch thread(s), and compete "
        f"for its cores. Use workers <= {threads}, or add Dask workers", stacklevel=5)
