"""The driver's side of one generation: hand its members out, a few per Dask task, and
collect their fitness.

All of a generation's tasks are submitted at once and Dask's scheduler hands them to
workers as their threads come free, so a slow worker takes fewer of them, and a task whose
worker dies is run again elsewhere (a worker that dies on the same members three times in
a row fails the run with Dask's ``KilledWorker``).

What travels (:mod:`dasktrain.evolve.wire`): the generation's update record, placed once on
each worker the tasks may use (:mod:`.shared`) and a Dask dependency of every task; a task
adds the index of its members; a result is their fitness as float32, the worker's id and,
once per worker and generation, the checksum of its copy of the state. The record carries
the ranks of the generations since the oldest one a worker of the pool is known to hold
(from the results it sent, at most :data:`MAX_LAG` back): usually just the last one.

A worker with no copy it can bring forward (new, restarted, or too far behind) answers
"miss" at once; the driver then places a snapshot of the state at the generation on that
worker and sends the members again (tasks submitted after that take the snapshot too). The
run's first generation places its snapshot on every worker it may use. A snapshot is offered
while a worker may need it (one the tasks may go to has not answered since, and the
snapshot is not older than the oldest generation the record carries ranks from: a worker
that evaluated nothing in the first generation takes it up in the second) and then
released.

With ``workers=k`` the tasks are restricted to k chosen workers (strictly: Dask's work
stealing would otherwise hand them to idle others), the same ones while they live; if all
of them are gone mid-generation, its waiting tasks go to others. If the workers holding the
record (or a snapshot) all die, the tasks that needed it are lost with it: it is placed
again on the live workers and those tasks are submitted again.

A copy whose checksum differs from the driver's (other numerics on another machine) stops
the run with a clear error instead of ranking members of different parents; the members of
a worker whose checksum never came (it died first) are evaluated again by one that sends it.

Bytes: a task's arguments as pickled (its chunk's index), results as sent (raw bytes), the
record and snapshots once per copy a worker held (at the size they travel). Dask's own
envelope of each task (its key, the function's name, the keys of its dependencies, message
headers) is not counted: it does not grow with the model or the population.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

import numpy as np
from distributed import Client, Future, wait
from distributed.client import FutureCancelledError, FuturesCancelledError
from distributed.protocol import pickle
from distributed.scheduler import KilledWorker

from dasktrain._cluster import worker_info
from dasktrain._deadline import wait_until
from dasktrain.evolve.driver.generation import GenerationReport, Round, Task
from dasktrain.evolve.driver.pool import MAX_LAG, WorkerPool, lost_contact
from dasktrain.evolve.driver.shared import Shared, SharedObjects
from dasktrain.evolve.errors import EvolutionError, FitnessFailed
from dasktrain.evolve.shaping import encode_ranks
from dasktrain.evolve.spec import RunSpec, Snapshot
from dasktrain.evolve.wire import MISS, chunk_members, decode_result, encode_record
from dasktrain.evolve.worker.tasks import evaluate_members, forget_run

__all__ = ["MAX_LAG", "Coordinator", "GenerationReport"]

#: Seconds between looks at the cluster while a generation's tasks run.
_POLL = 1.0
_CANCELLED = (FutureCancelledError, FuturesCancelledError)


class Coordinator:
    """Runs generations of ``spec``'s run on ``client``'s cluster.

    Parameters
    ----------
    client
        The cluster's client.
    spec, spec_blob
        The run, and its pickled form that snapshots carry.
    workers
        Use at most this many Dask workers (the same ones while they live); None: all.
    members_per_task
        Members evaluated by one task.
    timeout
        Seconds to wait for any task of a generation to finish before failing.
    """

    def __init__(self, client: Client, spec: RunSpec, spec_blob: bytes, *,
                 workers: int | None, members_per_task: int, timeout: float) -> None:
        self.client = client
        self.spec = spec
        self.spec_blob = spec_blob
        self.members_per_task = members_per_task
        self.chunks = chunk_members(spec.population, members_per_task)
        self.timeout = timeout
        self.ranks: dict[int, bytes] = {}
        """Each recent generation's ranks, packed."""
        self.pool = WorkerPool(client, workers, timeout)
        self.events: list[str] = []
        self._shared = SharedObjects(client)
        self._snapshot: Shared | None = None
        self._pending_snapshot_bytes = 0
        self._names = itertools.count()

    # -- what the tasks share ------------------------------------------------------------
    def begin(self, generation: int, state: Any) -> None:
        """Place a snapshot of ``state`` at ``generation`` on every worker the run may
        use."""
        self._place_snapshot(generation, state, self.pool.choose(self.pool.live()))

    def _key(self, kind: str, generation: int) -> str:
        return f"dasktrain-evolve-{kind}-{self.spec.run_key}-{generation}-{next(self._names)}"

    def _place_snapshot(self, generation: int, state: Any, workers: list[str]) -> None:
        snapshot = Snapshot(self.spec_blob, generation, state.copy())
        self._shared.release(self._snapshot)
        try:
            self._snapshot, cost = self._shared.place(
                self._key("snapshot", generation), snapshot, len(pickle.dumps(snapshot)),
                generation, workers)
        except Exception as exc:
            raise lost_contact(exc) from exc
        self._pending_snapshot_bytes += cost

    def _place_record(self, round_: Round, workers: list[str]) -> None:
        generation, base = round_.generation, round_.base
        record = encode_record(self.spec.run_key, generation, base, self.members_per_task,
                               [self.ranks[g] for g in range(base, generation)])
        self._shared.release(round_.record)
        try:
            round_.record, cost = self._shared.place(self._key("record", generation), record,
                                                     len(record), generation, workers)
        except Exception as exc:
            raise lost_contact(exc) from exc
        round_.report.record_bytes += cost

    def _offered(self, round_: Round) -> Shared | None:
        """The snapshot tasks of the round take: one that can serve its generation."""
        found = self._snapshot
        if found is not None and round_.base <= found.generation <= round_.generation \
                and not self._shared.lost(found):
            return found
        return None

    # -- a generation ------------------------------------------------------------------
    def record(self, generation: int, ranks: np.ndarray) -> None:
        """Keep generation's ranks for the records of the next ones."""
        self.ranks[generation] = encode_ranks(ranks)
        self.ranks.pop(generation - MAX_LAG - 1, None)

    def run(self, generation: int, state: Any, digest: int) -> GenerationReport:
        """Evaluate every member of ``generation`` (the driver's state is ``state``, whose
        checksum is ``digest``); the fitness comes back in member order."""
        started = time.perf_counter()
        report = GenerationReport(np.full(self.spec.population, np.nan))
        report.snapshot_bytes, self._pending_snapshot_bytes = self._pending_snapshot_bytes, 0
        live = self.pool.live()
        for worker in self.pool.forget_gone(live):
            self.events.append(f"generation {generation}: worker {worker} left")
        workers = self.pool.choose(live)
        round_ = Round(generation, self.pool.base(generation, live), state, digest, report)
        if self._snapshot is not None and (self._offered(round_) is None
                                           or self.pool.all_known(workers)):
            self._shared.release(self._snapshot)  # no worker needs it any more
            self._snapshot = None
        self._place_record(round_, workers)
        for chunk in range(len(self.chunks)):
            self._submit(round_, Task(chunk))
        retries_allowed = 3 * len(self.chunks) + 2 * len(live)
        try:
            while round_.pending:
                done = self._wait(round_)
                for future in done:
                    if future.status == "error":
                        task = round_.pending.pop(future)
                        raise self._failure(future, generation, task.chunk)
                finished = [f for f in done if f.status == "finished"]
                results = self._gather(finished)
                if results is not None:
                    for future, result in zip(finished, results, strict=True):
                        self._answer(round_, round_.pending.pop(future), result)
                if any(f.status == "cancelled" for f in round_.pending):
                    self._recover(round_)  # cancelled: was a shared object lost?
                if not round_.pending:
                    self._check_everyone(round_)
                if round_.retries > retries_allowed:
                    raise EvolutionError(
                        f"workers could not take up the run's state for generation "
                        f"{generation} after {round_.retries} tries")
            self._count_copies(round_)
        finally:
            self._cancel(round_.pending)
            self._shared.release(round_.record)
        report.seconds = time.perf_counter() - started
        return report

    def _submit(self, round_: Round, task: Task) -> None:
        assert round_.record is not None
        args: tuple[Any, ...] = (round_.record.future, task.chunk)
        snapshot = self._offered(round_)
        if snapshot is not None or task.check:
            args += (snapshot.future if snapshot is not None else None,)
        if task.check:
            args += (True,)
        key = f"dasktrain-evolve-{self.spec.run_key}-{round_.generation}-{task.chunk}-" \
              f"{next(self._names)}"
        try:
            future = self.client.submit(evaluate_members, *args, key=key, pure=False,
                                        **self.pool.restriction())
        except Exception as exc:
            raise lost_contact(exc) from exc
        round_.pending[future] = task
        round_.report.tasks += 1
        # The record and the snapshot are counted per copy (see _count_copies).
        round_.report.bytes_sent += len(pickle.dumps((task.chunk, True) if task.check
                                                     else task.chunk))

    def _answer(self, round_: Round, task: Task, result: Any) -> None:
        """Take a task's answer: its members' fitness, or a miss to send again."""
        report = round_.report
        if isinstance(result, tuple) and result[0] == MISS:
            report.bytes_received += len(pickle.dumps(result))
            report.missed += 1
            round_.retries += 1
            self._resend(round_, task, result[1])
            return
        report.bytes_received += len(result)
        start, stop = self.chunks[task.chunk]
        answer = decode_result(result, stop - start)
        address = self.pool.address(answer.worker)
        if answer.checksum is not None:
            if answer.checksum != round_.digest:
                raise EvolutionError(
                    f"worker {address}'s copy of the run's state at generation "
                    f"{round_.generation} differs from the driver's (checksum "
                    f"{answer.checksum} against {round_.digest}): its float arithmetic "
                    "differs (another numpy build or CPU?); run the cluster on one software "
                    "environment")
            round_.checked.add(answer.worker)
        report.values[start:stop] = answer.values
        report.compute_seconds += answer.seconds
        name = self.pool.name(answer.worker)
        report.members_per_worker[name] = report.members_per_worker.get(name, 0) + \
            stop - start
        round_.evaluated.setdefault(answer.worker, []).append(task.chunk)
        if address is not None:
            self.pool.known[address] = round_.generation

    def _resend(self, round_: Round, task: Task, worker: str) -> None:
        """Send a missed chunk again, with a snapshot at the generation."""
        if self._offered(round_) is None or self._snapshot.generation != round_.generation:
            self._place_snapshot(round_.generation, round_.state, [worker])
            round_.report.snapshot_bytes += self._pending_snapshot_bytes
            self._pending_snapshot_bytes = 0
            self.events.append(f"generation {round_.generation}: worker {worker} got a "
                               "snapshot (no copy)")
        self._submit(round_, task)

    def _check_everyone(self, round_: Round) -> None:
        """Members evaluated by a worker whose checksum never came (it died before its
        answer that carried it was gathered) are evaluated again, checksum asked."""
        for worker in [w for w in round_.evaluated if w not in round_.checked]:
            chunks = round_.evaluated.pop(worker)
            name = self.pool.name(worker)
            self.events.append(f"generation {round_.generation}: no checksum came from "
                               f"{name}; its members are evaluated again")
            for chunk in chunks:
                start, stop = self.chunks[chunk]
                round_.report.values[start:stop] = np.nan
                done = round_.report.members_per_worker
                done[name] = done.get(name, 0) - (stop - start)
                if done[name] <= 0:
                    del done[name]
                round_.retries += 1
                self._submit(round_, Task(chunk, check=True))

    def _count_copies(self, round_: Round) -> None:
        try:
            if round_.record is not None:
                round_.report.record_bytes += self._shared.count_copies(round_.record)
            if self._snapshot is not None:
                round_.report.snapshot_bytes += self._shared.count_copies(self._snapshot)
        except Exception as exc:
            raise lost_contact(exc) from exc

    # -- waiting and failures -------------------------------------------------------------
    def _wait(self, round_: Round) -> list[Future]:
        """The tasks done (or cancelled) as soon as one is; fails after ``timeout``
        seconds without any."""
        generation = round_.generation

        def get(seconds: float) -> list[Future]:
            try:
                done, _ = wait(list(round_.pending), timeout=seconds,
                               return_when="FIRST_COMPLETED")
            except TimeoutError:
                raise
            except _CANCELLED as exc:
                cancelled = [f for f in round_.pending if f.status == "cancelled"]
                if not cancelled:
                    raise lost_contact(exc) from exc
                return cancelled
            except Exception as exc:
                raise lost_contact(exc) from exc
            return list(done)

        def expired() -> EvolutionError:
            return EvolutionError(
                f"no member of generation {generation} was evaluated in {self.timeout:.0f} "
                f"s ({len(round_.pending)} task(s) waiting); raise timeout= if one "
                "evaluation takes that long")

        return wait_until(get, timeout=self.timeout, expired=expired,
                          check=lambda: self._rechoose(round_), slice_seconds=_POLL)

    def _rechoose(self, round_: Round) -> None:
        """Tasks restricted to chosen workers that are all gone go to others."""
        live = self.pool.live()
        if not self.pool.all_chosen_gone(live):
            return
        self.pool.choose(live)
        self.events.append(f"generation {round_.generation}: the chosen workers are gone; "
                           f"its members go to {self.pool.chosen}")
        self._resubmit(round_, live)

    def _recover(self, round_: Round) -> None:
        """Tasks were cancelled: if the record or the snapshot they needed was lost with
        the workers holding it, place it again and submit the tasks again; otherwise the
        scheduler was lost or restarted."""
        live = self.pool.live()  # fails at once if the scheduler is gone
        if not any(self._shared.lost(s) for s in (round_.record, self._snapshot)):
            cancelled = [t.chunk for f, t in round_.pending.items()
                         if f.status == "cancelled"]
            start, stop = self.chunks[cancelled[0]] if cancelled else (0, 0)
            raise EvolutionError(
                f"the cluster cancelled the task of members {start}-{stop - 1} of generation "
                f"{round_.generation}: the Dask scheduler was lost or restarted")
        self.events.append(f"generation {round_.generation}: the workers holding its "
                           "update record or snapshot were lost; its tasks go again")
        self._resubmit(round_, live)

    def _resubmit(self, round_: Round, live: list[str]) -> None:
        """Every pending task again, on the workers of now (the record placed there anew
        if the old one is lost, or held by chosen workers that are gone)."""
        round_.retries += 1
        workers = self.pool.choose(live)
        if self._shared.lost(self._snapshot):
            self._shared.release(self._snapshot)
            self._snapshot = None
        if self._shared.lost(round_.record) or self.pool.workers is not None:
            self._place_record(round_, workers)
        tasks = list(round_.pending.values())
        self._cancel(round_.pending)
        for task in tasks:
            self._submit(round_, task)

    def _gather(self, futures: list[Future]) -> list[Any] | None:
        """Their results; None if one was cancelled meanwhile (the next wait sees it)."""
        if not futures:
            return []
        try:
            return self.client.gather(futures)
        except _CANCELLED:
            return None
        except Exception as exc:
            raise lost_contact(exc) from exc

    def _failure(self, future: Future, generation: int, chunk: int) -> BaseException:
        start, stop = self.chunks[chunk]
        members = f"members {start}-{stop - 1} of generation {generation}"
        try:
            error = future.exception(timeout=self.timeout)
        except (FutureCancelledError, Exception) as exc:
            return lost_contact(exc)
        if isinstance(error, KilledWorker):
            return EvolutionError(f"the workers evaluating {members} died, again and again "
                                  f"(Dask gave up: {error})")
        if isinstance(error, FitnessFailed):
            error.__cause__ = error.error  # Dask's transport of a task's error drops it
        return error.with_traceback(future.traceback())

    def _cancel(self, pending: dict[Future, Task]) -> None:
        with contextlib.suppress(Exception):  # the cluster is gone: nothing runs any more
            self.client.cancel(list(pending))
        pending.clear()

    def close(self) -> None:
        """Release what the run placed on the cluster and drop the workers' copies of the
        run (best effort: the cluster may be gone)."""
        with contextlib.suppress(Exception):
            self._shared.close()
            # Only live workers that hold a copy: another would import the run's code just to
            # say no, and a dead one's address takes Dask's connect timeout to give up on.
            holders = sorted((set(self.pool.known) | self._shared.touched)
                             & set(worker_info(self.client)))
            if holders:
                self.client.run(forget_run, self.spec.run_key, workers=holders,
                                on_error="ignore")
