"""Exactly once by construction: every call of a trainer worker carries the incarnation its
join handed out, the holder acts on no call of an incarnation that is over, and however a
worker goes, one path gives back what it held.

Each test drives a real holder step by step (plain SGD at lr 1 from zeros: the parameters
are minus the sum of what was applied) through a situation in which a worker's death, a
rerun or a retirement used to leave work held by nobody, a batch applied to part of the
model or a checkpoint out of step with what it counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.exchange.client import ChannelClient
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.holder.arithmetic import INLINE_SIZE
from tests.common.channel import on_loop, serve_channel
from tests.common.training import zeros, zeros_holder

F32 = np.float32


def _claiming(workers: int = 2, mode: str = "async", **options) -> ParameterHolder:
    """A holder of a 2-value model whose workers claim their batches."""
    return ParameterHolder(HolderConfig(
        model=functools.partial(zeros, 2), optimizer=dt.optim.sgd(1.0), workers=workers,
        mode=mode, assignment="dynamic", batch_size=1, mode_options=options))


async def _joined(holder: ParameterHolder, workers: int) -> None:
    for w in range(workers):
        info = await holder.join(w, None, holder.model_layout)
        assert info["incarnation"] == 1


async def _until(condition, what: str, deadline: float = 30.0) -> None:
    """Let the event loop run until ``condition()``: turns of the loop first, then, for a
    condition that waits on the holder's serial thread (which a loaded machine may not
    run for a while), short sleeps up to ``deadline`` seconds."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0)
    ends = time.monotonic() + deadline
    while time.monotonic() < ends:
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def _grad(value: float = 1.0) -> np.ndarray:
    return np.full(2, value, dtype=F32)


# -- 1. a claim that waited does not outlive its worker ------------------------------
@pytest.mark.parametrize("how", ["dropped", "superseded by a rerun"])
def test_a_claim_that_waited_takes_nothing_for_a_worker_that_is_gone(how):
    """Worker 1 holds batches and waits for more; it dies. What it held goes back, and
    the claim that waited, which the actor runs to its end although its caller is gone,
    must not take it for the dead worker (nothing would ever give it back: the epoch
    would never end). A rerun of worker 1 joining meanwhile takes its place cleanly."""

    async def scenario():
        holder = _claiming()
        try:
            await holder.begin_epoch(0, True, (4, [0]), 2)
            await _joined(holder, 2)
            runs = [await holder.claim(w, 1, 0) for w in (0, 1, 0, 1)]  # one batch each
            assert [r[0] for r in runs] == [0, 1, 2, 3]
            waiting = asyncio.ensure_future(holder.claim(1, 1, 0, 10.0))
            await _until(lambda: holder._claims.waiting == 1, "the claim waits")
            if how == "dropped":
                await holder.drop(1, "its Dask worker is gone")
            else:
                rerun = await holder.join(1, None, holder.layout)
                assert rerun["incarnation"] == 2
            with pytest.raises(dt.Fenced):
                await asyncio.wait_for(waiting, 10)
            ledger = holder._roster.ledger
            claimed_by_1 = ledger.holds(1)
            # Worker 0 (or the rerun) takes what worker 1 held: batches 1 and 3.
            taker = 0 if how == "dropped" else 1
            again = [await holder.claim(taker, holder._roster.incarnation(taker), 0)
                     for _ in range(2)]
            return claimed_by_1, again, await holder.progress()
        finally:
            await holder.close()

    claimed_by_1, again, progress = asyncio.run(scenario())
    assert not claimed_by_1
    assert [r[0] for r in again] == [1, 3]
    assert progress["fenced"] == 1
    assert any("went back to the pool" in e for e in progress["events"])


def test_a_rerun_that_joined_at_the_boundary_ends_that_epoch_and_trains_the_next():
    """Worker 1 died; worker 0 finished epoch 0 alone and the holder waits at the boundary
    for the driver when worker 1's rerun joins (into the epoch just complete). Epoch 1 then
    begins and expects worker 1: its claim for epoch 0 is answered "epoch over", not
    refused as from a worker outside the epoch (its task would have stopped for the rest
    of the fit), and worker 1 trains epoch 1."""

    async def scenario():
        holder = _claiming()
        try:
            await holder.begin_epoch(0, True, (2, [0]), 2)
            await _joined(holder, 2)
            held = [await holder.claim(0, 1, 0) for _ in range(2)]
            await holder.drop(1, "its Dask worker is gone")
            for run in held:
                await holder.push(0, 1, holder.version, _grad(), 1, 0.5, (0, run[0]))
            await holder.leave(0, 1, False, {"epoch": 0, "worker": 0, "steps": 2})
            assert (await holder.join(1, None, holder.layout))["incarnation"] == 2
            await holder.queue_epoch(1, (2, [0]))
            over = await holder.claim(1, 2, 0)
            info = await holder.next_epoch(1, 2, 0, None, 5.0,
                                           {"epoch": 0, "worker": 1, "steps": 0})
            run = await holder.claim(1, 2, 1)
            return over, info, run, await holder.progress()
        finally:
            await holder.close()

    over, info, run, progress = asyncio.run(scenario())
    assert over is None and info.get("epoch") == 1 and run is not None, (over, info, run)
    assert progress["fenced"] == 0 and progress["members"][1] == "active"


