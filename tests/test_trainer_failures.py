"""Killing processes under the trainer: a dead trainer worker never stalls the holder, a dead
holder fails the fit fast and a mid-epoch checkpoint resumes to the same parameters.

Each over both ways a worker beside the holder's host pushes: through memory shared with
the holder (the default), and with bytes on the channel's socket, one tensor per bucket
(``bucket_bytes=1``), so that the processes die while pushes are streaming during
backward."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import worker_info
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.holder import ParameterHolder
from tests.common.training import (
    alive_workers,
    flat_parameters,
    kill_once,
    mlp,
    mse,
    zeros_holder,
)


@pytest.fixture(scope="module")
def cluster_client():
    """A cluster of its own: these tests kill its worker processes (the nanny restarts them)."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def data(cluster_client, tmp_path_factory):
    out = tmp_path_factory.mktemp("failures") / "reg.zarr"
    return dt.prepare("regression", out, client=cluster_client, samples=1600, width=4,
                      chunk_rows=200, seed=5, progress=False)


# Trainer options of each exchange path.
PATHS = {"shared": {}, "buckets": {"shared_memory": False, "bucket_bytes": 1}}


def _holder_address(client: Client) -> str:
    """Where to put the holder, once the cluster is whole again (the nanny restarts the
    process an earlier test killed; its new address must not change the choice midway)."""
    return alive_workers(client, 2)[0]


@pytest.mark.parametrize("path", PATHS)
def test_killed_trainer_worker_is_dropped_and_the_run_completes(cluster_client, data,
                                                                 tmp_path, path):
    holder = _holder_address(cluster_client)
    loss = functools.partial(kill_once, marker=str(tmp_path / "killed"), calls=20,
                             holder=holder, on_holder=False)
    trainer = dt.Trainer(mlp, loss, dt.optim.sgd(0.05), mode="sync", workers=2,
                         batch_size=8, holder_worker=holder, progress=False, **PATHS[path])
    started = time.monotonic()
    history = trainer.fit(data, epochs=2, client=cluster_client)
    assert (tmp_path / "killed").exists()  # the process really died mid-epoch
    assert time.monotonic() - started < 120
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    # Either the barrier noticed the dead process and went on with worker 0 (then steps
    # with one gradient), or the rerun task joined first, superseding the dead one: the
    # barrier then goes on without the dead incarnation as well.
    dropped = any("worker 1 dropped" in e or "worker 1's earlier task is superseded" in e
                  for e in history.events)
    rejoined = any("worker 1 rejoined" in e for e in history.events)
    assert dropped and rejoined, history.events
    assert history.contributors.count(2) >= 100
    assert torch.isfinite(flat_parameters(trainer.model)).all()


@pytest.mark.parametrize("path", [*PATHS, "shards"])
def test_killed_holder_fails_fast_and_the_checkpoint_resumes_exactly(cluster_client, data,
                                                                     tmp_path, path):
    holder = _holder_address(cluster_client)
    # In shards, one per worker process: the kill takes shard 0's.
    options = {"holder_shards": 2} if path == "shards" else PATHS[path]

    def trainer(loss, holder_worker=holder):
        return dt.Trainer(mlp, loss, dt.optim.sgd(0.05, momentum=0.9), mode="sync",
                          workers=2, batch_size=8, holder_worker=holder_worker,
                          checkpoint_every=10, progress=False, **options)

    straight = trainer(mse)
    straight.fit(data, epochs=2, client=cluster_client)
    first = straight.history.epochs[0]
    if path == "shards":
        assert first["exchange_via"] == {"shards:direct+local": 2}
    else:
        assert first["exchange_via"] == {"local": 1, "direct": 1}
        # The worker outside the holder's process shared memory with it, or streamed its
        # gradients in buckets.
        direct = next(w for w in first["per_worker"] if w["transport"] is not None)
        if path == "shared":
            assert direct["transport"] == "shared" and direct["pushes_in_buckets"] == 0
        else:
            assert direct["transport"] == "local" and direct["pushes_in_buckets"] == 100

    # 100 steps per epoch: the holder's process dies in the middle of epoch 1.
    loss = functools.partial(kill_once, marker=str(tmp_path / "killed"), calls=150,
                             holder=holder, on_holder=True)
    interrupted = trainer(loss)
    started = time.monotonic()
    with pytest.raises(dt.HolderLost, match=r"died at version \d+; resume with fit") as caught:
        interrupted.fit(data, epochs=2, client=cluster_client, checkpoint=tmp_path / "run")
    assert time.monotonic() - started < 60
    assert str(tmp_path / "run" / "checkpoint.pt") in str(caught.value)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["complete_epochs"] == 1 and state["holder"]["epoch"] == 1

    resumed = trainer(mse, _holder_address(cluster_client))  # not the killed one
    history = resumed.fit(data, epochs=2, client=cluster_client, resume=tmp_path / "run")
    torch.testing.assert_close(flat_parameters(resumed.model),
                               flat_parameters(straight.model), rtol=1e-5, atol=1e-6)
    assert [e["epoch"] for e in history.epochs] == [0, 1]


def test_a_trainer_worker_killed_beside_holder_shards_stops_the_fit_for_a_resume(
        data, tmp_path):
    """With the holder in shards a step must reach every shard or none, which a worker
    killed between two shards' pushes cannot promise: the first shard to find it lost
    stops the fit, whose error says which worker and where to resume from, and no shard
    has applied a step without it. The resume completes the fit. A cluster of three
    processes: shards on two, so that the trainer killed in the third holds none."""
    run = tmp_path / "run"
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        addresses = sorted(worker_info(client))
        # Trainer w starts on addresses[w]; the shards go to addresses[2], then [0]. The
        # kill comes in epoch 1, after epoch 0's checkpoint.
        loss = functools.partial(kill_once, marker=str(tmp_path / "killed"), calls=130,
                                 holder=addresses[1], on_holder=True)

        def trainer(loss):
            return dt.Trainer(mlp, loss, dt.optim.sgd(0.05), mode="sync", workers=2,
                              batch_size=8, holder_worker=addresses[2], holder_shards=2,
                              progress=False)

        with pytest.raises(dt.ShardedWorkerLost, match=r"worker 1 was lost.*resume with "
                                                       r"fit\(\.\.\., resume=") as lost:
            trainer(loss).fit(data, epochs=2, client=client, checkpoint=run)
        assert (tmp_path / "killed").exists()
        assert [e["epoch"] for e in lost.value.history.epochs] == [0]
        resumed = trainer(mse)
        history = resumed.fit(data, epochs=2, client=client, resume=run)
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    assert torch.isfinite(flat_parameters(resumed.model)).all()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_call_started_after_the_holders_worker_is_known_lost_says_holder_lost(
        cluster_client):
    """Dask's actor refuses a call once its worker is lost (RuntimeError); the driver's
    handle says HolderLost, which the fit turns into its resume hint (a holder lost at an
    epoch's boundary, as the next checkpoint mark is asked for, failed with Dask's error)."""
    holder = _holder_address(cluster_client)
    future = cluster_client.submit(ParameterHolder, zeros_holder(4, workers=1, mode="sync"),
                                   actor=True, workers=[holder])
    handle = HolderHandle(future.result(), 30, cluster_client)
    cluster_client.run(_kill_self, workers=[holder], on_error="ignore")
    deadline = time.monotonic() + 60
    while future.status == "finished":  # until the scheduler has let the worker go
        assert time.monotonic() < deadline, "the holder's worker was never found lost"
        time.sleep(0.05)
    with pytest.raises(dt.HolderLost, match="died"):
        handle.call("state_at", 10)
