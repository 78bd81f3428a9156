"""A trainer worker whose direct channel is lost in the middle of an epoch: it goes on
through the holder's actor, and its counters say how its pushes went (only those sent
bucket by bucket during backward count as ``pushes_in_buckets``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import torch

from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.holder.actor import ParameterHolder
from dasktrain.trainer.worker.compute import BatchCompute
from dasktrain.trainer.worker.epoch import Replica, train_epoch
from dasktrain.trainer.worker.loop import WorkerConfig, _join
from tests.common.training import mse, zeros, zeros_holder

WIDTH = 4  # the features of the ``regression`` dataset
FALL_BACK_AT = 3  # the step whose push finds the channel gone


async def _stop_accepting(dask_worker, key: str) -> None:
    await dask_worker.state.actors[key]._channel.stop_accepting()


def test_pushes_after_a_fall_back_to_the_actor_are_not_counted_as_bucketed(client,
                                                                           regression):
    # Bytes on the socket (no shared memory), so every push can go bucket by bucket.
    config = dataclasses.replace(zeros_holder(WIDTH, workers=2), shared_memory=False)
    future = client.submit(ParameterHolder, config, actor=True, pure=False)
    holder = future.result(timeout=60)
    handle = HolderHandle(holder, 30, client)
    calls = itertools.count()

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if next(calls) == FALL_BACK_AT:
            # The holder's port closes (as behind a firewall) while this worker's connection
            # has been idle past the holder's deadline: this step's push must reconnect,
            # cannot, and goes through the actor, as do the rest of the epoch's.
            client.run(_stop_accepting, key=holder.key, workers=[holder._address])
            handle._channel._last_push -= 10 ** 6
        return mse(output, target)

    worker = WorkerConfig(model=functools.partial(zeros, WIDTH), compute=BatchCompute(loss),
                          data=regression, workers=2, batch_size=16, pipeline_options={},
                          mode="async", device="cpu", timeout=30)
    try:
        replica = Replica(worker, handle, FlatModel(worker.model(), torch.device("cpu")),
                          torch.device("cpu"), 0, None)
        result = train_epoch(replica, _join(replica), 0, time.perf_counter(), False)
    finally:
        handle.close()
        holder.close().result(timeout=30)
        future.release()
    assert result["steps"] == 10  # 320 rows in batches of 16, half of them this worker's
    assert result["exchange_via"] == "actor"
    assert result["pushes_in_buckets"] == FALL_BACK_AT
