"""Every update mode on a real cluster: the History's invariants, checkpoint/resume, the
modes that must equal ``sync`` (``average`` with K = 1, ``soft`` with S = N), ``soft``'s S,
convergence on a non-convex problem, and the settings a resume refuses."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.holder.actor import ParameterHolder
from dasktrain.trainer.holder.records import PER_GRADIENT, PER_UPDATE
from dasktrain.trainer.modes import mode_class
from tests.common.training import flat_parameters, mlp, mse, zeros_holder

ROWS, WIDTH, BATCH = 360, 4, 16
BATCHES = math.ceil(ROWS / BATCH)  # 23: odd, so one worker has a step without a batch,
# and the last batch is short (8 rows): the sample weighting matters
MODEL = functools.partial(mlp, WIDTH, 16)
SGD = dt.optim.sgd(0.1, momentum=0.5)
ROUND_MODES = ("sync", "average", "soft")  # at most one entry per worker in an update
OVERSUBSCRIBED = "ignore:3 trainer workers on a cluster of 2 worker thread:UserWarning"


@dataclasses.dataclass(frozen=True)
class Wave:
    """A non-convex regression: y = sin(0.75 * sum(x)), learned by a Tanh MLP."""

    data: dt.Dataset
    x: torch.Tensor
    y: torch.Tensor

    def loss_of(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(mse(model(self.x), self.y))


@pytest.fixture(scope="module")
def wave(client, tmp_path_factory) -> Wave:
    directory = tmp_path_factory.mktemp("modes")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    y = np.sin(0.75 * x.sum(axis=1, keepdims=True)).astype(np.float32)
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", y)
    data = dt.prepare(directory / "x.npy", directory / "wave.zarr", client=client,
                      target=str(directory / "y.npy"), chunk_rows=60, progress=False)
    # What the workers train on, as stored.
    return Wave(data, torch.from_numpy(np.asarray(data.x.compute())),
                torch.from_numpy(np.asarray(data.y.compute())))


def _trainer(mode: str, optimizer: dt.optim.OptimizerConfig = SGD, workers: int = 2,
             **options: Any) -> dt.Trainer:
    return dt.Trainer(MODEL, mse, optimizer, mode=mode, workers=workers, batch_size=BATCH,
                      progress=False, **options)


def _per_update(history: dt.History, name: str) -> list[list]:
    """The per-gradient field ``name`` cut into one list per update."""
    values, at, out = getattr(history, name), 0, []
    for n in history.gradients:
        out.append(values[at : at + n])
        at += n
    return out


def check_invariants(history: dt.History, mode: str, options: dict[str, Any], *,
                     parameters: torch.Tensor) -> None:
    """What every fit's History must satisfy, whatever the mode and timing; ``parameters``
    are the fit's final ones."""
    updates = len(history.version)
    assert history.mode == mode and updates > 0
    for name in PER_UPDATE:
        assert len(getattr(history, name)) == updates, name
    versions = history.version
    assert versions[0] >= 1
    assert all(b > a for a, b in itertools.pairwise(versions)), versions

    # Every per-gradient list has one entry per gradient the updates account for.
    entries = len(history.staleness)
    assert sum(history.gradients) == entries
    fields = mode_class(mode).gradient_fields
    assert set(history.extra) == set(fields)
    for name in (*PER_GRADIENT, *fields):
        assert len(getattr(history, name)) == entries, name
    assert all(s >= 0 for s in history.staleness)
    assert set(history.staleness_worker) <= set(range(history.workers))

    # Every applied gradient is recorded, with the update that applied it.
    for i, (dropped, workers) in enumerate(zip(_per_update(history, "dropped"),
                                               _per_update(history, "staleness_worker"),
                                               strict=True)):
        applied = [w for w, d in zip(workers, dropped, strict=True) if not d]
        assert history.contributors[i] == len(applied) >= 1, (i, workers, dropped)
        if mode in ROUND_MODES:
            assert len(set(applied)) == len(applied), (i, workers)  # one per worker
        else:
            assert len(applied) == 1, (i, workers)  # applied on arrival, one at a time

    assert all(math.isfinite(v) for v in history.loss)
    assert all(n > 0 for n in history.samples)
    assert torch.isfinite(parameters).all()

    rule = options.get("staleness_lr")
    compensated = options.get("dc_lambda") is not None
    for staleness, scale, comp, dropped in zip(history.staleness, history.scale,
                                               history.compensated, history.dropped,
                                               strict=True):
        if dropped:
            assert not comp  # nothing was applied, so nothing was compensated
            continue
        assert scale == (1.0 if rule is None else 1.0 / (1.0 + staleness)), \
            (staleness, scale)
        assert comp == compensated

    if mode in ("sync", "average"):
        assert history.staleness == [0] * entries
        assert not any(history.dropped)
    if mode == "ssp":
        bound = options.get("staleness_bound", 3)
        assert all(0 <= lead <= bound for lead in history.clock_lead), history.clock_lead
    if mode == "soft":
        wait_for = options.get("wait_for") or max(1, history.workers - 1)
        assert max(history.contributors) <= wait_for
        if options.get("late") == "drop":
            assert history.applied_staleness == [0] * len(history.applied_staleness)