# -- 2. a dead incarnation's late push does not make it active again --------------------
def test_a_push_already_on_its_way_from_a_dropped_worker_is_fenced_and_the_epoch_ends():
    """Worker 1 is dropped (its process was killed) with a push still on its way; when
    that push lands the holder refuses it: worker 1 stays lost, and the epoch, whose work
    worker 0 finishes, ends as soon as worker 0 leaves it (a push that made worker 1
    active again would hold the epoch's end for good)."""

    async def scenario():
        holder = _claiming()
        try:
            await holder.begin_epoch(0, True, (2, [0]), 2, "params")
            await _joined(holder, 2)
            mine, theirs = await holder.claim(0, 1, 0), await holder.claim(1, 1, 0)
            await holder.drop(1, "its Dask worker is gone")
            back = await holder.claim(0, 1, 0)  # worker 1's batch, given back
            with pytest.raises(dt.Fenced, match="dropped"):  # the late frame
                await holder.push(1, 1, 0, _grad(5.0), 1, 0.5, (0, theirs[0]))
            for run in (mine, back):
                await holder.push(0, 1, holder.version, _grad(), 1, 0.5, (0, run[0]))
            assert await holder.claim(0, 1, 0) is None  # every batch is done
            await holder.leave(0, 1, False, {"epoch": 0, "worker": 0, "steps": 2})
            end = await holder.epoch_end(0, 5.0)
            params, _ = await holder.pull()
            return end, params, await holder.progress()
        finally:
            await holder.close()

    end, params, progress = asyncio.run(scenario())
    assert end is not None and end["samples"] == 2
    assert progress["members"][1] == "lost" and progress["fenced"] == 1
    np.testing.assert_array_equal(params, np.full(2, -2.0, dtype=F32))  # worker 0's two


def test_a_frame_from_a_dead_incarnation_on_its_old_connection_is_fenced():
    """The same over the direct channel, on real sockets: a connection speaks for the
    incarnation that opened it, so a frame already in the socket of a worker that was
    dropped (or superseded by its rerun) is answered "fenced", and changes nothing."""
    box: dict = {}

    async def push(*args):  # the holder's exchange, once it exists
        return await box["holder"].exchange(*args)

    async def make() -> ParameterHolder:
        holder = ParameterHolder(zeros_holder(2, workers=2, mode="async"))
        await holder.begin_epoch(0)
        await _joined(holder, 2)
        return holder

    with serve_channel(push, 2) as server:
        holder = box["holder"] = on_loop(server, make)
        old = ChannelClient(server.contact(1, 1), 1, 2, 10, lambda: True)
        try:
            assert old.push(0, _grad(), 1, 0.5, (0, 1)).result(10)[1] == 1
            on_loop(server, lambda: holder.drop(1, "its Dask worker is gone"))
            with pytest.raises(dt.Fenced, match="incarnation 1"):
                old.push(1, _grad(7.0), 1, 0.5, (0, 2)).result(10)
            rerun = on_loop(server, lambda: holder.join(1, None, holder.layout))
            with pytest.raises(dt.Fenced, match="newer task"):
                old.push(1, _grad(7.0), 1, 0.5, (0, 2)).result(10)
            params, version = on_loop(server, holder.pull)
            progress = on_loop(server, holder.progress)
        finally:
            old.close()
            on_loop(server, holder.close)
    assert rerun["incarnation"] == 2 and version == 1
    np.testing.assert_array_equal(params, np.full(2, -1.0, dtype=F32))  # the first only
    assert progress["fenced"] == 2


