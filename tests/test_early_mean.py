"""A ``sync`` round's mean begun while its last payload still arrives over the channel (see
:mod:`dasktrain.trainer.holder.early`): the same bits as the mean the update computes, slices
read only once they are in, and a mean begun for another round never taken."""

from __future__ import annotations

import functools
import os
import threading

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.exchange.buckets import bucket_order
from dasktrain.trainer.exchange.client import ChannelClient
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.exchange.landing import Landing
from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.holder.actor import ParameterHolder
from dasktrain.trainer.holder.arithmetic import Arithmetic
from dasktrain.trainer.holder.config import HolderConfig
from dasktrain.trainer.holder.early import EARLY_VALUES, lower_priority
from tests.common.channel import until_waiting_for
from tests.common.training import mlp

MODEL = functools.partial(mlp, 1024, 1024, 64)  # 1,115,200 parameters in 4 tensors
OPTIMIZER = dt.optim.sgd(0.1, momentum=0.9)
BUCKET_BYTES = 1  # every tensor a bucket of its own: 4 slices


def _arithmetic() -> Arithmetic:
    flat = FlatModel(MODEL())
    return Arithmetic(flat.layout, flat.state(), OPTIMIZER, None)


def _layout() -> FlatLayout:
    return FlatLayout.of(MODEL())


def _gradients(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size, dtype=np.float32)


def _round(seed: int) -> tuple[Landing, np.ndarray, np.ndarray, np.ndarray]:
    """A landing over the test model's bucket order, a whole payload, the values of one
    still to arrive, and the (empty) buffer it arrives into."""
    layout = _layout()
    landing = Landing(bucket_order(layout, layout.size, BUCKET_BYTES))
    return (landing, _gradients(seed, layout.size), _gradients(seed + 1, layout.size),
            np.zeros(layout.size, dtype=np.float32))


def _feed(landing: Landing, into: np.ndarray, values: np.ndarray) -> threading.Thread:
    """A thread that writes ``values`` into ``into`` slice by slice, telling ``landing`` of
    each only once it is written, as the channel's receive does."""
    def run() -> None:
        for index, (start, stop) in enumerate(landing.order):
            into[start:stop] = values[start:stop]
            landing.landed(index)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_model_of_this_test_is_large_enough_to_be_averaged_early():
    layout = _layout()
    assert layout.size >= EARLY_VALUES
    assert len(bucket_order(layout, layout.size, BUCKET_BYTES)) == 4


@pytest.mark.parametrize("landed", ["while it runs", "before it begins"])
def test_a_mean_begun_as_slices_land_is_the_update_s_mean_bit_for_bit(landed):
    landing, whole, late, arriving = _round(0)
    early, plain = _arithmetic(), _arithmetic()
    try:
        if landed == "before it begins":
            # Averaged at once: the update mostly takes over from a mean still running.
            _feed(landing, arriving, late).join()
        early.begin_mean([whole, arriving], [3.0, 5.0], [None, landing])
        _feed(landing, arriving, late).join()
        mean = early.average([whole, arriving], [3.0, 5.0])
        assert early.early_means == 1
        expected = plain.average([whole, late], [3.0, 5.0])
        # Read only once in: a slice read early would still hold zeros.
        assert torch.equal(mean, expected)
        assert early.all_finite(mean)
        # The same step follows.
        early.step(mean)
        plain.step(expected)
        assert torch.equal(early.flat, plain.flat)
    finally:
        early.close()
        plain.close()


def test_a_value_that_is_not_finite_in_the_last_slice_fails_the_check():
    landing, whole, late, arriving = _round(2)
    late[landing.order[-1][0]] = np.inf
    arithmetic = _arithmetic()
    try:
        arithmetic.begin_mean([whole, arriving], [1.0, 1.0], [None, landing])
        _feed(landing, arriving, late).join()
        mean = arithmetic.average([whole, arriving], [1.0, 1.0])
        assert arithmetic.early_means == 1
        assert not arithmetic.all_finite(mean)
    finally:
        arithmetic.close()


