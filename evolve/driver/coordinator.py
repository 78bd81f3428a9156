"""The driver's side of one generation: hand its members out, a few per Dask task, and
collect their fitness.

All of a generation's tasks are submitted at once and Dask's scheduler hands them to
workers as their threads come free, so a slow worker takes fewer of them, and a task whose
worker dies is run again elsewhere (a worker that dies on the same members three times in
a row fails the run with Dask's ``KilledWorker``). A task carries scalars only: the update
records a worker may need to bring its copy of the state to the generation, its members'
range and the name of a published snapshot (see :mod:`dasktrain.evolve.worker.tasks`).

Which records a task carries: those since the oldest generation a live worker is known to
hold (from the results it sent, at most :data:`MAX_LAG` back), usually just the last one.
A worker with no copy it can bring forward (new, restarted, or too far behind) answers
"miss" at once; the driver then publishes a snapshot of the state at the generation (once
per generation, scattered to that worker) and sends the members again. The run's first
generation publishes its snapshot to every worker it may use.

With ``workers=k`` the tasks are restricted to k chosen workers (strictly: Dask's work
stealing would otherwise hand them to idle others), the same ones while they live; if all
of them are gone mid-generation, its waiting tasks go to others.

Every answer carries the worker's checksum of its state: copies that drifted apart (other
numerics on another machine) stop the run with a clear error instead of ranking members
of different parents.

Bytes: what a generation sends and receives is counted as pickled (each task's function
and argument, each result), and snapshots at their pickled size per copy made (scattered,
or fetched by a worker from another).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from distributed import Client, Future, wait
from distributed.client import FutureCancelledError
from distributed.protocol import pickle
from distributed.scheduler import KilledWorker

from dasktrain._cluster import worker_info
from dasktrain._deadline import wait_until
from dasktrain.evolve.errors import EvolutionError
from dasktrain.evolve.shaping import encode_ranks
from dasktrain.evolve.spec import RunSpec, Snapshot
from dasktrain.evolve.worker.tasks import (
    MISS,
    SNAPSHOT_LOST,
    Task,
    evaluate_members,
    forget_run,
)

__all__ = ["MAX_LAG", "Coordinator", "GenerationReport", "member_chunks"]

#: Generations of records a task carries at most; a worker further behind gets a snapshot.
MAX_LAG = 8
#: Seconds between looks at the cluster while a generation's tasks run.
_POLL = 1.0


def member_chunks(population: int, per_task: int) -> list[tuple[int, int]]:
    """Members ``[start, stop)`` of each task of a generation."""
    return [(s, min(s + per_task, population)) for s in range(0, population, per_task)]


@dataclasses.dataclass(slots=True)
class GenerationReport:
    """What one generation cost and who did it."""

    values: np.ndarray
    seconds: float = 0.0
    tasks: int = 0
    missed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    snapshot_bytes: int = 0
    compute_seconds: float = 0.0
    members_per_worker: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class _Published:
    name: str
    generation: int
    future: Future
    size: int


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
        self.workers = workers
        self.chunks = member_chunks(spec.population, members_per_task)
        self.timeout = timeout
        self.records: dict[int, bytes] = {}
        self.known: dict[str, int] = {}
        """The generation each worker's copy was at when it last answered."""
        self.chosen: list[str] = []
        self.events: list[str] = []
        self._snapshot: _Published | None = None
        self._snapshot_holders: set[str] = set()
        self._pending_snapshot_bytes = 0
        self._names = itertools.count()
        self._attempts = itertools.count()

    # -- workers -----------------------------------------------------------------------
    def _live(self) -> list[str]:
        """The cluster's workers now (waiting up to ``timeout`` for one if there is none)."""
        try:
            live = sorted(worker_info(self.client))
            if not live:
                self.client.wait_for_workers(1, timeout=self.timeout)
                live = sorted(worker_info(self.client))
        except TimeoutError:
            raise EvolutionError(f"the cluster has had no worker for {self.timeout:.0f} s"
                                 ) from None
        except Exception as exc:
            raise _lost(exc) from exc
        return live

    def _allowed(self, live: list[str]) -> list[str] | None:
        """The workers tasks may run on (the same ones while they live); None: any."""
        if self.workers is None:
            return None
        kept = [w for w in self.chosen if w in live]
        kept += [w for w in live if w not in kept][: self.workers - len(kept)]
        self.chosen = kept
        return kept

    def _base(self, generation: int, live: Sequence[str]) -> int:
        """The oldest generation a worker that may take the tasks is known to hold."""
        pool = set(self.chosen if self.workers is not None else live)
        held = [g for w, g in self.known.items()
                if w in pool and generation - MAX_LAG <= g <= generation]
        return min(held, default=generation)

    # -- snapshots ---------------------------------------------------------------------
    def begin(self, generation: int, state: Any) -> None:
        """Offer every worker the run may use a snapshot of ``state`` at ``generation``."""
        live = self._live()
        allowed = self._allowed(live) or live
        self._publish(generation, state, allowed, broadcast=True)

    def _publish(self, generation: int, state: Any, workers: list[str],
                 broadcast: bool) -> None:
        snapshot = Snapshot(self.spec_blob, generation, state.copy())
        size = len(pickle.dumps(snapshot))
        name = f"dasktrain-evolve-{self.spec.run_key}-{next(self._names)}"
        try:
            future = self.client.scatter(snapshot, workers=workers, broadcast=broadcast,
                                         hash=False)
            self.client.publish_dataset(**{name: future})
            self._unpublish()
        except Exception as exc:
            raise _lost(exc) from exc
        self._snapshot_holders.update(workers)
        self._snapshot = _Published(name, generation, future, size)
        self._pending_snapshot_bytes += size * (len(workers) if broadcast else 1)

    def _unpublish(self) -> None:
        if self._snapshot is not None:
            self.client.unpublish_dataset(self._snapshot.name)
            self._snapshot.future.release()
            self._snapshot = None

    def _offer(self, base: int) -> tuple[str, int] | None:
        found = self._snapshot
        return (found.name, found.generation) if found and found.generation >= base else None

    # -- a generation ------------------------------------------------------------------
    def record(self, generation: int, ranks: np.ndarray) -> None:
        """Keep generation's update record for the tasks of the next ones."""
        self.records[generation] = encode_ranks(ranks)
        self.records.pop(generation - MAX_LAG - 1, None)

    def run(self, generation: int, state: Any, digest: int) -> GenerationReport:
        """Evaluate every member of ``generation`` (the driver's state is ``state``, whose
        checksum is ``digest``); the fitness comes back in member order."""
        started = time.perf_counter()
        report = GenerationReport(np.full(self.spec.population, np.nan))
        report.snapshot_bytes, self._pending_snapshot_bytes = self._pending_snapshot_bytes, 0
        live = self._live()
        for worker in [w for w in self.known if w not in live]:
            del self.known[worker]
            self.events.append(f"generation {generation}: worker {worker} left")
        self._allowed(live)
        base = self._base(generation, live)
        records = b"".join(self.records[g] for g in range(base, generation))
        offer = self._offer(base)
        pending: dict[Future, Task] = {}
        for chunk in self.chunks:
            self._submit(pending, report, (self.spec.run_key, generation, base, records,
                                           offer, chunk))
        misses_allowed = 3 * len(self.chunks) + 2 * len(live)
        while pending:
            done = self._wait(pending, report, generation)
            for future in done:
                if future.status != "finished":
                    task = pending.pop(future)
                    self._cancel(pending)
                    raise self._failure(future, generation, task[5])
            for future, result in zip(done, self._gather(list(done)), strict=True):
                task = pending.pop(future)
                report.bytes_received += len(pickle.dumps(result))
                if result[0] != MISS:
                    self._take(report, generation, digest, task[5], result, pending)
                    continue
                report.missed += 1
                if report.missed > misses_allowed:
                    self._cancel(pending)
                    raise EvolutionError(
                        f"workers could not take up the run's state for generation "
                        f"{generation} after {report.missed} tries (last: {result[2]} on "
                        f"{result[1]})")
                self._resend(pending, report, generation, state, result, task[5])
        report.seconds = time.perf_counter() - started
        return report

    def _take(self, report: GenerationReport, generation: int, digest: int,
              chunk: tuple[int, int], result: tuple, pending: dict[Future, Task]) -> None:
        """Record a chunk's fitness, once its worker's state is checked to be ours."""
        _, worker, values, their_digest, seconds, fetched = result
        if their_digest != digest:
            self._cancel(pending)
            raise EvolutionError(
                f"worker {worker}'s copy of the run's state at generation {generation} "
                f"differs from the driver's (checksum {their_digest} against {digest}): its "
                "float arithmetic differs (another numpy build or CPU?); run the cluster on "
                "one software environment")
        report.values[chunk[0] : chunk[1]] = np.frombuffer(values, np.float64)
        report.compute_seconds += seconds
        if fetched and self._snapshot is not None:
            report.snapshot_bytes += self._snapshot.size
        report.members_per_worker[worker] = \
            report.members_per_worker.get(worker, 0) + chunk[1] - chunk[0]
        self.known[worker] = generation

    def _submit(self, pending: dict[Future, Task], report: GenerationReport, task: Task
                ) -> None:
        # Restricted to the chosen workers, strictly: with allow_other_workers, Dask's
        # work stealing would move tasks to the others as soon as they idle.
        where = {} if self.workers is None else {"workers": list(self.chosen)}
        generation, chunk = task[1], task[5]
        key = (f"dasktrain-evolve-{self.spec.run_key}-{generation}-{chunk[0]}-"
               f"{next(self._attempts)}")
        try:
            future = self.client.submit(evaluate_members, task, key=key, pure=False, **where)
        except Exception as exc:
            raise _lost(exc) from exc
        pending[future] = task
        report.tasks += 1
        report.bytes_sent += len(pickle.dumps((evaluate_members, task)))

    def _resend(self, pending: dict[Future, Task], report: GenerationReport,
                generation: int, state: Any, miss: tuple, chunk: tuple[int, int]) -> None:
        """Send a missed chunk again, with a snapshot at the generation."""
        _, worker, reason = miss
        current = self._snapshot
        if current is None or current.generation != generation or reason == SNAPSHOT_LOST:
            self._publish(generation, state, [worker], broadcast=False)
            report.snapshot_bytes += self._pending_snapshot_bytes
            self._pending_snapshot_bytes = 0
            self.events.append(f"generation {generation}: worker {worker} got a snapshot "
                               f"({reason})")
        self._submit(pending, report, (self.spec.run_key, generation, generation, b"",
                                       self._offer(generation), chunk))

    def _wait(self, pending: dict[Future, Task], report: GenerationReport, generation: int
              ) -> list[Future]:
        """The tasks done as soon as one is; fails after ``timeout`` seconds without any."""
        def get(seconds: float) -> list[Future]:
            try:
                done, _ = wait(list(pending), timeout=seconds, return_when="FIRST_COMPLETED")
            except TimeoutError:
                raise
            except Exception as exc:
                raise _lost(exc) from exc
            return list(done)

        def expired() -> EvolutionError:
            waiting = len(pending)
            self._cancel(pending)
            return EvolutionError(
                f"no member of generation {generation} was evaluated in {self.timeout:.0f} "
                f"s ({waiting} task(s) waiting); raise timeout= if one evaluation takes "
                "that long")

        return wait_until(get, timeout=self.timeout, expired=expired,
                          check=lambda: self._rechoose(pending, report, generation),
                          slice_seconds=_POLL)

    def _rechoose(self, pending: dict[Future, Task], report: GenerationReport,
                  generation: int) -> None:
        """Tasks restricted to chosen workers that are all gone go to others."""
        if self.workers is None:
            return
        live = self._live()
        if set(self.chosen) & set(live):
            return
        self._allowed(live)
        self.events.append(f"generation {generation}: the chosen workers are gone; its "
                           f"members go to {self.chosen}")
        for future, task in list(pending.items()):
            future.cancel()
            del pending[future]
            self._submit(pending, report, task)

    def _gather(self, futures: list[Future]) -> list[Any]:
        if not futures:
            return []
        try:
            return self.client.gather(futures)
        except Exception as exc:
            raise _lost(exc) from exc

    def _failure(self, future: Future, generation: int, chunk: tuple[int, int]
                 ) -> BaseException:
        members = f"members {chunk[0]}-{chunk[1] - 1} of generation {generation}"
        if future.status == "cancelled":
            return EvolutionError(f"the cluster cancelled the task of {members}: the Dask "
                                  "scheduler was lost or restarted")
        try:
            error = future.exception(timeout=self.timeout)
        except (FutureCancelledError, Exception) as exc:
            return _lost(exc)
        if isinstance(error, KilledWorker):
            return EvolutionError(f"the workers evaluating {members} died, again and again "
                                  f"(Dask gave up: {error})")
        return error.with_traceback(future.traceback())

    def _cancel(self, pending: dict[Future, tuple[int, int]]) -> None:
        with contextlib.suppress(Exception):  # the cluster is gone: nothing runs any more
            self.client.cancel(list(pending))
        pending.clear()

    def close(self) -> None:
        """Withdraw the snapshot and drop the workers' copies of the run (best effort: the
        cluster may be gone)."""
        with contextlib.suppress(Exception):
            self._unpublish()
            # Only live workers that hold a copy: another would import the run's code just to
            # say no, and a dead one's address takes Dask's connect timeout to give up on.
            holders = sorted((set(self.known) | self._snapshot_holders)
                             & set(worker_info(self.client)))
            if holders:
                self.client.run(forget_run, self.spec.run_key, workers=holders,
                                on_error="ignore")


def _lost(exc: BaseException) -> EvolutionError:
    return EvolutionError(f"lost contact with the Dask cluster: its scheduler is gone or "
                          f"unreachable ({type(exc).__name__}: {exc})")
