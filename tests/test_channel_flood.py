"""The holder's direct channel through a flood of connections, and a worker's way back to it:
a fit whose workers reconnect (every epoch) while a flood of silent and garbage connections
goes on ends as it does without one, every worker on the channel; a worker that had to push
through the actor returns to the channel once the channel takes it again."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.exchange import client as client_module
from dasktrain.trainer.exchange.client import ChannelClient
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.exchange.reconnect import ChannelUnavailable
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.arithmetic import Lease
from tests.common.channel import Flood, channel_addresses, holder_actor, on_loop, serve_channel
from tests.common.training import flat_parameters, mlp, mse, zeros

EPOCHS = 3


def _trainer() -> dt.Trainer:
    # Bit for bit needs the same cut of every step in both fits: the balance would cut by
    # the workers' speeds, which the flood changes (the same update, other float rounding).
    return dt.Trainer(mlp, mse, dt.optim.sgd(0.05, momentum=0.9), mode="sync", workers=2,
                      batch_size=16, progress=False, balance=False)


def test_a_fit_through_a_connection_flood_ends_as_without_one_on_the_channel(
        client, regression):
    quiet = _trainer()
    quiet.fit(regression, epochs=EPOCHS, client=client)
    floods: list[Flood] = []

    def flood_after_the_first_epoch(trainer: dt.Trainer, record: dict) -> None:
        # The channel opened when epoch 0's workers joined; the workers of the next epochs
        # connect to it again, while this flood goes on.
        if record["epoch"] != 0:
            return
        found = [a for found in client.run(channel_addresses).values() for a in found]
        assert len(found) == 1, f"expected the fit's holder's channel, found {found}"
        floods.append(Flood(found[0]).__enter__())
        floods[0].wait_opened(200, timeout=30)  # well past the 32 that may wait

    trainer = _trainer()
    try:
        history = trainer.fit(regression, epochs=EPOCHS, client=client,
                              callbacks=[flood_after_the_first_epoch])
        flood = floods[0]
        assert flood.running, "the flood ended before the fit did"
    finally:
        for flood in floods:
            flood.stop()
    # Sync with even shares is deterministic: the flood changed nothing of the training.
    assert torch.equal(flat_parameters(trainer.model), flat_parameters(quiet.model))
    assert history.updates == quiet.history.updates
    # Every worker of every epoch pushed over the channel (or in the holder's process).
    for epoch in history.epochs:
        via = epoch["exchange_via"]
        assert "actor" not in via and via.get("direct", 0) >= 1, (epoch["epoch"], via)
    assert not [e for e in history.events if "through the actor" in e], history.events
    # The holder went on closing the flood's connections all along (so it never ran out).
    assert flood.ended_by_holder > 100, (flood.opened, flood.ended_by_holder)


FEATURES = 1000
LAYOUT = FlatLayout.of(zeros(FEATURES))


async def _pause_accepts(dask_worker, key: str) -> None:
    """The holder's channel accepts nothing for now (as when its process is out of
    descriptors); connections wait in the listeners' queues."""
    server = dask_worker.state.actors[key]._channel
    for _, task in server._listening:
        task.cancel()
    await asyncio.gather(*(task for _, task in server._listening), return_exceptions=True)


async def _resume_accepts(dask_worker, key: str) -> None:
    server = dask_worker.state.actors[key]._channel
    loop = asyncio.get_running_loop()
    server._listening = [(listener, loop.create_task(server._accept(listener)))
                         for listener, _ in server._listening]


def test_a_worker_pushed_onto_the_actor_returns_to_the_channel(client, monkeypatch):
    # A connection is given up after one attempt: the holder takes none meanwhile.
    monkeypatch.setattr(client_module, "_RECONNECT_WITHIN", 0.5)
    ones = np.ones(FEATURES, np.float32)
    with holder_actor(client, FEATURES) as holder:
        address = holder._address
        holder.join(1, None, LAYOUT).result(timeout=30)  # opens the channel
        client.run(_pause_accepts, key=holder.key, workers=[address])
        handle = HolderHandle(holder, 30, client)
        try:
            handle.join(0, None, LAYOUT)
            assert handle.via == "actor"
            # Training goes on through the actor; a push begun bucket by bucket goes whole.
            outgoing = handle.begin_push(0, 1, 0.0, (0, 1), ones.copy())
            outgoing.ready(0)
            params, version = handle.wait(outgoing.finish(), "a push")
            assert version == 1 and np.array_equal(params, -ones)
            client.run(_resume_accepts, key=holder.key, workers=[address])
            # Back on the channel once an attempt in the background gets through (the first
            # a second after the fall back), with no push lost or repeated on the way.
            step, deadline = 1, time.monotonic() + 30
            while handle.via != "direct":
                assert time.monotonic() < deadline, "the worker never returned to the channel"
                params, version = handle.wait(handle.push(step, ones, 1, 0.0,
                                                          (0, step + 1)), "a push")
                assert version == step + 1 and np.array_equal(params, -(step + 1) * ones)
                step += 1
            assert handle.transport in ("shared", "local")
            params, version = handle.wait(handle.push(step, ones, 1, 0.0, (0, step + 1)),
                                          "a push")
            assert version == step + 1 and np.array_equal(params, -(step + 1) * ones)
        finally:
            handle.close()
        events = holder.progress().result(timeout=30)["events"]
        assert any("worker 0 pushes through the actor" in e for e in events), events
        assert any("worker 0 is back on the direct channel" in e for e in events), events


SIZE = 4


async def _echo(worker: int, incarnation: int, version: int, grads: np.ndarray | None,
                count: int, loss: float, position: tuple[int, int]) -> Lease:
    return Lease(np.zeros(SIZE, np.float32) if grads is None else grads.copy(), version + 1,
                 None)


def test_a_push_that_cannot_reconnect_says_nothing_was_sent():
    idle = 0.2
    with serve_channel(_echo, SIZE, idle_timeout=idle) as server:
        channel = ChannelClient(server.contact(0, 1), 0, SIZE, 10, lambda: True)
        try:
            ones = np.ones(SIZE, np.float32)
            assert channel.push(0, ones, 1, 0.0, (0, 1)).result()[1] == 1
            on_loop(server, server.stop_accepting)  # as a port closed by a firewall
            # Past half the idle deadline the next push connects afresh first, and fails
            # before sending a byte: its caller may push through the actor instead.
            channel._last_push -= idle
            with pytest.raises(ChannelUnavailable, match="cannot connect"):
                channel.push(1, ones, 1, 0.0, (0, 2))
        finally:
            channel.stop()
