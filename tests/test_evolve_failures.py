"""Evolution when processes die: a lost worker's members are evaluated elsewhere and the run
ends where an undisturbed one does; a lost scheduler fails the fit fast, naming the
checkpoint to resume from."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.evolve.driver.checkpoint import load_evolution
from tests.common.evolution import fit_sum, fit_sum_killing_once, flat, tiny_net


@pytest.fixture(scope="module")
def cluster():
    """A cluster of its own: the test kills one of its worker processes."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client


def _evolver(reward) -> dt.Evolver:
    return dt.Evolver(tiny_net, reward=reward, algorithm=dt.evolve.es(0.1), population=8,
                      members_per_task=2, checkpoint_every=1, progress=False)


def test_a_lost_workers_members_are_evaluated_elsewhere(cluster, tmp_path):
    _, client = cluster
    client.wait_for_workers(2, timeout=60)
    reference = _evolver(fit_sum)
    expected = reference.fit(generations=4, client=client)

    def arm_after_generation_2(evolver, record):
        # The next evaluation kills its worker process: in the last generation, so that
        # the run does not wait for the restarted process to import torch.
        if record["generation"] == 2:
            (tmp_path / "arm").touch()

    marker = tmp_path / "killed"
    evolver = _evolver(functools.partial(fit_sum_killing_once, marker=str(marker)))
    history = evolver.fit(generations=4, client=client, callbacks=[arm_after_generation_2])
    assert marker.exists()  # a worker really died mid-generation
    assert history.best == expected.best and history.mean == expected.mean
    assert torch.equal(flat(evolver.model), flat(reference.model))


def test_a_lost_scheduler_fails_fast_and_names_the_checkpoint(tmp_path):
    # Workers as threads of this process (torch is imported already): the test closes the
    # whole cluster mid-run.
    local = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         protocol="tcp://", host="127.0.0.1", **NO_DASHBOARD)
    client = Client(local)

    def lose_the_cluster_after_generation_1(evolver, record):
        if record["generation"] == 1:
            local.close()

    started = time.monotonic()
    try:
        with pytest.raises(dt.EvolutionError, match=r"lost contact with the Dask cluster: "
                           r".*the last checkpoint is .*checkpoint\.pt: continue with "
                           r"fit\(\.\.\., resume=") as failure:
            _evolver(fit_sum).fit(generations=4, client=client,
                                  checkpoint=tmp_path / "run",
                                  callbacks=[lose_the_cluster_after_generation_1])
    finally:
        client.close()
        local.close()
    assert time.monotonic() - started < 60
    assert failure.value.history.generation == [0, 1]
    # The checkpoint it names holds both generations (tests/test_evolve.py resumes one).
    assert load_evolution(tmp_path / "run")["generation"] == 2