# -- 1. invariants of every mode and its main options -------------------------------------
CONFIGS = [
    ("sync", {}),
    ("async", {}),
    ("average", {"average_every": 1}),
    ("average", {"average_every": 3}),
    ("soft", {"wait_for": 1, "late": "next"}),
    ("soft", {"wait_for": 1, "late": "drop"}),
    ("ssp", {"staleness_bound": 0}),
    ("ssp", {"staleness_bound": 2}),
    ("async", {"staleness_lr": "inverse"}),
    ("async", {"dc_lambda": 0.5}),
    ("ssp", {"dc_lambda": 0.5, "dc_adaptive": True}),
]


def _id(config: tuple[str, dict[str, Any]]) -> str:
    mode, options = config
    return "-".join([mode, *(f"{k}={v}" for k, v in options.items())])


@pytest.mark.parametrize("mode, options", CONFIGS, ids=map(_id, CONFIGS))
def test_history_invariants_hold_in_every_mode(client, wave, mode, options):
    trainer = _trainer(mode, **options)
    history = trainer.fit(wave.data, epochs=2, client=client)
    check_invariants(history, mode, options, parameters=flat_parameters(trainer.model))
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    if mode == "soft" and options["late"] == "drop":
        # With S = 1 the other worker's gradient is regularly late: the drop path ran.
        assert any(history.dropped)
        assert sum(history.samples) < 2 * ROWS
    else:  # every batch applied exactly once
        assert not any(history.dropped)
        assert sum(history.samples) == 2 * ROWS
        if options.get("average_every", 1) == 1:  # one contributor per batch
            assert sum(history.contributors) == 2 * BATCHES
    if "staleness_lr" in options:  # stale gradients happened, so the scaling was exercised
        assert min(history.scale) < 1.0
    rounds = math.ceil(math.ceil(BATCHES / 2) / options.get("average_every", 1))
    if mode == "sync":  # lock-step: one update per round of every worker
        assert history.updates == 2 * rounds
    if mode == "average":  # claimed: a push every K batches or fewer (a slower worker)
        assert 2 * rounds <= history.updates <= 2 * BATCHES
    if mode == "async" or mode == "ssp":
        assert history.updates == 2 * BATCHES


# -- 2. checkpoint and resume continue the same run ---------------------------------------
RESUMED = [
    ("sync", {}),
    # Each rank's own stride: deterministic, as claimed work (the default) is not.
    ("average", {"average_every": 3, "assignment": "static"}),
    ("soft", {"wait_for": 1}),
    ("ssp", {"staleness_bound": 1}),
    ("async", {"dc_lambda": 0.5}),
]


