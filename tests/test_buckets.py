"""Gradients sent in buckets during backward: the order both sides agree on, the hooks that
say when a bucket is final, the channel carrying a payload piece by piece to the same bytes,
and whole trainings whose gradients left in many buckets equal one process."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.exchange.buckets import GradientReadiness, bucket_order
from dasktrain.trainer.exchange.client import ChannelClient
from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.holder.arithmetic import Lease
from tests.common.channel import serve_channel
from tests.common.training import flat_parameters, mse, one_process


def _net(seed: int = 0, unused: bool = False, norm: bool = True) -> torch.nn.Module:
    """Linear layers of several sizes, a batch norm (buffers; not in the comparisons with
    one process, where per-worker batch statistics would differ), and optionally a layer
    that takes no part in forward."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 32), torch.nn.BatchNorm1d(32) if norm else torch.nn.Identity(),
              torch.nn.Tanh(), torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)]
    return _WithSpare(layers) if unused else torch.nn.Sequential(*layers)


class _WithSpare(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*layers)
        self.spare = torch.nn.Linear(3, 3)  # registered, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _tensor_bytes(layout: FlatLayout) -> list[int]:
    return [(stop - start) * 4 for _, start, stop, _ in layout.param_segments()]


@pytest.mark.parametrize("bucket_bytes", [1, 600, 9000, 1 << 30])
def test_the_order_tiles_the_payload_last_tensors_first_buffers_last(bucket_bytes):
    layout = FlatLayout.of(_net())
    order = bucket_order(layout, layout.size, bucket_bytes)
    # Every value once, in one slice.
    covered = np.zeros(layout.size, dtype=int)
    for start, stop in order:
        covered[start:stop] += 1
    assert (covered == 1).all()
    *params, buffers = order
    assert buffers == (layout.num_params, layout.size)
    # Parameters travel from the end towards the start, in whole tensors.
    assert [s for s, _ in params] == sorted((s for s, _ in params), reverse=True)
    boundaries = {0} | {stop for _, _, stop, _ in layout.param_segments()}
    assert all(s in boundaries and e in boundaries for s, e in params)
    # Each bucket but the first-layer remainder reaches the size; none is cut needlessly.
    for start, stop in params[:-1]:
        assert (stop - start) * 4 >= bucket_bytes
    if bucket_bytes == 1:
        assert len(params) == len(layout.params)
    if bucket_bytes == 1 << 30:
        assert params == [(0, layout.num_params)]


def test_a_payload_with_optimizer_state_travels_in_one_piece():
    layout = FlatLayout.of(_net())
    assert bucket_order(layout, layout.size + 10, 1) == ((0, layout.size + 10),)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        bucket_order(layout, layout.size, 0)


def test_each_bucket_is_reported_once_its_gradients_are_final():
    flat = FlatModel(_net(unused=True))
    order = bucket_order(flat.layout, flat.layout.size, 1)  # one bucket per tensor
    params = [p for _, p in flat.model.named_parameters()]
    readiness = GradientReadiness(params, flat.layout, order)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    seen: dict[int, np.ndarray] = {}
    reported: list[int] = []

    def ready(bucket: int) -> None:
        start, stop = order[bucket]
        reported.append(bucket)
        seen[bucket] = flat.payload()[start:stop].copy()  # as it is when reported

    for _ in range(2):  # hooks work step after step
        flat.zero_grad()
        seen.clear()
        reported.clear()
        loss = mse(flat.model(x), y)
        readiness.arm(ready)  # after forward, as the worker does: buffers are final
        loss.backward()
        readiness.disarm()
        final = flat.payload()
        # Everything but the unused layer's two tensors is reported: the buffers first (final
        # since forward), then layer by layer from the last (a layer's weight and bias in
        # either order), so the first buckets to travel are the first to be ready.
        spare = {i for i, (name, *_) in enumerate(flat.layout.param_segments())
                 if name.startswith("spare")}
        spare_buckets = {i for i, (s, e) in enumerate(order)
                         if any(flat.layout.param_segments()[k][1] == s for k in spare)}
        assert sorted(reported) == sorted(set(range(len(order))) - spare_buckets)
        assert reported[0] == len(order) - 1
        layers = [sorted(reported[i:i + 2]) for i in range(1, len(reported), 2)]
        assert layers == sorted(layers)
        for bucket, values in seen.items():
            start, stop = order[bucket]
            assert np.array_equal(values, final[start:stop]), f"bucket {bucket} changed"
    readiness.remove()


