"""The direct channel between trainer workers and the holder, against a real holder actor in
another process: the same arithmetic as the actor's calls, refusals that name the problem
and leave the connection usable, and a fallback to the actor when the port is unreachable;
then the channel's defences (a flood of connections, a worker's token used as another's, a
connection gone silent), some against a :class:`ChannelServer` on an event loop of the test's
own."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import time

import numpy as np
import pytest

import dasktrain as dt
from dasktrain.trainer.exchange import client as client_module
from dasktrain.trainer.exchange import server as server_module
from dasktrain.trainer.exchange import transfer
from dasktrain.trainer.exchange.client import ChannelClient, PendingPush
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.exchange.protocol import HELLO, PUSH
from dasktrain.trainer.exchange.reconnect import ChannelRefused
from dasktrain.trainer.exchange.server import ChannelServer
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.arithmetic import Lease
from tests.common.channel import holder_actor, serve_channel, until_waiting_for
from tests.common.training import zeros

FEATURES = 1000
LAYOUT = FlatLayout.of(zeros(FEATURES))


@pytest.fixture
def holder(client):
    with holder_actor(client, FEATURES, "async") as actor:
        yield actor


def _contact(holder, worker: int = 0) -> dict:
    """Join as ``worker``: where its channel is, and its token."""
    return dict(holder.join(worker, None, LAYOUT).result(timeout=30)["channel"])


def _connect(client, holder, worker: int = 0, token: bytes | None = None,
             claim: int | None = None) -> ChannelClient:
    """Join as ``worker`` and connect, presenting ``token`` and worker ``claim`` when given."""
    contact = _contact(holder, worker)
    if token is not None:  # of incarnation 1
        contact["token"], contact["incarnation"] = token, 1
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
    started = time.monotonic()
    with pytest.raises(ChannelRefused, match="refused worker 0's connection"):
        _connect(client, holder, token=bytes(16))
    # Refused at once: a wrong token is not tried again for the reconnect deadline.
    assert time.monotonic() - started < client_module._RECONNECT_WITHIN / 2
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


def _token_for(dask_worker, key: str, worker: int) -> bytes:
    return dask_worker.state.actors[key]._channel.contact(worker, 1)["token"]


def test_a_push_from_an_unknown_worker_is_refused(client, holder):
    # Worker 7 cannot join, so it never gets a token: this one comes from the holder itself,
    # to check that the push side refuses it too.
    address = holder._address
    _contact(holder)  # opens the channel
    token = client.run(_token_for, key=holder.key, worker=7, workers=[address])[address]
    channel = _connect(client, holder, token=token, claim=7)
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


def test_a_superseded_incarnation_cannot_take_its_successors_connection():
    """A task of worker 0 run again (incarnation 2) connects; the first one, whose process
    lives on (retiring, or dropped while silent), connects after it: refused, and the
    successor's connection goes on (were it closed, its worker would fail)."""
    async def echo(worker, incarnation, version, grads, count, loss, position) -> Lease:
        return Lease(np.full(FEATURES, float(incarnation), np.float32), version + 1, None)

    with serve_channel(echo, FEATURES) as server:
        successor = ChannelClient(server.contact(0, 2), 0, FEATURES, 10, lambda: True)
        try:
            with pytest.raises(ChannelRefused, match="a newer task of the worker connected"):
                ChannelClient(server.contact(0, 1), 0, FEATURES, 10, lambda: True)
            params, version = _push(successor, 0).result(timeout=30)
            assert version == 1 and (params == 2.0).all()
        finally:
            successor.stop()


def test_a_worker_reconnecting_while_its_push_waits_on_the_barrier(client):
    with holder_actor(client, FEATURES, "sync") as holder:
        first = _connect(client, holder, worker=0)
        waiting = _push(first, 0, 2.0)
        until_waiting_for(holder, [1])
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
    with holder_actor(client, FEATURES, "sync") as holder:
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
    params, version = handle.wait(handle.push(0, np.ones(FEATURES, np.float32), 1, 0.0,
                                              (0, 1)), "a push")  # through the actor
    assert version == 1 and np.array_equal(params, -np.ones(FEATURES))


