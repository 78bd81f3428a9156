"""Memory shared between a worker and the holder on one host: the holder maps only a sealed
file of the payload's size, a push over it moves the worker's own memory (no bytes on the
socket), a holder that does not take it gets bytes, and a model moved into it keeps its
values and trains in place. End to end (every mode, sync equal to one process, killed
processes) the trainer's tests run over it, since it is the default on a LocalCluster."""

from __future__ import annotations

import contextlib
import os
import socket

import numpy as np
import pytest
import torch

from dasktrain.trainer.errors import TrainerError
from dasktrain.trainer.exchange import shared, transfer
from dasktrain.trainer.exchange.client import ChannelClient
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.holder import ParameterHolder
from dasktrain.trainer.holder.arithmetic import INLINE_SIZE, Lease
from tests.common.builders import wait_for
from tests.common.channel import on_loop, serve_channel
from tests.common.training import zeros_holder

SIZE = 1000
# Replies this large are copied into the region on the channel's threads, not on its loop.
THREADED = transfer._COPY_INLINE_BYTES // 4 + 1

pytestmark = pytest.mark.skipif(not shared.supported(), reason="Linux memory files only")


def _offered(fd: int | None, size: int = SIZE) -> shared.Regions | None:
    """What the holder's side makes of offering ``fd`` for payloads of ``size`` values."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        shared.offer(a, fd, size)
        return shared.receive_offer(b, SIZE, timeout=5)


def test_the_holder_maps_only_a_sealed_file_of_the_payload_size():
    fd, regions = shared.create(SIZE)
    try:
        regions.payload[:] = np.arange(SIZE)
        mapped = _offered(fd)
        assert mapped is not None
        # The same memory, seen through another mapping.
        assert np.array_equal(mapped.payload, np.arange(SIZE))
        mapped.reply[:] = 7.0
        assert (regions.reply == 7.0).all()
        assert _offered(fd, size=SIZE + 1) is None  # another model's size
    finally:
        os.close(fd)
    assert _offered(None) is None  # nothing offered
    loose = os.memfd_create("unsealed")  # could be truncated under the holder's mapping
    try:
        os.ftruncate(loose, 8 * SIZE)
        assert _offered(loose) is None
    finally:
        os.close(loose)


class _Recorder:
    """A holder's push that keeps each payload it was handed (not a copy) and echoes it."""

    def __init__(self, size: int) -> None:
        self.seen: list[np.ndarray | None] = []
        self.params = np.zeros(size, np.float32)

    async def __call__(self, worker, incarnation, version, grads, count, loss, position) -> Lease:
        self.seen.append(grads)
        if grads is not None:
            self.params = grads.copy()
        return Lease(self.params, version + 1, None)


@pytest.mark.parametrize("size", [SIZE, THREADED], ids=["reply copied on the loop",
                                                        "reply copied on a thread"])
def test_a_push_over_shared_memory_hands_the_holder_the_workers_own_memory(size):
    recorder = _Recorder(size)
    with serve_channel(recorder, size) as server:
        channel = ChannelClient(server.contact(0, 1), 0, size, 10, lambda: True)
        try:
            assert channel.shared is not None
            regions = channel.shared
            channel.receive_into(regions.reply)
            regions.payload[:] = np.arange(size, dtype=np.float32)
            params, version = channel.push(0, regions.payload, 1, 0.0, (0, 1)).result(10)
            # The reply was written into the region the worker reads, nothing copied here.
            assert params is regions.reply and version == 1
            assert np.array_equal(params, np.arange(size, dtype=np.float32))
            # The holder read the worker's memory itself: a later write shows through.
            regions.payload[0] = -1.0
            assert recorder.seen[-1][0] == -1.0
            # A payload elsewhere is copied in first, and goes the same way.
            other = np.full(size, 3.0, np.float32)
            params, _ = channel.push(1, other, 1, 0.0, (0, 2)).result(10)
            assert (params == 3.0).all() and (recorder.seen[-1] == 3.0).all()
            # A push without a batch carries nothing, and still gets the parameters.
            params, _ = channel.push(2, None, 0, 0.0, (0, 3)).result(10)
            assert recorder.seen[-1] is None and (params == 3.0).all()
            # Sending in buckets would have the holder read a payload still being written.
            with pytest.raises(TrainerError, match="not sent bucket by bucket"):
                channel.begin(3, 1, 0.0, (0, 4), regions.payload)
        finally:
            channel.stop()


