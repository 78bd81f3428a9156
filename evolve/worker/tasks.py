"""The one Dask task of a run: evaluate a few members of one generation.

``evaluate_members(record, chunk, snapshot=None, check=False)``; what its arguments and
answer hold, byte for byte, is in :mod:`dasktrain.evolve.wire`. The record (the run, the
generation and the ranks this process may lack) and a snapshot are Dask dependencies of
the task: the cluster moves each to a worker once, however many of the generation's tasks
the worker runs, so a task itself carries the index of its members alone.
"""

from __future__ import annotations

import time

from distributed import get_worker

from dasktrain.evolve.spec import Snapshot
from dasktrain.evolve.wire import MISS, decode_record, encode_result, worker_id
from dasktrain.evolve.worker.replica import find_replica, forget_run, replica_from

__all__ = ["evaluate_members", "forget_run"]


def evaluate_members(record: bytes, chunk: int, snapshot: Snapshot | None = None,
                     check: bool = False) -> bytes | tuple[str, str]:
    """Runs on a worker: bring this process's copy of the run to the record's generation
    and evaluate the members of task ``chunk``.

    Returns their fitness, this worker's id and, in the copy's first answer of the
    generation (or with ``check``), the checksum of its state, encoded by
    :func:`~dasktrain.evolve.wire.encode_result`; or ``(MISS, address)`` when this process
    holds no copy it can bring to the generation and ``snapshot`` is None (the driver sends
    the members again with one).
    """
    header = decode_record(record)
    address = get_worker().address
    replica = find_replica(header.run_key, header.base, header.generation)
    if replica is None:
        if snapshot is None or not header.base <= snapshot.generation <= header.generation:
            return (MISS, address)
        replica = replica_from(snapshot, header.run_key, header.base, header.generation)
    start, stop = header.members(chunk, replica.spec.population)
    with replica.lock:
        if replica.generation > header.generation:
            # A task of a generation the run has left behind (its worker was thought lost):
            # nobody waits for it.
            return (MISS, address)
        replica.catch_up(header)
        started = time.perf_counter()
        values = replica.evaluate(start, stop)
        seconds = time.perf_counter() - started
        checksum = None
        if check or replica.checked != header.generation:
            checksum = replica.digest()
            replica.checked = header.generation
    return encode_result(values, seconds, worker_id(address), checksum)