@pytest.mark.parametrize("change", ["weights", "payloads", "overflow-safe"])
def test_a_mean_begun_for_another_round_is_not_taken(change):
    landing, whole, late, arriving = _round(4)
    arithmetic, plain = _arithmetic(), _arithmetic()
    try:
        arithmetic.begin_mean([whole, arriving], [2.0, 2.0], [None, landing])
        _feed(landing, arriving, late).join()
        payloads, weights, safe = [whole, arriving], [2.0, 2.0], False
        if change == "weights":
            weights = [2.0, 1.0]
        elif change == "payloads":
            payloads = [whole, late]  # equal values, another buffer
        else:
            safe = True  # the update's second try, after a refusal
        mean = arithmetic.average(payloads, weights, overflow_safe=safe)
        assert arithmetic.early_means == 0
        assert torch.equal(mean, plain.average(payloads, weights, overflow_safe=safe))
    finally:
        arithmetic.close()
        plain.close()


def test_a_transfer_that_fails_stops_the_mean_and_the_update_computes_its_own():
    landing, whole, late, arriving = _round(6)
    arithmetic, plain = _arithmetic(), _arithmetic()
    try:
        arithmetic.begin_mean([whole, arriving], [1.0, 1.0], [None, landing])
        start, stop = landing.order[0]
        arriving[start:stop] = late[start:stop]
        landing.landed(0)
        landing.fail()  # the rest never comes; the push is received again, whole
        arriving[:] = late
        mean = arithmetic.average([whole, arriving], [1.0, 1.0])
        assert arithmetic.early_means == 0
        assert torch.equal(mean, plain.average([whole, late], [1.0, 1.0]))
    finally:
        arithmetic.close()
        plain.close()


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no thread priorities here")
def test_the_early_mean_s_thread_runs_at_the_lowest_priority():
    niceness = []

    def run() -> None:
        lower_priority()
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert niceness == [19]


def test_closing_stops_a_mean_still_waiting_for_its_slices():
    landing, whole, _, arriving = _round(8)
    arithmetic = _arithmetic()
    arithmetic.begin_mean([whole, arriving], [1.0, 1.0], [None, landing])
    arithmetic.close()  # returns once the mean stopped: nothing lands, nothing fails


# -- over the channel, against a holder in another process ------------------------------
@pytest.fixture
def holder(client):
    config = HolderConfig(model=MODEL, optimizer=OPTIMIZER, workers=2, mode="sync",
                          bucket_bytes=BUCKET_BYTES)
    future = client.submit(ParameterHolder, config, actor=True, pure=False)
    actor = future.result(timeout=60)
    try:
        yield actor
    finally:
        actor.close().result(timeout=30)
        future.release()


def _connect(client, holder, worker: int) -> ChannelClient:
    """Join as ``worker`` and connect, with the payload's bytes on the socket (no memory
    shared with the holder, as a worker on another host)."""
    contact = dict(holder.join(worker, None, _layout()).result(timeout=30)["channel"])
    contact["shared"] = False
    handle = HolderHandle(holder, 30, client)
    return ChannelClient(contact, worker, _layout().size, 30, handle.holder_alive)


def test_sync_rounds_whose_last_push_streams_in_are_averaged_early_to_the_same_bits(
        client, holder):
    layout = _layout()
    first, second = _connect(client, holder, 0), _connect(client, holder, 1)
    reference = _arithmetic()
    steps = 3
    try:
        for step in range(steps):
            whole, streamed = _gradients(10 + step, layout.size), _gradients(20 + step,
                                                                              layout.size)
            # Worker 1's push begins, all but its last bucket on the way; worker 0's comes
            # whole. The round then waits only for worker 1's last bucket.
            outgoing = second.begin(step, 5, 0.25, (0, step + 1), streamed)
            for bucket in range(len(second.order) - 1):
                outgoing.ready(bucket)
            pending = first.push(step, whole, 3, 0.5, (0, step + 1))
            until_waiting_for(holder, [1])
            params, version = outgoing.finish().result(30)
            params_first, version_first = pending.result(30)
            mean = reference.average([whole, streamed], [3.0, 5.0])
            assert reference.all_finite(mean)
            reference.step(mean)
            assert version == version_first == step + 1
            assert np.array_equal(params, reference.flat.numpy())
            assert np.array_equal(params_first, params)
        assert holder.progress().result(timeout=30)["early_means"] == steps
    finally:
        reference.close()
        first.stop()
        second.stop()