SIZE = 1000
ORDER = ((700, 1000), (300, 700), (0, 300))


async def _echo(worker, incarnation, version, grads, count, loss, position) -> Lease:
    return Lease(grads.copy(), version + 1, None)


def _server():
    # Bytes on the socket: a worker sharing memory with the holder sends no buckets.
    return serve_channel(_echo, SIZE, order=ORDER, shared_memory=False)


@pytest.mark.parametrize("marks", [[0, 1, 2], [2, 1, 0], [1], []])
def test_a_streamed_push_arrives_as_the_same_payload(marks):
    with _server() as server:
        contact = server.contact(0, 1)
        assert contact["order"] == ORDER
        channel = ChannelClient(contact, 0, SIZE, 10, lambda: True)
        try:
            for step in range(3):
                payload = np.arange(SIZE, dtype=np.float32) * (step + 1)
                outgoing = channel.begin(step, 1, 0.0, (0, step + 1), payload)
                for bucket in marks:  # in any order; finish sends what is left
                    outgoing.ready(bucket)
                params, version = outgoing.finish().result(10)
                assert version == step + 1
                assert np.array_equal(params, payload)
                # The plain push on the same connection goes in the same order.
                params, _ = channel.push(step, payload * 2, 1, 0.0, (0, step + 1)).result(10)
                assert np.array_equal(params, payload * 2)
        finally:
            channel.stop()


def test_a_streamed_reply_lands_bucket_by_bucket_into_the_same_parameters():
    with _server() as server:
        into = np.zeros(SIZE, dtype=np.float32)
        channel = ChannelClient(server.contact(0, 1), 0, SIZE, 10, lambda: True, into=into)
        channel.stream_replies = True
        try:
            for step in range(3):
                payload = np.arange(SIZE, dtype=np.float32) * (step + 1)
                params, version = channel.push(step, payload, 1, 0.0, (0, 1)).result(10)
                assert params is into and version == step + 1
                arrival = channel.arrival
                assert arrival is not None  # received on the channel's thread
                for bucket in range(len(ORDER)):  # first layers first: the reverse order
                    arrival.wait(bucket)
                    start, stop = ORDER[len(ORDER) - 1 - bucket]
                    assert np.array_equal(into[start:stop], payload[start:stop])
                assert arrival.complete
                # the next push waits for the last reply by itself (here, already in)
        finally:
            channel.stop()


def test_a_streamed_push_to_a_server_gone_fails_naming_the_holder():
    with _server() as server:
        channel = ChannelClient(server.contact(0, 1), 0, SIZE, 10, lambda: False)
    # The server is closed: the sends fail, and the header's send or finish says so (which
    # of the two depends on when the socket notices), naming the holder's worker.
    try:
        with pytest.raises(dt.HolderLost, match=r"parameter holder's worker .* died"):
            outgoing = channel.begin(0, 1, 0.0, (0, 1), np.zeros(SIZE, np.float32))
            outgoing.finish().result(10)
    finally:
        channel.stop()


@pytest.mark.parametrize("unused", [False, True])
def test_sync_with_a_gradient_in_many_buckets_equals_one_process(client, regression, unused):
    make = functools.partial(_net, unused=unused, norm=False)
    config = dt.optim.sgd(0.05, momentum=0.9)
    trainer = dt.Trainer(make, mse, config, mode="sync", workers=2, batch_size=16,
                         bucket_bytes=1, shared_memory=False, progress=False)
    history = trainer.fit(regression, epochs=1, client=client)
    record = history.epochs[0]
    assert record["exchange_via"] == {"local": 1, "direct": 1}
    # The worker beside the holder hands its gradient over in place; the other one sent
    # every gradient bucket by bucket during backward.
    assert sorted(w["pushes_in_buckets"] for w in record["per_worker"]) == [0, 10]
    # and received its replies bucket by bucket while its next forward pass began.
    assert sorted(w["replies_streamed"] for w in record["per_worker"]) == [False, True]
    # The worker beside the holder computed on the holder's parameters themselves.
    assert sorted(w["replies_viewed"] for w in record["per_worker"]) == [False, True]
    expected = one_process(regression, make, config, 32, 1, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
