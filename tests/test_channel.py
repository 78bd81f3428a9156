"""The direct channel between trainer workers and the holder, against a real holder actor in
another process: the same arithmetic as the actor's calls, refusals that name the problem
and leave the connection usable, and a fallback to the actor when the port is unreachable."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import dasktrain as dt
from dasktrain.trainer.channel import ChannelClient, PendingPush
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.handle import HolderHandle
from dasktrain.trainer.holder import ParameterHolder
from tests.common.training import zeros, zeros_holder

FEATURES = 1000
LAYOUT = FlatLayout.of(zeros(FEATURES))


@contextlib.contextmanager
def _holder_actor(client, mode: str):
    """A holder actor of two workers on a worker process (plain SGD, lr 1, from zero)."""
    future = client.submit(ParameterHolder, zeros_holder(FEATURES, workers=2, mode=mode),
                           actor=True, pure=False)
    actor = future.result(timeout=60)
    try:
        yield actor
    finally:
        actor.close().result(timeout=30)  # closing twice is harmless
        future.release()


@pytest.fixture
def holder(client):
    with _holder_actor(client, "async") as actor:
        yield actor


def _connect(client, holder, worker: int = 0, token: bytes | None = None,
             claim: int | None = None) -> ChannelClient:
    """Join as ``worker`` and connect, presenting ``token`` and worker ``claim`` when given."""
    info = holder.join(worker, None, LAYOUT).result(timeout=30)
    contact = dict(info["channel"])
    if token is not None:
        contact["token"] = token
    handle = HolderHandle(holder, 30, client)
    return ChannelClient(contact, worker if claim is None else claim, LAYOUT.size, 30,
                         handle.holder_alive)


def _push(channel: ChannelClient, version: int, value: float = 1.0) -> PendingPush:
    """Push a gradient of ``value`` everywhere, computed at ``version`` (batch of one)."""
    return channel.push(version, np.full(FEATURES, value, np.float32), 1, 0.0,
                        (0, version + 1))


def test_pushes_over_the_channel_update_the_holder_like_the_actor(client, holder):
    channel = _connect(client, holder)
    try:
        ones = np.ones(FEATURES, dtype=np.float32)
        for step in range(1, 6):
            params, version = channel.push(version=step - 1, grads=ones * step, count=4,
                                           loss=0.5, position=(0, step)).result(timeout=30)
            # SGD with lr 1: the parameters are minus the sum of the gradients so far.
            assert version == step
            assert np.array_equal(params, np.full(FEATURES, -step * (step + 1) / 2))
        # A step without a batch changes nothing in async mode and still answers.
        params, version = channel.push(5, None, 0, 0.0, (0, 5)).result(timeout=30)
        assert version == 5
        pulled, pulled_version = holder.pull().result(timeout=30)
        assert pulled_version == 5 and np.array_equal(pulled, params)
        report = holder.progress().result(timeout=30)
        assert report["records"]["loss"] == [0.5] * 5
        assert report["records"]["samples"] == [4] * 5
    finally:
        channel.close()


def test_a_wrong_token_is_refused_and_the_holder_goes_on(client, holder):
    with pytest.raises(dt.TrainerError, match="closed by the holder"):
        _connect(client, holder, token=bytes(16))
    channel = _connect(client, holder)
    try:
        assert _push(channel, 0).result(timeout=30)[1] == 1
    finally:
        channel.close()


def test_refused_pushes_name_the_problem_and_the_channel_goes_on(client, holder):
    channel = _connect(client, holder)
    try:
        wrong = np.ones(FEATURES + 3, dtype=np.float32)
        with pytest.raises(ValueError, match=f"pushed {FEATURES + 3} float32 values.*"
                                             "model differs from the holder's"):
            channel.push(0, wrong, 1, 0.0, (0, 1)).result(timeout=30)
        with pytest.raises(ValueError, match="1-D float32 array, got float64"):
            channel.push(0, np.ones(FEATURES), 1, 0.0, (0, 1))
        assert _push(channel, 0).result(timeout=30)[1] == 1
    finally:
        channel.close()


def test_a_push_from_an_unknown_worker_is_refused(client, holder):
    channel = _connect(client, holder, claim=7)
    try:
        with pytest.raises(ValueError, match="unknown worker 7"):
            _push(channel, 0).result(timeout=30)
    finally:
        channel.close()


def test_a_reconnecting_worker_replaces_its_old_connection(client, holder):
    old = _connect(client, holder)
    new = _connect(client, holder)  # as a restarted worker does
    try:
        with pytest.raises(dt.TrainerError, match="whose worker is still alive") as error:
            _push(old, 0).result(timeout=30)
        assert not isinstance(error.value, dt.HolderLost)
        assert _push(new, 0).result(timeout=30)[1] == 1
    finally:
        old.close()
        new.close()


def _until_waiting_for(holder, workers: list[int]) -> None:
    """Poll the holder until its pending update waits for exactly ``workers``."""
    deadline = time.monotonic() + 30
    while holder.progress().result(timeout=30)["waiting_for"] != workers:
        assert time.monotonic() < deadline, "the holder never got the push"


def test_a_worker_reconnecting_while_its_push_waits_on_the_barrier(client):
    with _holder_actor(client, "sync") as holder:
        first = _connect(client, holder, worker=0)
        waiting = _push(first, 0, 2.0)
        _until_waiting_for(holder, [1])
        again = _connect(client, holder, worker=0)  # worker 0 restarted meanwhile
        other = _connect(client, holder, worker=1)
        # Worker 0's gradient stays in the round; worker 1's completes it, and the barrier
        # the dropped connection waited on still answers everyone else.
        params, version = _push(other, 0, 4.0).result(timeout=30)
        assert version == 1 and np.array_equal(params, np.full(FEATURES, -3.0))
        with pytest.raises(dt.TrainerError, match="whose worker is still alive"):
            waiting.result(timeout=30)
        # The restarted worker takes part in the next round over its new connection.
        pending = _push(again, 1, 2.0)
        params, version = _push(other, 1, 2.0).result(timeout=30)
        assert version == 2 and np.array_equal(params, np.full(FEATURES, -5.0))
        assert pending.result(timeout=30)[1] == 2
        for channel in (first, again, other):
            channel.close()


def test_a_push_waiting_when_the_holder_closes_fails_clearly(client):
    with _holder_actor(client, "sync") as holder:
        channel = _connect(client, holder)
        # Worker 1 never pushes: the sync step waits for it until the holder closes.
        pending = _push(channel, 0)
        holder.close().result(timeout=30)
        with pytest.raises(dt.TrainerError, match="closed"):
            pending.result(timeout=30)
        channel.close()


async def _stop_accepting(dask_worker, key: str) -> None:
    await dask_worker.state.actors[key]._channel.stop_accepting()


def test_a_worker_that_cannot_reach_the_channel_pushes_through_the_actor(client, holder):
    address = holder._address
    handle = HolderHandle(holder, 30, client)
    handle.join(0, None, LAYOUT)
    assert handle.via == "direct"
    handle.close()
    # As behind a firewall that lets Dask's ports through and not the holder's own.
    client.run(_stop_accepting, key=holder.key, workers=[address])
    handle = HolderHandle(holder, 30, client)
    info = handle.join(0, None, LAYOUT)
    assert info["channel"] is not None and handle.via == "actor"
    params, version = handle.wait(handle.push(0, 0, np.ones(FEATURES, np.float32), 1, 0.0,
                                              (0, 1)), "a push")  # through the actor
    assert version == 1 and np.array_equal(params, -np.ones(FEATURES))
