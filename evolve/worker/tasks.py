"""The one Dask task of a run: evaluate a few members of one generation.

Its argument and its result are plain tuples of scalars and bytes, the whole exchange of a
generation (tuples rather than dataclasses: a dataclass pickles with its class's path,
which would be most of the bytes of a small task):

* task: ``(run_key, generation, base, records, snapshot, (start, stop))``: the update
  records (ranks) of generations ``base .. generation - 1``, concatenated; ``snapshot`` is
  ``(published name, generation)`` of a copy of the run's state the driver offers, or None;
  members ``start .. stop - 1`` to evaluate.
* result: ``(OK, worker, fitness, digest, seconds, fetched)``: the members' fitness as
  float64 bytes, the checksum of this process's state at the generation, the seconds the
  evaluation took, and 1 if the snapshot was fetched from another process for it (else 0).
  Or ``(MISS, worker, reason)``: this process holds no copy it can bring to the generation
  and no snapshot was usable; the driver sends the members again with a fresh one.
"""

from __future__ import annotations

import time
from typing import Any

from distributed import get_client, get_worker

from dasktrain.evolve.spec import Snapshot
from dasktrain.evolve.worker.replica import Replica, find_replica, forget_run, keep_replica

__all__ = ["MISS", "NO_COPY", "OK", "SNAPSHOT_LOST", "Task", "evaluate_members", "forget_run"]

OK, MISS = 0, 1
#: Why a task missed: no copy here and no usable snapshot offered; or the snapshot offered
#: could not be fetched (its worker died: the driver publishes another).
NO_COPY, SNAPSHOT_LOST = "no copy", "snapshot lost"

#: Seconds a worker waits for a snapshot before it reports it lost.
FETCH_TIMEOUT = 120.0

Task = tuple[str, int, int, bytes, tuple[str, int] | None, tuple[int, int]]


def evaluate_members(task: Task) -> tuple[Any, ...]:
    """Runs on a worker: bring this process's copy of the run to the task's generation and
    evaluate its members (see the module docstring)."""
    run_key, generation, base, records, snapshot, (start, stop) = task
    address = get_worker().address
    fetched = 0
    replica = find_replica(run_key, base, generation)
    if replica is None:
        if snapshot is None or not base <= snapshot[1] <= generation:
            return (MISS, address, NO_COPY)
        try:
            found, fetched = _fetch(snapshot[0])
        except Exception:  # its worker died, or it was replaced: ask for another
            return (MISS, address, SNAPSHOT_LOST)
        replica = Replica.from_snapshot(found)
        keep_replica(replica)
    with replica.lock:
        replica.catch_up(generation, base, records)
        started = time.perf_counter()
        values = replica.evaluate(start, stop)
        seconds = time.perf_counter() - started
        digest = replica.digest()
    return (OK, address, values.tobytes(), digest, seconds, fetched)


def _fetch(name: str) -> tuple[Snapshot, int]:
    """The snapshot published as ``name``, and 1 if it came from another process."""
    client = get_client()
    future = client.get_dataset(name)
    local = future.key in get_worker().data
    snapshot = future.result(timeout=FETCH_TIMEOUT)
    return snapshot, 0 if local else 1