@pytest.mark.parametrize("mode, options", RESUMED, ids=map(_id, RESUMED))
def test_resume_continues_the_same_run(client, wave, tmp_path, mode, options, recwarn):
    first = _trainer(mode, **options)
    before = first.fit(wave.data, epochs=1, client=client, checkpoint=tmp_path / "run")
    resumed = _trainer(mode, **options)
    after = resumed.fit(wave.data, epochs=2, client=client, resume=tmp_path / "run",
                        checkpoint=tmp_path / "run")
    check_invariants(after, mode, options, parameters=flat_parameters(resumed.model))

    # The earlier updates, exactly as recorded, then new ones with later versions.
    n = before.updates
    assert 0 < n < after.updates
    old, new = before.records(), after.records()
    for name, values in old.items():
        assert new[name][: len(values)] == values, name
    assert after.version[n] > before.version[-1]
    assert [e["epoch"] for e in after.epochs] == [0, 1]
    assert sum(after.samples[n:]) == ROWS  # the second epoch, every batch once
    # A constant learning rate: more epochs change nothing it depends on.
    assert not [w for w in recwarn if "schedule" in str(w.message)]

    if mode in ("sync", "average"):  # deterministic: the same as never stopping
        straight = _trainer(mode, **options)
        straight.fit(wave.data, epochs=2, client=client)
        torch.testing.assert_close(flat_parameters(resumed.model),
                                   flat_parameters(straight.model), rtol=1e-5, atol=1e-6)
        assert after.version == straight.history.version
        np.testing.assert_allclose(after.loss, straight.history.loss, rtol=1e-5, atol=1e-6)


# -- 3. average with K = 1 is sync ----------------------------------------------------------
def _fit(client, wave, mode: str, optimizer: dt.optim.OptimizerConfig, epochs: int = 2,
         **options: Any) -> dt.Trainer:
    trainer = _trainer(mode, optimizer, **options)
    trainer.fit(wave.data, epochs=epochs, client=client)
    return trainer