# -- 3. average with claimed work: a push that fell behind goes back --------------------
def test_average_gives_back_a_push_whose_parameters_fell_behind_the_rounds():
    """Worker 2 has no work (the rest of the epoch is in others' hands) and sits out the
    rounds. Worker 1 dies; its batch comes back, and worker 2 claims it and pushes
    parameters of the version it last had. They are not averaged, but neither is the
    batch marked done: it goes back to the pool, worker 2 gets the current average with
    the reply, claims the batch again and its push is averaged. Every sample once."""

    async def scenario():
        holder = _claiming(workers=3, mode="average", average_every=1)
        try:
            await holder.begin_epoch(0, True, (4, [0]), 3)
            await _joined(holder, 3)
            zero = await holder.claim(0, 1, 0)  # [0, 2): pieces of one batch
            one = await holder.claim(1, 1, 0)  # [2, 4)
            assert (zero[:2], one[:2]) == ([0, 2], [2, 4])
            # Worker 2 finds nothing to claim: it sits out the rounds.
            assert await holder.claim(2, 1, 0, 0.01) == []
            first = [asyncio.ensure_future(holder.push(w, 1, 0, _grad(), 1, 0.5, (0, b)))
                     for w, b in ((0, 0), (1, 2))]
            await asyncio.gather(*first)  # round 1, without worker 2
            await holder.drop(1, "its Dask worker is gone")  # batch 3 goes back
            late = await holder.claim(2, 1, 0)
            assert late[:2] == [3, 4]
            # Parameters of version 0: behind the rounds. The reply brings version 1.
            _, version = await holder.push(2, 1, 0, _grad(9.0), 1, 0.5, (0, 3))
            assert version == 1
            again = await holder.claim(2, 1, 0)
            assert again[:2] == [3, 4]
            pushes = [asyncio.ensure_future(holder.push(0, 1, 1, _grad(2.0), 1, 0.5, (0, 1))),
                      asyncio.ensure_future(holder.push(2, 1, 1, _grad(4.0), 1, 0.5, (0, 3)))]
            await asyncio.gather(*pushes)
            return holder._roster.ledger.finished, await holder.progress()
        finally:
            await holder.close()

    finished, progress = asyncio.run(scenario())
    records = progress["records"]
    assert finished
    assert sum(records["samples"]) == 4  # batches 0 and 2, then 1 and 3: each once
    assert not any(records["dropped"])
    assert any("went back to the pool: its parameters of version 0 fell behind" in e
               for e in progress["events"]), progress["events"]


