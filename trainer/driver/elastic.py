"""How many trainer workers an epoch of a fit starts with, and where the ones the cluster
adds mid-epoch go (the Trainer's ``workers=(least, most)``; see the docs' "Elastic
training").

One trainer worker per Dask worker: an epoch starts with as many as the cluster has
(between the least and the most, waiting for the least), and a run whose workers claim
work on demand starts one on each Dask worker the cluster gains mid-epoch. The decisions
are here, and where the parameter holder goes beside them;
:class:`~dasktrain.trainer.driver.run.FitRun` submits and cancels the tasks.
"""

from __future__ import annotations

import collections
from typing import Any

from distributed import Client

from dasktrain._cluster import declares_gpu, worker_info
from dasktrain._deadline import wait_until
from dasktrain.trainer.errors import TrainerError

__all__ = ["WorkerPlaces", "replica_hosts", "running"]


def running(workers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The workers that take tasks (not closing, not retiring)."""
    return {a: w for a, w in workers.items() if w.get("status", "running") == "running"}


def replica_hosts(workers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The workers a model replica may run on: those that declare a ``GPU`` resource where
    any does (each replica's task then asks for ``GPU=1``; pinned to a worker without one,
    the scheduler fails the task), else all of them."""
    gpus = {a: w for a, w in workers.items() if declares_gpu(w)}
    return gpus or workers


class WorkerPlaces:
    """Where a fit's trainer workers run: ``least`` to ``most`` of them, one per Dask
    worker when ``least < most``."""

    def __init__(self, client: Client, least: int, most: int, addresses: list[str],
                 timeout: float) -> None:
        self.client = client
        self.least, self.most = least, most
        self.timeout = timeout
        self.addresses = addresses  # the cluster's workers, sorted
        self.placed: dict[int, str] = {}  # where each worker's task was asked to run
        self.world: int | None = None  # workers the last epoch started with

    @property
    def elastic(self) -> bool:
        return self.least < self.most

    def start(self, epoch: int) -> tuple[int, str | None]:
        """Workers to start ``epoch`` with and where each goes (:attr:`placed`), and what
        to say of it in the History when their number changed (else None)."""
        present = self.most
        if self.elastic:
            what = f"{self.least} Dask worker(s) for epoch {epoch}"
            found = wait_until(
                self._count, timeout=self.timeout,
                expired=lambda: TrainerError(f"the cluster did not reach {what} within "
                                             f"{self.timeout:.0f}s (workers=({self.least},"
                                             f" {self.most}))"))
            present = min(found, self.most)
        self.placed = self._spread(present)
        changed = self.elastic and present != self.world
        was = "" if self.world is None else f" (was {self.world})"
        self.world = present
        return present, (f"epoch {epoch}: {present} trainer worker(s){was}" if changed
                         else None)

    def _spread(self, count: int) -> dict[int, str]:
        """Workers ``0..count-1`` over the addresses in turn: ``w`` on the ``w % n``-th."""
        return {w: self.addresses[w % len(self.addresses)] for w in range(count)}

    def holder_place(self, workers: dict[str, dict[str, Any]]) -> str:
        """Where the holder goes among ``workers``: the one with the most memory (actor
        state is not spillable), then the fewest of the fit's trainer tasks when every
        worker of the fit starts, one rather than none, first by address.

        The holder's updates are serial and run in its process, under the GIL it shares
        with the trainer tasks there: beside two trainer tasks instead of one (3 trainers
        on 2 processes), W3's ``async`` fits took 1.5x as long and ``sync``'s 1.2x. Beside
        one, its exchange with that trainer stays in the process; a holder alone, its only
        trainer elsewhere, was no faster (W3's tasks, one trainer on 2 processes)."""
        trainers = collections.Counter(self._spread(self.most).values())

        def key(address: str) -> tuple[int, bool, int]:
            count = trainers[address]
            return -(workers[address].get("memory_limit") or 0), count == 0, count

        return min(sorted(workers), key=key)

    def _count(self, left: float) -> int:
        """The Dask workers there are, once at least the least (else wait, up to ``left``
        seconds, and say so with TimeoutError)."""
        workers = replica_hosts(running(worker_info(self.client)))
        if len(workers) < self.least:
            self.client.wait_for_workers(self.least, timeout=min(left, 2.0))
            workers = replica_hosts(running(worker_info(self.client)))
        self.addresses = sorted(workers)
        return len(workers)

    def gained(self, busy: set[int], joined: dict[int, str],
               workers: dict[str, dict[str, Any]]) -> dict[int, str]:
        """A worker for each Dask worker of ``workers`` that no worker of ``busy`` (running
        now; ``joined``: where those that joined the holder train) runs on, up to the
        most: ``{worker: address}``, now in :attr:`placed`."""
        taken = {joined.get(w) or self.placed.get(w) for w in busy}
        free = [w for w in range(self.most) if w not in busy]
        new = dict(zip(free, sorted(set(replica_hosts(running(workers))) - taken),
                       strict=False))
        self.placed.update(new)
        return new

    def gone(self, busy: set[int], workers: dict[str, dict[str, Any]]) -> list[int]:
        """The workers of ``busy`` whose Dask worker left the cluster."""
        return [w for w in busy if self.placed.get(w) not in workers]
