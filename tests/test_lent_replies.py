"""A trainer worker in the parameter holder's own process computes on the holder's
parameters themselves: replies are lent, not copied (``HolderHandle.lend_replies``,
``FlatModel.view``). Checked on a real holder actor in a worker process: in ``sync`` the
update writes in place into the memory the worker's model views, and never while the
worker still reads it; in ``async`` another worker's update leaves a lent reply as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster, get_worker

from dasktrain._cluster import NO_DASHBOARD
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.holder import ParameterHolder
from tests.common.training import zeros, zeros_holder

F32 = np.float32
FEATURES = 6


def _holders_parameters(actor) -> np.ndarray:
    """The holder's own parameters (it runs in this process)."""
    return get_worker().state.actors[actor.key]._arith.flat.numpy()


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1",
                      **NO_DASHBOARD) as cluster, Client(cluster) as client:
        yield client


def _sync_steps(actor, steps: int) -> dict:
    """As a worker beside the holder: join, then push ``steps`` gradients of ones, the
    model viewing each reply; what it saw."""
    handle = HolderHandle(actor, timeout=30)
    lent = handle.lend_replies()
    flat = FlatModel(zeros(FEATURES))
    info = handle.join(0, None, flat.layout)
    flat.view(info["params"])
    seen, replies = [], []
    version = int(info["version"])
    for step in range(steps):
        future = handle.push(version, np.ones(FEATURES, F32), 1, 0.0, (0, step + 1))
        params, version = handle.wait(future, "a push")
        flat.view(params)
        replies.append(params)
        weight = flat.model.weight
        seen.append({"address": params.ctypes.data, "values": params.copy(),
                     "holders": np.shares_memory(params, _holders_parameters(actor)),
                     "viewed": weight.data_ptr() == params.ctypes.data,
                     "weight": weight.detach().reshape(-1).clone().numpy()})
    handle.close()
    # The first reply, as the worker got it, now shows the last values: updated in place.
    return {"lent": lent, "seen": seen, "first_now": replies[0].copy()}


def test_in_sync_the_worker_beside_the_holder_views_the_parameters_updated_in_place(client):
    actor = client.submit(ParameterHolder, zeros_holder(FEATURES, workers=1, mode="sync"),
                          actor=True).result()
    out = client.submit(_sync_steps, actor, 4, pure=False).result()
    assert out["lent"]
    seen = out["seen"]
    # SGD at lr 1 from zeros with gradients of ones: -1, -2, -3, -4; the model reads them.
    for k, s in enumerate(seen):
        np.testing.assert_array_equal(s["values"], np.full(FEATURES, -(k + 1.0), F32))
        np.testing.assert_array_equal(s["weight"], s["values"])
        assert s["viewed"] and s["holders"]
    # One buffer throughout: each update wrote where the model looks, copying nothing.
    assert len({s["address"] for s in seen}) == 1
    np.testing.assert_array_equal(out["first_now"], seen[-1]["values"])


def _async_lender(actor) -> dict:
    """Worker 0 beside the holder holds a lent reply while worker 1's pushes are applied;
    then pushes itself."""
    mine = HolderHandle(actor, timeout=30)
    other = HolderHandle(actor, timeout=30)
    assert mine.lend_replies()
    flat = FlatModel(zeros(FEATURES))
    mine.join(0, None, flat.layout)
    other.join(1, None, flat.layout)
    ones = np.ones(FEATURES, F32)
    held, version = mine.wait(mine.push(0, ones, 1, 0.0, (0, 1)), "worker 0's push")
    flat.view(held)
    before = held.copy()
    holders_then = np.shares_memory(held, _holders_parameters(actor))
    for step in range(3):  # worker 1, whose replies are copied as ever
        params, _ = other.wait(other.push(version + step, 2 * ones, 1, 0.0, (0, step + 1)),
                               "worker 1's push")
    after_others = held.copy()
    holders_after = np.shares_memory(held, _holders_parameters(actor))
    newest, last = mine.wait(mine.push(version, ones, 1, 0.0, (0, 2)), "worker 0's push")
    mine.close()
    other.close()
    return {"before": before, "after_others": after_others, "others_last": params,
            "newest": newest.copy(), "version": last, "holders_then": holders_then,
            "holders_after": holders_after}


def test_in_async_a_lent_reply_is_not_written_while_the_worker_reads_it(client):
    actor = client.submit(ParameterHolder, zeros_holder(FEATURES, workers=2, mode="async"),
                          actor=True).result()
    out = client.submit(_async_lender, actor, pure=False).result()
    np.testing.assert_array_equal(out["before"], np.full(FEATURES, -1.0, F32))
    assert out["holders_then"] and not out["holders_after"]  # lent, then copied on write
    # Worker 1's three updates (-2 each) went elsewhere: the lent memory kept version 1.
    np.testing.assert_array_equal(out["after_others"], out["before"])
    np.testing.assert_array_equal(out["others_last"], np.full(FEATURES, -7.0, F32))
    # Worker 0's stale push is applied on top of them, then lent again.
    assert out["version"] == 5
    np.testing.assert_array_equal(out["newest"], np.full(FEATURES, -8.0, F32))


def test_a_model_with_buffers_or_another_device_copies_its_replies():
    with_buffer = torch.nn.BatchNorm1d(3)
    flat = FlatModel(with_buffer)
    assert not flat.can_view()
    with pytest.raises(RuntimeError, match="buffers"):
        flat.view(np.zeros(flat.layout.size, F32))
    plain = FlatModel(zeros(FEATURES))
    assert plain.can_view()
    with pytest.raises(ValueError, match="float32"):
        plain.view(np.zeros(FEATURES + 1, F32))
    read_only = np.zeros(FEATURES, F32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError):
        plain.view(read_only)
