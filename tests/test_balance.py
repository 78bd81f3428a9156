"""Uneven shares of a lock-step step: the plan's cut, the pipeline's batches, the holder's
measure of each worker's speed, and a ``sync`` fit whose slow worker takes fewer rows yet
ends where one process does."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.pipeline.plan import EpochPlan
from dasktrain.trainer.holder.balance import Balance
from tests.common.data import indexed_dataset
from tests.common.training import flat_parameters, mlp, one_process, slow_on_worker_1


def _rows(plan: EpochPlan, rank: int, world: int) -> list[np.ndarray]:
    order, offsets = plan.sample_order(), plan.window_offsets
    return [np.concatenate([order[offsets[p.window] + p.start:offsets[p.window] + p.stop]
                            for p in pieces])
            for unit in plan.units(rank, world) for pieces in unit.pieces]


@pytest.mark.parametrize(("rows", "block_rows", "shares"), list(itertools.product(
    [97, 1003, 1024], [7, 64], [(30, 34), (63, 1), (10, 20, 66)])))
def test_shares_cut_each_step_and_keep_its_rows(rows, block_rows, shares):
    """Rank r takes shares[r] rows of every step; step k of all ranks covers the rows of
    step k of even shares, and every row comes once."""
    world = len(shares)
    batch = sum(shares) // world
    even = EpochPlan(0, rows, block_rows, batch, seed=1, epoch=3, shuffle_blocks=2)
    cut = EpochPlan(0, rows, block_rows, batch, seed=1, epoch=3, shuffle_blocks=2,
                    shares=shares)
    per_rank = [_rows(cut, r, world) for r in range(world)]
    even_rank = [_rows(even, r, world) for r in range(world)]
    steps = max(map(len, per_rank))
    assert steps == max(map(len, even_rank)) == -(-rows // (world * batch))
    for k in range(steps):
        mine = [per_rank[r][k] for r in range(world) if k < len(per_rank[r])]
        theirs = [even_rank[r][k] for r in range(world) if k < len(even_rank[r])]
        np.testing.assert_array_equal(np.concatenate(mine), np.concatenate(theirs))
        if k < steps - 1:
            assert [len(part) for part in mine] == list(shares)
    everything = np.concatenate([b for rank in per_rank for b in rank])
    np.testing.assert_array_equal(np.sort(everything), np.arange(rows))


def test_plan_refuses_shares_that_do_not_make_a_step():
    with pytest.raises(ValueError, match="add up to the 2 x 16 rows"):
        EpochPlan(0, 100, 10, 16, 0, 0, shares=(16, 15))
    with pytest.raises(ValueError, match="positive row counts"):
        EpochPlan(0, 100, 10, 16, 0, 0, shares=(32, 0))
    with pytest.raises(ValueError, match="drop_last"):
        EpochPlan(0, 100, 10, 16, 0, 0, shares=(20, 12), drop_last=True)
    with pytest.raises(ValueError, match="for 2 ranks, not 3"):
        EpochPlan(0, 100, 10, 16, 0, 0, shares=(20, 12)).rank_batches(0, 3)


def test_pipeline_batches_follow_the_shares(client, tmp_path):
    """Two ranks of a real pipeline with shares (20, 12) read batches of 20 and 12 rows
    whose union, step by step, is that of two ranks of 16; shares change between epochs
    only."""
    data = indexed_dataset(client, tmp_path, 200, chunk_rows=30)
    cut = [dt.Pipeline(data, 16, rank=r, world_size=2, shares=(20, 12), client=client)
           for r in range(2)]
    even = [dt.Pipeline(data, 16, rank=r, world_size=2, client=client) for r in range(2)]
    try:
        mine = [[x[:, 0].long().tolist() for x, _ in pipe] for pipe in cut]
        theirs = [[x[:, 0].long().tolist() for x, _ in pipe] for pipe in even]
        assert [len(b) for b in mine[0][:-1]] == [20] * (len(mine[0]) - 1)
        assert {len(b) for b in mine[1]} == {12}
        for k in range(len(mine[0])):
            step = mine[0][k] + (mine[1][k] if k < len(mine[1]) else [])
            same = theirs[0][k] + (theirs[1][k] if k < len(theirs[1]) else [])
            assert step == same
        assert cut[0].state_dict()["shares"] == [20, 12]
        cut[0].set_shares(None)  # between epochs
        assert len(next(iter(cut[0]))[0]) == 16
        with pytest.raises(ValueError, match="only change between epochs"):
            cut[0].set_shares((24, 8))
        with pytest.raises(ValueError, match="add up to"):
            dt.Pipeline(data, 16, rank=0, world_size=2, shares=(20, 20), client=client)
    finally:
        for pipe in cut + even:
            pipe.close()


def test_balance_cuts_by_measured_speed_and_ignores_noise():
    """A worker twice as fast per row gets about two thirds of a step; a few percent of
    difference changes nothing, nor a cut that would save less over an epoch than making it
    costs; the decision of an epoch is kept, also across a state."""
    balance = Balance(batch_size=30, enabled=True)
    assert balance.shares(0, 2) is None  # nothing measured yet
    now = 0.0
    for _ in range(20):
        for worker, seconds in ((0, 0.01), (1, 0.02)):
            balance.replied(worker, now)
            balance.pushed(worker, 30, now + seconds)
        now += 0.03
    assert balance.shares(1, 2) == (40, 20)
    assert balance.shares(1, 2) == (40, 20)  # decided once
    again = Balance(batch_size=30, enabled=True)
    again.load_state_dict(balance.state_dict())
    assert again.shares(1, 2) == (40, 20)
    for _ in range(20):  # the same speeds, a little noise: no change
        for worker, rows, seconds in ((0, 40, 0.0134), (1, 20, 0.0132)):
            balance.replied(worker, now)
            balance.pushed(worker, rows, now + seconds)
        now += 0.03
    assert balance.shares(2, 2) == (40, 20)
    assert Balance(batch_size=30, enabled=False).shares(0, 2) is None
    short = Balance(batch_size=30, enabled=True)  # 2:1 again, in an epoch of 5 short steps
    for _ in range(5):
        for worker, seconds in ((0, 0.001), (1, 0.002)):
            short.replied(worker, now)
            short.pushed(worker, 30, now + seconds)
        now += 0.003
    assert short.shares(1, 2) is None  # would save 1.7 ms an epoch: less than a new cut costs
    tiny = Balance(batch_size=1, enabled=True)  # every worker keeps a row of each step
    for worker, seconds in ((0, 0.001), (1, 0.1), (2, 0.1)):
        tiny.replied(worker, 0.0)
        tiny.pushed(worker, 1, seconds)
    shares = tiny.shares(1, 3)
    assert shares is None or (sum(shares) == 3 and min(shares) >= 1), shares


def test_sync_gives_a_slow_worker_fewer_rows_and_trains_the_same(client, regression,
                                                                  tmp_path):
    """With one worker slower per row, from the second epoch on the other takes more of
    each step's rows, and the fit still ends where one process on the union batches
    does; a resumed fit goes on with the cut it had."""
    config = dt.optim.sgd(0.05)
    trainer = dt.Trainer(mlp, slow_on_worker_1, config, mode="sync", workers=2,
                         batch_size=16, progress=False)
    history = trainer.fit(regression, epochs=3, client=client, checkpoint=tmp_path / "run")
    rows = [[w["batch_rows"] for w in e["per_worker"]] for e in history.epochs]
    assert rows[0] == [16, 16]
    assert all(fast > 16 > slow and fast + slow == 32 for fast, slow in rows[1:]), rows
    expected = one_process(regression, mlp, config, 32, 3, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-5)
    resumed = dt.Trainer(mlp, slow_on_worker_1, config, mode="sync", workers=2,
                         batch_size=16, progress=False)
    history = resumed.fit(regression, epochs=4, client=client, resume=tmp_path / "run")
    assert history.epochs[-1]["epoch"] == 3
    fast, slow = [w["batch_rows"] for w in history.epochs[-1]["per_worker"]]
    assert fast > 16 > slow, (fast, slow)
    even = dt.Trainer(mlp, slow_on_worker_1, config, mode="sync", workers=2,
                      batch_size=16, progress=False, balance=False)
    history = even.fit(regression, epochs=2, client=client)
    assert [[w["batch_rows"] for w in e["per_worker"]] for e in history.epochs] == \
        [[16, 16]] * 2