def _assert_same_run(trainer: dt.Trainer, reference: dt.Trainer) -> None:
    torch.testing.assert_close(flat_parameters(trainer.model),
                               flat_parameters(reference.model), rtol=1e-5, atol=1e-6)
    got, expected = trainer.history, reference.history
    assert got.updates == expected.updates
    np.testing.assert_allclose(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    assert got.samples == expected.samples
    assert got.contributors == expected.contributors


@pytest.fixture(scope="module")
def sync_sgd(client, wave) -> dt.Trainer:
    """sync, plain SGD: the reference of the modes that must equal it."""
    return _fit(client, wave, "sync", dt.optim.sgd(0.1))


def test_average_every_step_with_plain_sgd_is_sync(client, wave, sync_sgd):
    average = _fit(client, wave, "average", dt.optim.sgd(0.1), average_every=1,
                   assignment="static")
    _assert_same_run(average, sync_sgd)
    # Not a vacuous match: training moved the parameters.
    assert not torch.allclose(flat_parameters(sync_sgd.model), flat_parameters(MODEL()))


def test_average_every_step_with_averaged_momentum_is_sync(client, wave):
    momentum = dt.optim.sgd(0.1, momentum=0.9, weight_decay=1e-3)
    sync = _fit(client, wave, "sync", momentum)
    average = _fit(client, wave, "average", momentum, average_every=1,
                   average_optimizer_state=True, assignment="static")
    _assert_same_run(average, sync)
    # Each worker's own momentum (the default) is another algorithm: the test can tell.
    own = _fit(client, wave, "average", momentum, average_every=1, assignment="static")
    assert not torch.allclose(flat_parameters(own.model), flat_parameters(sync.model),
                              rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [
    dt.optim.sgd(0.1, momentum=0.9, weight_decay=1e-3),
    dt.optim.adamw(1e-2, warmup_steps=5, schedule="cosine"),
], ids=["sgd-momentum", "adamw-cosine"])
def test_average_with_one_worker_is_sync_bit_for_bit(client, wave, optimizer):
    """One replica averaging with itself every K steps trains exactly as ``sync``: the
    same steps, taken by the worker's optimizer instead of the holder's (what a single GPU
    gains: one exchange every K steps, see docs/gpu.md)."""
    sync = _trainer("sync", optimizer, workers=1)
    sync.fit(wave.data, epochs=2, client=client)
    assert sync.history.updates == 2 * BATCHES  # an update per batch (23 an epoch)
    assert not torch.allclose(flat_parameters(sync.model), flat_parameters(MODEL()))
    rounds = []
    for options in ({}, {"average_every": 3}):  # K at its default (10), and 3
        average = _trainer("average", optimizer, workers=1, **options)
        average.fit(wave.data, epochs=2, client=client)
        assert torch.equal(flat_parameters(average.model), flat_parameters(sync.model))
        assert [e["train"]["loss"] for e in average.history.epochs] == \
            [e["train"]["loss"] for e in sync.history.epochs]
        rounds.append(average.history.updates)
    # An update per run of at most K batches: fewer than sync's, and fewer the larger K.
    assert 2 * 3 <= rounds[0] < rounds[1] < sync.history.updates


# -- 4. soft applies S gradients per update -------------------------------------------------
@pytest.mark.filterwarnings(OVERSUBSCRIBED)
def test_soft_applies_wait_for_gradients_per_update(client, wave):
    options = {"wait_for": 2}
    trainer = _trainer("soft", workers=3, **options)
    history = trainer.fit(wave.data, epochs=2, client=client)
    check_invariants(history, "soft", options, parameters=flat_parameters(trainer.model))
    assert history.workers == 3
    assert set(history.staleness_worker) == {0, 1, 2}
    assert max(history.contributors) == 2
    # Fewer only when fewer than two workers are left at the end of an epoch: each epoch's
    # updates take two, then one each (how many of those depends on how far the slowest
    # of 3 workers sharing 2 cores trails: 6 of 26 in one loaded run).
    epoch_of = np.cumsum(history.samples) > ROWS  # an update's samples are of one epoch
    for epoch in (False, True):
        taken = [c for c, e in zip(history.contributors, epoch_of, strict=True)
                 if e == epoch]
        assert taken[0] == 2 and taken == sorted(taken, reverse=True), history.contributors
    assert sum(history.contributors) == 2 * BATCHES and sum(history.samples) == 2 * ROWS
    assert not any(history.dropped)


def test_soft_takes_min_of_wait_for_and_live_workers_exactly():
    """The rule behind the test above, step by step on a real holder (plain SGD at lr 1
    from zeros: the parameters are minus the sum of the updates' averages)."""

    async def scenario():
        config = zeros_holder(2, workers=3, mode="soft")
        config.mode_options = {"wait_for": 2}
        holder = ParameterHolder(config)
        await holder.begin_epoch(0)
        for w in range(3):
            await holder.join(w, None, holder.layout)

        def push(worker, version, step):  # worker w's gradient is w + 1 everywhere
            grads = np.full(2, worker + 1, dtype=np.float32)
            return holder.push(worker, 1, version, grads, 1, 0.5, (0, step))

        async def leave(*workers):
            for w in workers:
                await holder.leave(w, 1)

        # gather starts the pushes in order; each waits until its round is applied.
        await asyncio.gather(push(0, 0, 1), push(1, 0, 1))  # S of them: applied
        await asyncio.gather(push(2, 0, 1), push(0, 1, 2))  # 2's is late: joins this one
        await asyncio.gather(push(1, 1, 2), leave(0, 2))  # one live worker left: alone
        params, version = await holder.pull()
        records = (await holder.progress())["records"]
        await holder.close()
        return params, version, records

    params, version, records = asyncio.run(scenario())
    assert version == 3
    assert records["contributors"] == [2, 2, 1]
    assert records["staleness_worker"] == [0, 1, 0, 2, 1]
    assert records["staleness"] == [0, 0, 0, 1, 1]
    np.testing.assert_array_equal(params, np.full(2, -(1.5 + 2.0 + 2.0), dtype=np.float32))


def test_soft_waiting_for_every_worker_is_sync(client, wave, sync_sgd):
    # Rank-strided batches: each round then takes the union batch of a sync step.
    soft = _fit(client, wave, "soft", dt.optim.sgd(0.1), wait_for=2, assignment="static")
    _assert_same_run(soft, sync_sgd)
    assert soft.history.staleness == [0] * len(soft.history.staleness)


# -- 5. every mode converges on a non-convex problem --------------------------------------
@pytest.mark.parametrize("mode", ["sync", "average", "soft", "ssp", "async"])
def test_every_mode_converges(client, wave, mode):
    start = wave.loss_of(MODEL())
    trainer = _trainer(mode)  # the mode's defaults
    # Six epochs: the stale-gradient modes move as far per sample as sync at most, and with
    # 2 workers their staleness takes the place of momentum 0.5 (docs/modes.md).
    history = trainer.fit(wave.data, epochs=6, client=client)
    check_invariants(history, mode, {}, parameters=flat_parameters(trainer.model))
    # On the whole data: the last updates' losses are of single batches of 16 rows (8 at
    # an epoch's end), too few to judge by.
    final = wave.loss_of(trainer.model)
    assert final < 0.5 * start, (final, start, history.events)


# -- 6. what a resume refuses, and what it allows -----------------------------------------
SCHEDULE = dt.optim.sgd(0.1, schedule="cosine")


@pytest.fixture(scope="module")
def average_run(client, wave, tmp_path_factory):
    """A checkpoint of one epoch of ``average`` (K = 2, each worker on its own stride: a
    known number of rounds) under a cosine schedule."""
    path = tmp_path_factory.mktemp("average-run")
    trainer = _trainer("average", SCHEDULE, average_every=2, assignment="static")
    history = trainer.fit(wave.data, epochs=1, client=client, checkpoint=path)
    return path, history


@pytest.mark.parametrize("change, setting", [
    ({"shuffle": False}, "shuffle"),
    ({"block_rows": 30}, "block_rows"),
    ({"optimizer": dt.optim.sgd(0.2, schedule="cosine")}, "optimizer"),
    ({"average_every": 3}, "mode_options"),
    ({"mode": "sync", "average_every": None}, "mode"),
], ids=["shuffle", "block_rows", "lr", "average_every", "mode"])
def test_resume_refuses_a_changed_setting(client, wave, average_run, change, setting):
    path, _ = average_run
    kwargs: dict[str, Any] = {"mode": "average", "optimizer": SCHEDULE, "average_every": 2,
                              "assignment": "static", **change}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    with pytest.raises(ValueError, match=f"made with {setting}=") as refused:
        _trainer(**kwargs).fit(wave.data, epochs=2, client=client, resume=path)
    message = str(refused.value)
    if setting == "optimizer":
        assert "'lr': 0.1" in message and "'lr': 0.2" in message
    if setting == "mode_options":
        assert "'average_every': 2" in message and "'average_every': 3" in message


def _resume_with_more_epochs(client, wave, path, before: dt.History, mode: str,
                             schedule_per_epoch: int, **options: Any) -> None:
    """``schedule_per_epoch``: steps of the learning-rate schedule in one epoch (holder
    updates, or the workers' local steps in ``average``)."""
    trainer = _trainer(mode, SCHEDULE, **options)
    per_epoch = before.updates
    with pytest.warns(UserWarning, match=f"the schedule now spans {2 * schedule_per_epoch} "
                                         f"steps instead of {schedule_per_epoch}"):
        after = trainer.fit(wave.data, epochs=2, client=client, resume=path)
    assert after.updates == 2 * per_epoch
    assert after.version[:per_epoch] == before.version
    assert after.loss[:per_epoch] == before.loss
    assert [e["epoch"] for e in after.epochs] == [0, 1]


def test_resume_with_more_epochs_warns_of_the_longer_schedule_sync(client, wave, tmp_path):
    trainer = _trainer("sync", SCHEDULE)
    before = trainer.fit(wave.data, epochs=1, client=client, checkpoint=tmp_path)
    assert before.updates == math.ceil(BATCHES / 2)
    _resume_with_more_epochs(client, wave, tmp_path, before, "sync", before.updates)


def test_resume_with_more_epochs_warns_of_the_longer_schedule_average(client, wave,
                                                                      average_run):
    path, before = average_run
    assert before.updates == math.ceil(math.ceil(BATCHES / 2) / 2)
    _resume_with_more_epochs(client, wave, path, before, "average", math.ceil(BATCHES / 2),
                             average_every=2, assignment="static")