def test_a_holder_that_does_not_share_memory_gets_the_bytes():
    recorder = _Recorder(SIZE)
    with serve_channel(recorder, SIZE, shared_memory=False) as server:
        assert server.contact(0, 1)["shared"] is False
        contact = dict(server.contact(0, 1), shared=True)  # offered anyway: declined
        channel = ChannelClient(contact, 0, SIZE, 10, lambda: True)
        try:
            assert channel.shared is None and channel.transport == "local"
            payload = np.arange(SIZE, dtype=np.float32)
            params, _ = channel.push(0, payload, 1, 0.0, (0, 1)).result(10)
            assert np.array_equal(params, payload)
            payload[0] = -1.0  # the holder has its own copy of the bytes
            assert recorder.seen[-1][0] == 0.0
        finally:
            channel.stop()


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 1))


def test_a_model_moved_into_shared_regions_keeps_its_values_and_trains_in_place():
    flat, reference = FlatModel(_net()), _net()
    x = torch.randn(16, 4)
    reference(x).sum().backward()
    flat.model(x).sum().backward()
    fd, regions = shared.create(flat.layout.size)
    try:
        assert flat.adopt(regions.payload, regions.reply)
        # Values kept: the state, the gradients just computed, the running statistics.
        assert np.array_equal(regions.reply, flat.state())
        for p, q in zip(flat.model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        # Backward now writes where the holder reads.
        flat.zero_grad()
        flat.model(x).sum().backward()
        assert flat.payload().ctypes.data == regions.payload.ctypes.data  # no copy
        assert np.array_equal(regions.payload[: flat.layout.num_params],
                              torch.cat([p.grad.reshape(-1)
                                         for p in reference.parameters()]).numpy())
        # Parameters written into the reply region are the model's, with no load.
        regions.reply[: flat.layout.num_params] = 0.5
        assert all((p == 0.5).all() for p in flat.model.parameters())
        assert flat.receive_buffer() is regions.reply
    finally:
        os.close(fd)


def test_a_model_of_the_wrong_size_is_not_moved():
    flat = FlatModel(_net())
    fd, regions = shared.create(flat.layout.size + 1)
    try:
        before = flat.state()
        assert not flat.adopt(regions.payload, regions.reply)
        assert np.array_equal(flat.state(), before)
    finally:
        os.close(fd)


def _holder_on(features: int, workers: int, mode: str):
    async def make():
        holder = ParameterHolder(zeros_holder(features, workers=workers, mode=mode))
        for w in range(workers):
            await holder.join(w, None, holder.layout)
        return holder
    return make


def _shares(holder, region: np.ndarray) -> bool:
    return np.shares_memory(holder._arith.flat.numpy(), region)


@contextlib.contextmanager
def _holder_sharing_memory(workers: int, mode: str = "sync", size: int = SIZE):
    """A holder of ``size`` zeros (plain SGD at lr 1) behind a channel server that tells it
    of each connection's reply region; with the holder's own mapping of each region, by
    (worker, incarnation)."""
    box: dict = {"regions": {}}

    async def push(*args):  # the holder's exchange, once it exists
        return await box["holder"].exchange(*args)

    def reply_region(worker, incarnation, region, attached):
        box["regions"][worker, incarnation] = region
        box["holder"]._arith.region_shared(worker, incarnation, region, attached)

    with serve_channel(push, size, shared_reply=reply_region) as server:
        holder = box["holder"] = on_loop(server, _holder_on(size, workers, mode))
        try:
            yield server, holder, box["regions"]
        finally:
            on_loop(server, holder.close)


def _parameters(server, holder) -> np.ndarray:
    params, _ = on_loop(server, holder.pull)
    return params


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_holder_keeps_its_parameters_in_the_model_of_a_worker_sharing_memory(mode):
    """Its replies then cost no copy: the update lands in the worker's model in place, and
    never while the worker reads it (the reply's lease is kept until its next push)."""
    workers = 1 if mode == "sync" else 2
    with _holder_sharing_memory(workers, mode) as (server, holder, regions_of):

        def shares() -> bool:  # the holder's parameters lie in the worker's model
            return on_loop(server, _async(_shares, holder, regions_of[0, 1]))

        channel = ChannelClient(server.contact(0, 1), 0, SIZE, 10, lambda: True)
        try:
            regions = channel.shared
            assert regions is not None
            channel.receive_into(regions.reply)
            regions.payload[:] = 1.0
            params, version = channel.push(0, regions.payload, 1, 0.0, (0, 1)).result(10)
            assert params is regions.reply and version == 1
            assert (params == -1.0).all() and shares()
            if mode == "sync":
                params, version = channel.push(1, regions.payload, 1, 0.0, (0, 2)).result(10)
                assert version == 2 and (params == -2.0).all()
                assert shares()  # written in place
            else:
                # Worker 1's updates while worker 0 reads its model go elsewhere.
                for step in range(3):
                    on_loop(server, lambda s=step: holder.push(
                        1, 1, 1 + s, np.full(SIZE, 2.0, np.float32), 1, 0.0, (0, s + 1)))
                assert (regions.reply == -1.0).all()
                assert not shares()
                # Worker 0's next reply brings the parameters back into its model.
                params, version = channel.push(1, regions.payload, 1, 0.0, (0, 2)).result(10)
                assert version == 5 and (params == -8.0).all()
                assert shares()
        finally:
            channel.stop()


def test_a_superseded_incarnations_reply_stays_out_of_its_successors_model():
    """Worker 1's process goes (retired, say) while its push waits in a ``sync`` round; its
    task, run again elsewhere, connects with memory of its own and moves its model there,
    with the parameters it joined with. The round, applied with the first push (see
    :mod:`dasktrain.trainer.modes.rounds`), answers that push: the reply must not move the
    holder's parameters into the successor's model, where they would be overwritten by
    older ones (the round's update lost)."""
    with _holder_sharing_memory(2) as (server, holder, regions_of):
        first = ChannelClient(server.contact(1, 1), 1, SIZE, 10, lambda: True)
        second = None
        try:
            first.receive_into(first.shared.reply)
            first.shared.payload[:] = 1.0
            waiting = first.push(0, first.shared.payload, 1, 0.0, (0, 1))
            wait_for(lambda: on_loop(server, holder.progress)["waiting_for"] == [0], 10,
                     "worker 1's push waits in the round")
            joined = on_loop(server, lambda: holder.join(1, None, holder.layout))
            assert joined["incarnation"] == 2 and joined["version"] == 0
            second = ChannelClient(server.contact(1, 2), 1, SIZE, 10, lambda: True)
            wait_for(lambda: (1, 2) in regions_of, 10, "the second incarnation's region")
            # The round is applied; the first push's answer (on the holder's loop, woken with
            # this push's) finds its connection closed for the newer one.
            on_loop(server, lambda: holder.push(0, 1, 0, np.ones(SIZE, np.float32), 1, 0.0,
                                                (0, 1)))
            with pytest.raises(TrainerError, match="closed by the holder"):
                waiting.result(10)
            second.shared.reply[:] = joined["params"]  # its model moves in (as FlatModel.adopt)
            assert (_parameters(server, holder) == -1.0).all()
        finally:
            for channel in (first, second):
                if channel is not None:
                    channel.stop()


@pytest.mark.parametrize("size", [SIZE, INLINE_SIZE + 1],
                         ids=["updates on the loop", "updates on the holder's thread"])
@pytest.mark.parametrize("how", ["dropped", "disconnected"])
def test_the_holders_parameters_leave_the_model_of_a_worker_it_let_go(how, size):
    """Kept in a worker's model (its last reply's), the holder's parameters leave it once
    the holder drops that worker (silent, say) or its connection ends: its process may live
    on and write there (a reply that came through the actor, the parameters of its
    rejoin)."""
    with _holder_sharing_memory(1, size=size) as (server, holder, regions_of):
        channel = ChannelClient(server.contact(0, 1), 0, size, 10, lambda: True)
        try:
            channel.receive_into(channel.shared.reply)
            channel.shared.payload[:] = 1.0
            channel.push(0, channel.shared.payload, 1, 0.0, (0, 1)).result(10)
            region = regions_of[0, 1]  # the holder's own mapping of the worker's model
            assert on_loop(server, _async(_shares, holder, region))
            if how == "dropped":
                on_loop(server, lambda: holder.drop(0, "silent"))
            else:
                channel.stop()
            wait_for(lambda: not on_loop(server, _async(_shares, holder, region)), 10,
                     "the parameters to leave the worker's model")
            region[:] = 5.0  # what its process may write from now on
            assert (_parameters(server, holder) == -1.0).all()
        finally:
            channel.stop()


def _async(fn, *args):
    async def call():
        return fn(*args)
    return call
