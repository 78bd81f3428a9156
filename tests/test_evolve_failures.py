"""Evolution when processes die: a lost worker's members are evaluated elsewhere and the run
ends where an undisturbed one does; a generation's update record lost with the workers
holding it is placed again; a lost scheduler fails the fit fast, naming the checkpoint to
resume from."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD, worker_info
from dasktrain.evolve.driver.checkpoint import load_evolution
from tests.common.builders import wait_for
from tests.common.evolution import (
    fit_sum,
    fit_sum_closing_once,
    fit_sum_killing_once,
    flat,
    tiny_net,
)


def _evolver(reward, **options) -> dt.Evolver:
    settings = {"algorithm": dt.evolve.es(0.1), "population": 8, "members_per_task": 2,
                "checkpoint_every": 1, "progress": False, **options}
    return dt.Evolver(tiny_net, reward=reward, **settings)


def test_a_lost_workers_members_are_evaluated_elsewhere(client, tmp_path):
    """A third worker process joins the session's cluster; it is killed (SIGKILL) as it
    evaluates a member of generation 3 or 4, and its nanny starts it again. Dask runs the
    task again on another worker; the run ends where an undisturbed one does, bit for
    bit."""
    def arm_after_generation_2(evolver, record):
        # The victim's next evaluation kills it: late in the run, so that the run does not
        # wait for the restarted process to import torch.
        if record["generation"] == 2:
            (tmp_path / "arm").touch()

    reference = _evolver(fit_sum)
    expected = reference.fit(generations=5, client=client)
    cluster, before = client.cluster, set(worker_info(client))
    cluster.scale(len(before) + 1)
    try:
        client.wait_for_workers(len(before) + 1, timeout=60)
        (victim,) = set(worker_info(client)) - before
        marker = tmp_path / "killed"
        evolver = _evolver(functools.partial(fit_sum_killing_once, marker=str(marker),
                                             victim=victim))
        history = evolver.fit(generations=5, client=client,
                              callbacks=[arm_after_generation_2])
    finally:
        cluster.scale(len(before))
        wait_for(lambda: set(worker_info(client)) == before, 60,
                 "the cluster to be back to its own workers")
    assert marker.exists()  # the victim really died mid-generation
    assert history.best == expected.best and history.mean == expected.mean
    assert torch.equal(flat(evolver.model), flat(reference.model))


def test_a_record_lost_with_its_workers_is_placed_again(tmp_path):
    """With ``workers=1``, the generation's update record and the starting snapshot live on
    the one chosen worker; it stops during generation 0 (workers as threads of this
    process: cheap to start, and one can be stopped from its own task), and with it go the
    record, the snapshot and the tasks waiting for them. The record goes to the other worker
    and the members with it; the run ends where an undisturbed one does."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp://",
                      host="127.0.0.1", **NO_DASHBOARD) as local, Client(local) as own:
        reference = _evolver(fit_sum, workers=1)
        expected = reference.fit(generations=3, client=own)
        marker = tmp_path / "closed"
        (tmp_path / "arm").touch()
        evolver = _evolver(functools.partial(fit_sum_closing_once, marker=str(marker)),
                           workers=1)
        history = evolver.fit(generations=3, client=own)
    assert marker.exists()
    events = "\n".join(history.events)
    assert "generation 0: the workers holding its update record or snapshot were lost" \
        in events, events
    # The two workers share one copy of the run (one process): the first sent its checksum
    # in an answer that was lost with it, so the second's answers come without one, and
    # its members are evaluated again, the checksum asked for.
    assert "generation 0: no checksum came from" in events, events
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