# -- 5. sharded sync: every shard or none ----------------------------------------------
def _weight_and_bias() -> torch.nn.Module:
    """Two parameter tensors, all zero: a holder in two shards keeps one each."""
    model = torch.nn.Linear(3, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    return model


def test_a_sharded_sync_step_is_not_applied_to_part_of_the_model():
    """Worker 1 dies after sending its slice to shard 0 and before shard 1: shard 0's
    round is whole, shard 1's can never be. Shard 1 refuses to go on without worker 1
    (applying worker 0's slice alone would make a step other than shard 0's); the fit
    stops with :class:`ShardedWorkerLost`, to be resumed from a checkpoint in which every
    shard is at one version."""

    async def scenario():
        config = HolderConfig(model=_weight_and_bias, optimizer=dt.optim.sgd(1.0), workers=2,
                              mode="sync")
        shards = [ParameterHolder(dataclasses.replace(config, shard=(k, 2))) for k in range(2)]
        try:
            for shard in shards:
                await shard.begin_epoch(0)
                await _joined(shard, 2)
            slices = [np.ones(3, dtype=F32), np.ones(1, dtype=F32)]  # the weight, the bias
            round_0 = [asyncio.ensure_future(shards[0].push(w, 1, 0, slices[0], 1, 0.5,
                                                            (0, 1))) for w in (0, 1)]
            await asyncio.gather(*round_0)
            waiting = asyncio.ensure_future(shards[1].push(0, 1, 0, slices[1], 1, 0.5,
                                                           (0, 1)))
            await _until(lambda: shards[1]._mode.waiting_for() == {1}, "shard 1 waits")
            await shards[1].drop(1, "its Dask worker is gone")
            with pytest.raises(dt.ShardedWorkerLost, match="resume it from its last"):
                await asyncio.wait_for(waiting, 10)
            with pytest.raises(dt.ShardedWorkerLost):
                await shards[1].state_at(1)
            return [shard.version for shard in shards]
        finally:
            for shard in shards:
                await shard.close()

    assert asyncio.run(scenario()) == [1, 0]


# -- 6. smaller seams ------------------------------------------------------------------
def test_a_checkpoint_between_soft_s_hold_and_its_round_keeps_the_gradient():
    """``soft`` counts a gradient as its worker's (its batch done) in the serial section
    and then puts it in the round. A checkpoint taken in between must still store it with
    the round: resumed from it, the worker goes on after that batch, so a gradient missing
    from the stored round would be lost. The serial thread is held while the push reaches
    its hold, the snapshot queued behind it, and the event loop kept from going on until
    the snapshot is taken: the moment between the two, every time."""
    features = INLINE_SIZE + 8  # a threaded serial section: the hold runs on its thread

    async def scenario():
        config = zeros_holder(features, workers=2, mode="soft")
        config.mode_options = {"wait_for": 2}
        holder = ParameterHolder(config)
        try:
            await holder.begin_epoch(0)
            await _joined(holder, 2)
            gates = [threading.Event(), threading.Event()]
            blocks = [asyncio.ensure_future(holder._arith.serially(gate.wait))
                      for gate in gates[:1]]
            await _until(lambda: holder._arith._in_flight == 1, "the first block runs")
            push = asyncio.ensure_future(holder.push(
                1, 1, 0, np.ones(features, dtype=F32), 1, 0.5, (0, 1)))
            await _until(lambda: holder._arith._in_flight == 2, "the push queues")
            blocks.append(asyncio.ensure_future(holder._arith.serially(gates[1].wait)))
            await _until(lambda: holder._arith._in_flight == 3, "the second block queues")
            gates[0].set()  # the push's first look runs, then the second block
            await _until(lambda: holder._arith._in_flight == 2 and blocks[0].done(),
                         "the push queues its hold behind the second block")
            snapshot = holder._arith._executor.submit(holder._host.state_dict)
            gates[1].set()
            state = snapshot.result(timeout=30)  # the loop waits: the round is as the hold left it
            await asyncio.gather(*blocks)
            push.cancel()
            return state
        finally:
            await holder.close()

    state = asyncio.run(scenario())
    assert state["clocks"] == [0, 1]  # worker 1's batch is done in the checkpoint...
    # ... and its gradient is in the stored round, to be applied after a resume.
    assert [(c["worker"], c["position"]) for c in state["mode_state"]["round"]] == [(1, [0, 1])]


def test_a_retiring_worker_s_claim_after_its_leave_takes_nothing():
    """A retiring worker leaves (handing back what it claimed) while its feeder's claim
    is still on its way: that claim finds the incarnation over and takes nothing, so no
    batch stays with a worker that has gone."""

    async def scenario():
        holder = _claiming()
        try:
            await holder.begin_epoch(0, True, (4, [0]), 2)
            await _joined(holder, 2)
            held = await holder.claim(0, 1, 0)
            await holder.leave(0, 1, True, None)  # retired
            with pytest.raises(dt.Fenced, match="has left the fit"):
                await holder.claim(0, 1, 0)
            return held, holder._roster.ledger.holds(0), await holder.claim(1, 1, 0)
        finally:
            await holder.close()

    held, holds, taken = asyncio.run(scenario())
    assert not holds and taken[0] == held[0]  # what it held went to worker 1


def test_waits_that_time_out_leave_nothing_behind():
    """A driver polling an epoch that does not end, and claims that find no work, each wait
    on a future of their own: every one is let go when its wait ends, so a long fit does
    not pile them up."""

    async def scenario():
        holder = _claiming()
        try:
            await holder.begin_epoch(0, True, (2, [0]), 2)
            await _joined(holder, 2)
            await holder.claim(0, 1, 0)
            await holder.claim(1, 1, 0)
            for _ in range(50):
                assert await holder.epoch_end(0, 0.001) is None
                assert await holder.claim(0, 1, 0, 0.001) == []
            return holder._epochs.waiters, holder._claims.waiters
        finally:
            await holder.close()

    assert asyncio.run(scenario()) == (0, 0)


def test_an_elastic_epoch_waiting_for_workers_begins_when_one_joins_and_none_is_skipped():
    """An elastic run's next epoch waits for its least workers (one died): the driver,
    going on, queues the epoch after it too. The join of a new worker begins the waiting
    epoch, not the later one, and that one follows in its turn."""

    async def scenario():
        holder = ParameterHolder(HolderConfig(
            model=functools.partial(zeros, 2), optimizer=dt.optim.sgd(1.0), workers=3,
            min_workers=2, elastic=True, mode="async", assignment="dynamic", batch_size=1))
        try:
            await holder.begin_epoch(0, True, (1, [0]), 2)
            await _joined(holder, 2)
            await holder.drop(1, "its Dask worker is gone")
            run = await holder.claim(0, 1, 0)
            await holder.push(0, 1, 0, _grad(), 1, 0.5, (0, run[0]))
            await holder.queue_epoch(1, (1, [0]))
            waiting = asyncio.ensure_future(holder.next_epoch(
                0, 1, 0, None, 10.0, {"epoch": 0, "worker": 0, "steps": 1}))
            await _until(lambda: holder._epochs.short_of_workers, "epoch 1 waits")
            await holder.queue_epoch(2, (1, [0]))  # the driver is ahead
            info = await holder.join(2, None, holder.model_layout)
            first = await asyncio.wait_for(waiting, 10)
            return info, first
        finally:
            await holder.close()

    info, first = asyncio.run(scenario())
    assert info["epoch"] == 1 and first["epoch"] == 1
