"""Work claimed on demand (``assignment="dynamic"``): every sample applied once per epoch,
whatever the workers' speeds, whoever dies, and across a resume with another worker count.

The ledger and the pipeline's claiming are checked on their own first; then real fits on a
cluster of three worker processes train :class:`~tests.common.counting.Tally`, whose
parameters count how often each row's gradient was applied. In ``average`` a row's count
reaches the parameters divided by the round's average, so there the samples of the applied
pushes are counted instead: a run lost or applied twice changes their sum.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import numpy as np
import pytest
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain.pipeline import EpochPlan, Pipeline
from dasktrain.trainer.driver.checkpoint import load_checkpoint
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.holder.ledger import WorkLedger
from tests.common.counting import ROWS, register_tally, spread, tally
from tests.common.data import indexed_dataset
from tests.common.training import zeros

ASYNC_MODES = ["async", "ssp", "soft"]
DYNAMIC_MODES = [*ASYNC_MODES, "average"]


# -- the ledger -------------------------------------------------------------------------
def test_claims_are_guided_cut_at_bounds_and_cover_the_epoch_once():
    ledger = WorkLedger(claim_batches=8)
    ledger.begin(0, 100, [0, 30, 64])
    runs = []
    while (run := ledger.claim(worker=len(runs) % 3, live=3)) is not None:
        runs.append(run)
    covered = [b for run in runs for b in run]
    assert covered == list(range(100))  # in order, each once
    assert all(len(r) <= 8 for r in runs)
    assert all(not (r.start < 30 < r.stop or r.start < 64 < r.stop) for r in runs)
    assert len(runs[-1]) == 1  # claims shrink as the epoch ends
    assert not ledger.finished


def test_released_work_is_handed_out_again_and_a_second_gradient_is_refused():
    ledger = WorkLedger(claim_batches=4)
    ledger.begin(0, 12, [0])
    a = ledger.claim(0, live=2)
    b = ledger.claim(1, live=2)
    assert (a, b) == (range(0, 3), range(3, 6))  # 12/4, then 9/4 rounded up
    assert ledger.arrive(0, 0) is None
    ledger.taken(0, 0)
    assert ledger.arrive(0, 1) is None  # arriving: not given back
    assert ledger.release(0) == 1  # batch 2 only
    assert ledger.claim(1, live=1) == range(2, 3)  # the lowest pending first
    assert ledger.arrive(1, 0) == "batch 0 was already applied"
    assert ledger.arrive(1, 1) == "batch 1 was already applied"
    assert ledger.arrive(1, 2) is None
    assert ledger.arrive(0, 2) == "batch 2 was already applied"
    assert ledger.shares() == {0: 1}


def test_a_checkpoint_keeps_only_what_is_done():
    ledger = WorkLedger()
    ledger.begin(3, 20, [0, 10])
    run = ledger.claim(0, live=2)
    for b in run:
        assert ledger.arrive(0, b) is None
        ledger.taken(0, b)
    ledger.claim(1, live=2)  # claimed, never pushed
    state = ledger.state_dict()
    resumed = WorkLedger()
    resumed.load_state_dict(state)
    resumed.begin(3, 20, [0, 10], keep_done=True)
    rest = []
    while (r := resumed.claim(5, live=1)) is not None:
        rest.extend(r)
    assert sorted(rest) == [b for b in range(20) if b not in run]
    assert resumed.shares() == {0: len(run)}


def test_a_run_pushed_whole_is_admitted_taken_and_given_back_as_one():
    ledger = WorkLedger(whole_runs=True)
    ledger.begin(0, 12, [0])
    a = ledger.claim(0, live=2, size=4)
    b = ledger.claim(1, live=2, size=1)  # the mode's size, not the guided one
    assert (a, b) == (range(0, 4), range(4, 5))
    assert ledger.arrive(0, 1) == "batch 1 ends no run that worker 0 claimed"
    assert ledger.arrive(0, 3) is None  # the run 0-3, named by its last batch
    assert ledger.release(0) == 0  # all of it arriving: nothing goes back
    ledger.taken(0, 3)
    assert ledger.shares() == {0: 4}
    assert ledger.release(1) == 1
    c = ledger.claim(0, live=1, size=3)
    assert c == range(4, 7)  # the given-back batch first
    assert ledger.arrive(1, 4) == "batch 4 ends no run that worker 1 claimed"
    assert ledger.arrive(0, 6) is None
    ledger.taken(0, 6)
    assert ledger.shares() == {0: 7} and ledger.remaining() == 5


# -- the pipeline's side ------------------------------------------------------------------
def test_claiming_yields_the_plan_s_batches(client, tmp_path):
    data = indexed_dataset(client, tmp_path, rows=500, chunk_rows=64)
    pipe = Pipeline(data, 16, client=client, seed=4)
    plan = pipe.plan(0)
    expected = dict(enumerate(b[0][:, 0].long().tolist() for b in pipe))
    runs = iter([range(20, 32), range(0, 7), range(7, 20)])
    pipe.set_epoch(0)

    def claim(stop: threading.Event) -> range | None:
        return next(runs, None)

    got = {g: batch[0][:, 0].long().tolist() for g, batch in pipe.claiming(claim)}
    assert sorted(got) == list(range(plan.num_batches))
    assert got == expected


def test_unit_of_a_run_is_the_rank_unit_where_they_coincide():
    plan = EpochPlan(0, 10_000, 1000, 128, 1, 0, shuffle_blocks=2)
    for unit in plan.units(0, 1):
        assert plan.unit_of(range(unit.batches[0], unit.batches[-1] + 1)) == unit
    # Claims are cut at the windows but for the epoch's first piece, split in two for a quick
    # first batch in order: a claim of one batch would be a round of one step in average
    starts = [u.batches[0] for u in plan.units(0, 1)]
    assert starts[:2] == [0, 1]
    assert plan.claim_bounds() == [0, *starts[2:]]
    with pytest.raises(ValueError, match="not a run"):
        plan.unit_of(range(0, plan.num_batches + 1))


# -- real fits ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three single-threaded worker processes of its own: a test kills one of them."""
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        c.wait_for_workers(3)
        yield c


