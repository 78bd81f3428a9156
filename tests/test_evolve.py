"""Evolution on a real cluster: one and two workers evaluate the same generations, a resumed
run is the run that never stopped, and bad inputs fail with errors that say what to fix."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.evolve.driver.checkpoint import load_evolution
from tests.common.evolution import (
    drop_copies,
    fit_sum,
    fit_sum_slowly_on,
    flat,
    huge_negative_reward,
    huge_reward,
    nan_reward,
    near_float32_max,
    nudge_copies,
    refusing_reward,
    say_hello,
    tiny_net,
)
from tests.common.training import mse

ALGORITHMS = {"es": dt.evolve.es(0.1, dt.optim.adam(0.05)),
              "ga": dt.evolve.ga(0.05, parents=3)}


def _evolver(algorithm="es", **options) -> dt.Evolver:
    """A tiny evolver of ``tiny_net`` on ``fit_sum``; ``algorithm`` names one of
    ``ALGORITHMS`` or is given as it is."""
    settings = {"reward": fit_sum, "algorithm": ALGORITHMS.get(algorithm, algorithm)
                if isinstance(algorithm, str) else algorithm, "population": 8,
                "members_per_task": 2, "progress": False, **options}
    return dt.Evolver(tiny_net, **settings)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_and_two_workers_evolve_the_same_generations(client, algorithm):
    # Two workers first: on a fresh cluster both processes take up the run's code at once.
    two, one = _evolver(algorithm, workers=2), _evolver(algorithm, workers=1)
    second = two.fit(generations=3, client=client)
    first = one.fit(generations=3, client=client)
    # The same members, the same fitness, the same result, bit for bit.
    assert first.best == second.best and first.mean == second.mean
    assert torch.equal(flat(one.model), flat(two.model))
    assert first.workers == [1, 1, 1] and max(second.workers) == 2
    assert not torch.equal(flat(one.model), flat(tiny_net()))  # it moved
    # Parameters travelled once, at the start; then only ranks and fitness.
    assert second.snapshot_bytes[0] > 0 and second.snapshot_bytes[1:] == [0, 0]
    assert second.missed == [0, 0, 0]
    # Byte for byte (dasktrain.evolve.wire): 4 tasks, each its chunk's index pickled (5
    # bytes); the record (a 20-byte header and 8 ranks of 3 bits) once per worker of the
    # pool; 4 results of 2 float32 fitness values, float32 seconds and an 8-byte worker
    # id, and a 4-byte checksum once per worker that evaluated. A worker that took no task
    # of a generation (the other was quicker to ask) still holds the one before: the next
    # record then carries the ranks of two generations (3 bytes more) for it.
    assert first.record_bytes[1:] == [23] * 2
    sizes = {size * copies for size in (23, 26) for copies in (1, 2)}
    assert all(bytes_ in sizes for bytes_ in second.record_bytes[1:]), second.record_bytes
    for history in (first, second):
        assert history.bytes_sent == [20] * 3
        assert history.bytes_received == [80 + 4 * w for w in history.workers]
    figure = second.plot()
    assert len(figure.axes) == 3


def test_a_slow_worker_evaluates_fewer_members(client):
    """Members are handed out as workers come free: one worker 0.05 s slower per member
    takes a small share of the generation, and the result is the same."""
    slow = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    reward = functools.partial(fit_sum_slowly_on, slow=slow, seconds=0.05)
    evolver = _evolver(reward=reward, population=16)
    history = evolver.fit(generations=2, client=client)
    done = {w: sum(g.get(w, 0) for g in history.members_per_worker)
            for w in history.members_per_worker[0] | history.members_per_worker[1]}
    fast = max(done.values())
    assert sum(done.values()) == 32 and done.get(slow, 0) < fast / 2, done
    assert history.best == _evolver(population=16).fit(generations=2, client=client).best


def test_workers_without_a_copy_of_the_state_get_a_snapshot_and_go_on(client):
    """Workers that lost their copy mid-run (as a restarted or newly joined one has none)
    answer "miss", get a snapshot of the state at the generation, and the run goes on as
    if nothing happened."""
    def forget_after_generation_1(evolver, record):
        if record["generation"] == 1:
            assert sum(client.run(drop_copies).values()) >= 1

    straight = _evolver()
    expected = straight.fit(generations=4, client=client)
    disturbed = _evolver()
    history = disturbed.fit(generations=4, client=client,
                            callbacks=[forget_after_generation_1])
    assert history.missed[:2] == [0, 0] and history.missed[2] >= 1
    assert history.snapshot_bytes[2] > 0 and history.missed[3] == 0
    assert any("got a snapshot (no copy)" in event for event in history.events)
    assert history.best == expected.best
    assert torch.equal(flat(disturbed.model), flat(straight.model))


def test_a_copy_that_drifted_from_the_drivers_stops_the_run(client):
    """Every worker's copy of the state is checked against the driver's, once per
    generation: a copy changed behind the run's back (as other float arithmetic would)
    stops it, naming the worker and the generation."""
    def nudge_after_generation_1(evolver, record):
        if record["generation"] == 1:
            assert sum(client.run(nudge_copies).values()) >= 1

    with pytest.raises(dt.EvolutionError, match=r"worker tcp://\S+'s copy of the run's "
                       r"state at generation 2 differs from the driver's \(checksum \d+ "
                       r"against \d+\): its float arithmetic differs"):
        _evolver().fit(generations=4, client=client, callbacks=[nudge_after_generation_1])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_resumed_run_is_the_run_that_never_stopped(client, regression, tmp_path,
                                                      algorithm):
    """2 generations, a checkpoint, 2 more from it: the 4 generations of one fit. ES on a
    loss over batches of a dataset (Adam's moments travel in the checkpoint), the GA on a
    reward."""
    def make(**options):
        if algorithm == "ga":
            return _evolver(algorithm, **options)
        settings = {"loss": mse, "algorithm": ALGORITHMS["es"], "population": 8,
                    "batch_size": 64, "batches": 2, "progress": False, **options}
        return dt.Evolver(tiny_net, **settings)

    data = regression if algorithm == "es" else None
    straight = make()
    whole = straight.fit(data, generations=4, client=client)
    first = make(checkpoint_every=2)
    first.fit(data, generations=2, client=client, checkpoint=tmp_path / "run")
    assert load_evolution(tmp_path / "run")["generation"] == 2
    resumed = make()
    history = resumed.fit(data, generations=4, client=client, resume=tmp_path / "run")
    assert history.generation == [0, 1, 2, 3]
    assert history.best == whole.best and history.mean == whole.mean
    assert torch.equal(flat(resumed.model), flat(straight.model))
    with pytest.raises(ValueError, match="cannot resume: the checkpoint has population=8, "
                                         "this evolver population=10"):
        make(population=10).fit(data, generations=4, client=client, resume=tmp_path / "run")


def test_a_loss_evolver_evaluates_on_the_cluster(client, regression):
    evolver = dt.Evolver(tiny_net, loss=mse, population=8, batch_size=64, progress=False,
                         metrics={"abs": lambda o, t: (o - t.reshape(o.shape)).abs().mean()})
    history = evolver.fit(regression, generations=2, client=client)
    assert history.fitness == "loss" and not history.maximize
    assert history.best[0] <= history.worst[0]
    metrics = evolver.evaluate(regression, client=client)
    assert set(metrics) == {"loss", "abs"} and np.isfinite(metrics["loss"])


@pytest.mark.parametrize(("reward", "message"), [
    (say_hello, r"the reward returned str 'hello'; it must return one number for member \d "
                "of generation 0"),
    (nan_reward, "the reward returned nan; it must return a finite number"),
    (huge_reward, r"the reward returned 1e\+39, beyond the range of float32 \(±3\.403e\+38\) "
                  r"in which fitness travels; scale it down for member \d of generation 0"),
    (huge_negative_reward, r"the reward returned -1e\+39, beyond the range of float32 .* "
                           r"for member \d of generation 0"),
])
def test_a_reward_that_is_not_one_finite_number_is_named(client, reward, message):
    with pytest.raises(dt.InvalidFitness, match=message):
        _evolver(reward=reward).fit(generations=1, client=client)


def test_fitness_near_float32s_limit_keeps_finite_statistics(client):
    history = _evolver(reward=near_float32_max).fit(generations=2, client=client)
    for series in (history.best, history.mean, history.worst):
        assert all(3e38 <= value <= 3.1e38 for value in series)


def test_a_reward_that_raises_names_its_member_and_generation(client):
    with pytest.raises(dt.FitnessFailed, match=r"the reward of member \d of generation 0 "
                                               r"raised ValueError: this reward refuses every "
                                               r"model") as caught:
        _evolver(reward=refusing_reward).fit(generations=1, client=client)
    assert isinstance(caught.value, dt.EvolutionError)
    assert isinstance(caught.value.error, ValueError) and caught.value.__cause__ is \
        caught.value.error
    notes = "\n".join(caught.value.__notes__)
    assert "in refusing_reward" in notes and "evolution.py" in notes
    assert caught.value.history is not None and caught.value.history.best == []


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"population": 7}, ValueError, "population must be even for ES"),
    ({"loss": mse}, ValueError, "give either reward=fn"),
    ({"reward": None}, ValueError, "give either reward=fn"),
    ({"reward": lambda model, seed, episodes: 0.0}, TypeError, "reward must take"),
    ({"algorithm": "cma"}, ValueError, "unknown algorithm 'cma'"),
    ({"workers": 0}, ValueError, "workers must be a positive integer or None"),
    ({"noise": "uniform"}, ValueError, "noise must be one of"),
    ({"noise": "generator", "noise_size": 100}, ValueError, "noise_size sizes a noise table"),
    ({"algorithm": dt.evolve.ga(parents=9)}, ValueError, r"parents \(9\) cannot exceed"),
])
def test_bad_settings_are_refused_by_name(options, error, message):
    with pytest.raises(error, match=message):
        _evolver(**options)


def test_bad_fit_arguments_are_refused_before_any_cluster_work(regression):
    with pytest.raises(ValueError, match="generations must be a positive integer"):
        _evolver().fit(generations=0)
    with pytest.raises(ValueError, match="has a reward, which takes no data"):
        _evolver().fit(regression, generations=1)
    with pytest.raises(ValueError, match="has a loss: give fit the data"):
        dt.Evolver(tiny_net, loss=mse, progress=False).fit(generations=1)
    with pytest.raises(ValueError, match="evaluate needs a loss"):
        _evolver().evaluate(regression)
