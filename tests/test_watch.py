"""The watch for paused workers, on a real cluster of two: one paused for its memory, one not.

A job's tasks may wait on a paused worker for ever; the watch must stop such a job within
seconds, and must leave alone a job whose tasks run on the other worker however long they
take.
"""

import time

import dask
import pytest
from distributed import Client, Event, LocalCluster, Nanny, Scheduler, SpecCluster

import dasktrain as dt
from dasktrain._cluster import worker_info
from dasktrain._watch import PauseWatch
from tests.common.builders import wait_for


def _worker(limit: str | int) -> dict:
    return {"cls": Nanny, "options": {"host": "127.0.0.1", "nthreads": 1,
                                      "memory_limit": limit}}


@pytest.fixture(scope="module")
def half_paused():
    """``small`` is paused from the start: a worker process with the suite's preloaded
    modules is well past 80 % of 150 MiB (the nanny's kill at 95 % is off, so it stays so);
    ``big`` has no limit."""
    with dask.config.set({"distributed.worker.memory.terminate": False}), \
            SpecCluster(scheduler={"cls": Scheduler, "options": {
                            "host": "127.0.0.1", "dashboard_address": None}},
                        workers={"small": _worker("150MiB"), "big": _worker(0)}) as cluster, \
            Client(cluster) as client:
        client.run(lambda: __import__("dasktrain.datasets.prepare"))
        addresses = {w["name"]: a for a, w in worker_info(client).items()}
        wait_for(lambda: worker_info(client)[addresses["small"]]["status"] == "paused", 60,
                 "the small worker to pause")
        yield client, addresses


def _keep_checking(watch: PauseWatch, seconds: float, **check) -> None:
    """Check as a job's wait does, for ``seconds`` (many times the watch's grace)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.check(**check)
        time.sleep(0.02)


def _wait_on(event_name: str) -> int:
    Event(event_name).wait(timeout=120)
    return 1


def test_a_task_running_on_a_worker_not_paused_is_waited_for(half_paused):
    client, addresses = half_paused
    watch = PauseWatch(client, dt.ClusterStuck, "hint", grace=0.2, interval=0)
    event = Event("watch-long-task", client=client)
    future = client.submit(_wait_on, "watch-long-task", workers=[addresses["big"]],
                           pure=False)
    try:
        wait_for(lambda: future.key in client.processing()[addresses["big"]], 30,
                 "the long task to start")
        # Nothing finishes for five times the grace, a worker is paused, and yet the one
        # task not done runs elsewhere: no error.
        _keep_checking(watch, 1.0, progress=0, what="waiting", keys=[future.key])
    finally:
        event.set()
    assert future.result(timeout=60) == 1


def test_a_task_that_only_a_paused_worker_holds_stops_the_wait(half_paused):
    client, addresses = half_paused
    watch = PauseWatch(client, dt.ClusterStuck, "a worker needs this much",
                       grace=0.2, interval=0)
    # Restricted to the paused worker, the task can never start.
    future = client.submit(sum, [1, 2], workers=[addresses["small"]], pure=False)
    try:
        with pytest.raises(dt.ClusterStuck) as caught:
            _keep_checking(watch, 30, progress=0, what="summing", keys=[future.key])
    finally:
        client.cancel(future)
    message = str(caught.value)
    assert message.startswith("summing cannot go on: 1 of 2 Dask worker(s) stuck")
    assert f"{addresses['small']}: paused (process memory" in message
    assert "of a 150 MiB limit" in message and message.endswith("a worker needs this much")


def test_a_preparation_beside_a_paused_worker_runs_on_the_other(half_paused, tmp_path):
    client, _ = half_paused
    ds = dt.prepare("regression", tmp_path / "p.zarr", client=client, progress=False,
                    samples=40_000, width=8, chunk_rows=10_000, normalize=True)
    assert len(ds) == 40_000 and dt.verify(ds.url, client=client, progress=False).ok


def test_a_preparation_on_paused_workers_fails_fast_and_leaves_nothing(tmp_path):
    out = tmp_path / "p.zarr"
    with dask.config.set({"distributed.worker.memory.terminate": False}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                         dashboard_address=None, memory_limit="150MiB") as cluster, \
            Client(cluster) as client:
        client.run(lambda: __import__("dasktrain.datasets.prepare"))
        wait_for(lambda: {w["status"] for w in worker_info(client).values()} == {"paused"},
                 60, "the worker to pause")
        started = time.monotonic()
        with pytest.raises(dt.DasktrainError) as caught:
            dt.prepare("regression", out, client=client, progress=False, samples=40_000,
                       width=8, chunk_rows=10_000, normalize=True)
        took = time.monotonic() - started
    message = str(caught.value)
    assert type(caught.value).__name__ == "PreparationFailed", message
    assert took < 60, took  # the watch's few seconds, not a wait without end
    assert f"preparing {out}: " in message and ": paused (process memory" in message
    assert "of a 150 MiB limit" in message and "for this source: " in message
    assert list(tmp_path.iterdir()) == []