def test_a_worker_token_cannot_connect_as_another_worker(client, holder):
    other = _connect(client, holder, worker=1)
    try:
        # Worker 0's token presented as worker 1's: refused, and worker 1's live
        # connection (which a connection as worker 1 would replace) is left alone.
        with pytest.raises(ChannelRefused, match="refused worker 1's connection"):
            _connect(client, holder, worker=0, claim=1)
        params, version = _push(other, 0).result(timeout=30)
        assert version == 1 and np.array_equal(params, -np.ones(FEATURES))
    finally:
        other.close()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _until_closed(sockets: list[socket.socket], seconds: float) -> list[socket.socket]:
    """Wait up to ``seconds`` for the peer to end each of ``sockets``; those still open."""
    deadline = time.monotonic() + seconds
    left = list(sockets)
    while left and time.monotonic() < deadline:
        readable, _, _ = select.select(left, [], [], max(deadline - time.monotonic(), 0))
        for sock in readable:
            with contextlib.suppress(ConnectionResetError):  # an end all the same
                assert sock.recv(1) == b"", "the holder sent something to a silent connection"
            left.remove(sock)
    return left


FLOOD = 200


def test_a_connection_flood_is_refused_without_affecting_training(client, holder):
    address = holder._address
    contact = _contact(holder)
    channel = _connect(client, holder)
    baseline = client.run(_open_descriptors, workers=[address])[address]
    flood: list[socket.socket] = []
    try:
        # Connections that never present themselves, far more than the holder takes at once.
        flood = [socket.create_connection((contact["host"], contact["port"]), timeout=10)
                 for _ in range(FLOOD)]
        opened = time.monotonic()
        for step in range(1, 4):  # training goes on meanwhile
            params, version = _push(channel, step - 1).result(timeout=30)
            assert version == step and np.array_equal(params, np.full(FEATURES, -step))
        held = client.run(_open_descriptors, workers=[address])[address]
        # At most the cap of connections waiting for their hello (32), and some slack.
        assert held - baseline <= 48, f"{held - baseline} more descriptors during the flood"
        # Those over the cap are closed at once, the others at the hello deadline: all well
        # before the 10s a silent connection used to be kept.
        left = _until_closed(flood, opened + 6 - time.monotonic())
        assert not left, f"{len(left)} of {FLOOD} silent connections still open after 6s"
    finally:
        for sock in flood:
            sock.close()
    # Once the flood is over a worker connects as usual.
    other = _connect(client, holder, worker=1)
    try:
        assert _push(other, 3).result(timeout=30)[1] == 4
        assert _push(channel, 4).result(timeout=30)[1] == 5
    finally:
        other.close()
        channel.close()


SIZE = 4  # values of the models served by the in-process servers below


async def _echo(worker: int, incarnation: int, version: int, grads: np.ndarray | None,
                count: int, loss: float, position: tuple[int, int]) -> Lease:
    """A holder's push that answers with the gradient itself (zeros without one)."""
    return Lease(np.zeros(SIZE, np.float32) if grads is None else grads.copy(), version + 1,
                 None)


def _server(idle_timeout: float = 600.0, size: int = SIZE):
    """A :class:`ChannelServer` of ``size`` values answering with :func:`_echo`."""
    return serve_channel(_echo, size, idle_timeout)


def _hello(server: ChannelServer, worker: int = 0) -> socket.socket:
    """A raw connection that presented ``worker``'s token and was accepted."""
    contact = server.contact(worker, 1)
    sock = socket.create_connection((contact["host"], contact["port"]), timeout=10)
    sock.sendall(HELLO.pack(contact["token"], worker, 1))
    assert sock.recv(1) == b"\x01"
    return sock