@pytest.fixture(scope="module")
def rows(three, tmp_path_factory):
    return indexed_dataset(three, tmp_path_factory.mktemp("rows"), rows=ROWS, chunk_rows=150)


def _trainer(mode: str, loss, workers: int = 3, batch_size: int = 10,
             **options) -> dt.Trainer:
    return dt.Trainer(tally, loss, register_tally(), mode=mode, workers=workers,
                      batch_size=batch_size, progress=False, **options)


def _counts(trainer: dt.Trainer) -> np.ndarray:
    return trainer.model.w.detach().numpy()


def _assert_each_row_once_per_epoch(trainer: dt.Trainer, history: dt.History,
                                    epochs: int) -> None:
    if trainer.mode == "average":
        assert sum(history.samples) == epochs * ROWS, history.events
    else:
        counts = _counts(trainer)
        applied = np.flatnonzero(counts == epochs)
        assert len(applied) == ROWS, (np.unique(counts, return_counts=True), history.events)
    batches = -(-ROWS // trainer.batch_size)
    for record in history.epochs:
        assert sum(record["batches_per_worker"]) == batches


@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_fast_workers_take_more_and_every_row_is_applied_once(three, rows, mode):
    # Long enough an epoch (180 batches of 20 ms or 60 ms) that workers starting a little
    # apart all take part.
    slow = functools.partial(spread, slow_rank=2, delay=0.06, pace=0.02)  # 3x slower
    trainer = _trainer(mode, slow, batch_size=5)
    history = trainer.fit(rows, epochs=2, client=three)
    _assert_each_row_once_per_epoch(trainer, history, 2)
    assert not any(history.dropped)
    if mode == "ssp":  # by design no worker runs more than s batches ahead of the slowest
        assert max(history.clock_lead) <= 3
        return
    for record in history.epochs:
        # A fixed stride would give each a third; the 3x slower worker takes less, the
        # two others the rest (one of them may start later than the others: not both).
        shares = record["batches_per_worker"] + [0, 0, 0]
        assert shares[2] < 180 / 3 - 10, shares
        assert max(shares[0], shares[1]) > 180 / 3 + 5, shares
    assert {c[2] for c in history.claims} == {0, 1, 2}


@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_a_worker_killed_mid_epoch_loses_nothing(three, rows, mode, tmp_path):
    dying = functools.partial(spread, slow_rank=2, delay=0.01, kill_rank=1, kill_after=12,
                              marker=str(tmp_path / "killed"))
    trainer = _trainer(mode, dying)
    history = trainer.fit(rows, epochs=2, client=three)
    assert (tmp_path / "killed").exists()
    _assert_each_row_once_per_epoch(trainer, history, 2)
    assert any("went back to the pool" in e for e in history.events), history.events


@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_resume_mid_epoch_with_fewer_workers_finishes_the_epoch_once(three, rows, mode,
                                                                      tmp_path):
    # Epochs of about 1.5 s, failing at the 50th of the second's 90 batches (about 0.8 s
    # in, whichever process computes it), after a mid-epoch checkpoint (the driver looks
    # for one every half second).
    failing = functools.partial(spread, pace=0.05, marker=str(tmp_path / "failed"),
                                fail_after=50, fail_epoch=1)
    # In ``average`` an update is a round: short ones, for checkpoints within the epoch.
    rounds = {"mode_options": {"average_every": 2}} if mode == "average" else {}
    first = _trainer(mode, failing, checkpoint_every=5, **rounds)
    with pytest.raises(dt.TrainerError, match="fails once, on purpose"):
        first.fit(rows, epochs=2, client=three, checkpoint=tmp_path / "run")
    state = load_checkpoint(first.last_checkpoint)
    work = state["holder"]["work"]
    assert state["complete_epochs"] == 1 and work["epoch"] == 1
    assert 0 < sum(work["taken"].values()) < 90  # mid-epoch: some done, some not
    second = _trainer(mode, spread, workers=2, **rounds)
    history = second.fit(rows, epochs=2, client=three, resume=first.last_checkpoint)
    if mode == "average":  # the History goes on from the checkpoint's
        assert sum(history.samples) == 2 * ROWS, history.events
    else:
        counts = _counts(second)
        assert np.all(counts == 2), np.unique(counts, return_counts=True)
    assert sum(history.epochs[-1]["batches_per_worker"]) == -(-ROWS // 10)


def test_dynamic_does_not_apply_to_lock_step_modes():
    with pytest.raises(ValueError, match="lock-step"):
        dt.Trainer(tally, spread, register_tally(), mode="sync", assignment="dynamic")
    assert dt.Trainer(tally, spread, register_tally(), mode="average").assignment == "auto"
    with pytest.raises(ValueError, match="assignment must be one of"):
        dt.Trainer(tally, spread, register_tally(), mode="async", assignment="greedy")
    assert dt.Trainer(tally, spread, register_tally(), mode="async").assignment == "auto"



# -- the holder's side ------------------------------------------------------------------
def _claiming_holder() -> ParameterHolder:
    """An ``async`` holder of a 3-value model for two workers that claim their work."""
    return ParameterHolder(HolderConfig(
        model=functools.partial(zeros, 3), optimizer=dt.optim.sgd(1.0), workers=2,
        mode="async", assignment="dynamic", batch_size=1))


def test_a_push_of_a_dropped_worker_is_fenced_and_its_batch_counts_once():
    """Worker 0 claims batches and is dropped (its claims go back), worker 1 claims one of
    them, and both push it: worker 0's incarnation is over, so its push is refused (an
    event, counted) and changes nothing; worker 1's is applied, and the parameters moved
    once."""

    async def scenario():
        holder = _claiming_holder()
        try:
            await holder.begin_epoch(0, True, (4, [0]), 2)
            for w in range(2):
                await holder.join(w, None, holder.layout)
            first = await holder.claim(0, 1, 0)
            await holder.drop(0, "silent")  # what it claimed goes back to the pool
            again = await holder.claim(1, 1, 0)
            ones = np.ones(3, dtype=np.float32)
            with pytest.raises(dt.Fenced, match="dropped"):  # it was alive after all
                await holder.push(0, 1, 0, ones, 1, 0.5, (0, first[0]))
            params, version = await holder.push(1, 1, 0, ones, 1, 0.5, (0, again[0]))
            return first, again, params, version, await holder.progress()
        finally:
            await holder.close()

    first, again, params, version, progress = asyncio.run(scenario())
    assert first[0] == again[0] == 0
    assert version == 1  # one update
    assert progress["records"]["dropped"] == [False]  # one gradient, applied
    assert progress["fenced"] == 1 and progress["members"][0] == "lost"
    assert any("a push from worker 0 (incarnation 1) refused" in e for e in progress["events"])
    # Worker 1 is the only worker left in the epoch: its gradient on the current
    # parameters is the step sync would take, at the full rate.
    np.testing.assert_allclose(params, np.full(3, -1.0, dtype=np.float32))