IDLE = 0.5
# Payloads this large move on the server's own threads rather than through its event loop.
BULK = transfer._BULK_BYTES // 4 + 1


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_large_payload_goes_both_ways_over_either_transport(transport):
    with _server(size=BULK) as server:
        contact = server.contact(0, 1)
        assert contact["local"] is not None  # this is Linux: a local socket is offered
        if transport == "tcp":  # as a worker on another host sees it: local fails
            contact["local"] = "\0dasktrain-channel-elsewhere"
        channel = ChannelClient(contact, 0, BULK, 10, lambda: True)
        try:
            assert channel.transport == transport
            rng = np.random.default_rng(0)
            for step in range(3):
                payload = rng.standard_normal(BULK).astype(np.float32)
                params, version = channel.push(step, payload, 1, 0.0, (0, 1)).result()
                assert version == step + 1 and np.array_equal(params, payload)
        finally:
            channel.close()


@pytest.mark.parametrize("sent", ["nothing", "half a header", "half a payload",
                                  "half a large payload"])
def test_a_connection_gone_silent_is_closed_after_the_idle_deadline(sent):
    size = BULK if sent == "half a large payload" else SIZE
    with _server(idle_timeout=IDLE, size=size) as server:
        sock = _hello(server)
        try:
            header = PUSH.pack(0, 1, 0.0, 0, 1, size * 4)
            data = {"nothing": b"", "half a header": header[: PUSH.size // 2],
                    "half a payload": header + bytes(SIZE * 2),
                    "half a large payload": header + bytes(size * 2)}[sent]
            sock.sendall(data)
            started = time.monotonic()
            assert not _until_closed([sock], 10 * IDLE), f"still open after {10 * IDLE}s"
            assert time.monotonic() - started >= IDLE * 0.8, "closed before the deadline"
        finally:
            sock.close()


def test_a_client_silent_past_the_idle_deadline_reconnects_for_its_next_push():
    with _server(idle_timeout=IDLE) as server:
        channel = ChannelClient(server.contact(0, 1), 0, SIZE, 10, lambda: True)
        try:
            ones = np.ones(SIZE, np.float32)
            assert channel.push(0, ones, 1, 0.0, (0, 1)).result()[1] == 1
            deadline = time.monotonic() + 10 * IDLE
            while len(server._members):  # until the holder ended the silent connection
                assert time.monotonic() < deadline, "the silent connection was never ended"
                time.sleep(IDLE / 10)
            params, version = channel.push(1, ones * 2, 1, 0.0, (0, 2)).result()
            assert version == 2 and np.array_equal(params, ones * 2)
        finally:
            channel.close()


def test_a_flood_past_the_cap_pushes_the_oldest_out_and_is_logged_once(caplog):
    cap = server_module._MAX_UNAUTHENTICATED
    flood: list[socket.socket] = []
    with _server() as server, caplog.at_level(logging.WARNING, server_module.__name__):
        host, port = server.address
        try:
            # Accepted in the order they connect (one listener, one queue).
            flood = [socket.create_connection((host, port), timeout=10)
                     for _ in range(cap + 20)]
            # The 20 oldest are closed at once, long before the hello deadline; the newest
            # wait, so a worker connecting during a flood is never the one turned away.
            left = _until_closed(flood, server_module._HELLO_TIMEOUT / 2)
            assert left == flood[20:]
            # A worker that presents itself is taken even while the room is full.
            assert len(server._waiting) == cap
            _hello(server).close()
            for sock in left:
                sock.close()
            deadline = time.monotonic() + 10
            while len(server._waiting):
                assert time.monotonic() < deadline, "closed connections still counted"
                time.sleep(0.01)
        finally:
            for sock in flood:
                sock.close()
    refusals = [r for r in caplog.records if "closed a push connection" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
