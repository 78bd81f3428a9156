"""Elastic runs (``workers=(least, most)``): a fit takes up a Dask worker the cluster gains
mid-epoch and lets a retired one go, with no restart and every sample applied once per
epoch.

Each test starts a cluster of two worker processes of its own, scales it to three while the
first epoch runs (``cluster.scale``), and retires the added worker once its trainer worker
has pushed (``client.retire_workers``), from a callback on the driver, in a thread of its
own so that the driver keeps polling meanwhile.
"""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path

import numpy as np
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import worker_info
from tests.common.counting import ROWS, Tally, paced_mse, register_tally, spread, tally
from tests.common.data import indexed_dataset
from tests.common.training import mlp


class ScaleUpThenRetire(dt.Callback):
    """Scale the cluster to three workers as the fit starts (the new process is up a few
    seconds later, in the first epoch); ``retire_after`` updates into the second epoch or
    later, once the added worker's trainer (rank 2) has pushed, retire the added Dask
    worker."""

    def __init__(self, cluster: LocalCluster, client: Client, retire_after: int = 20) -> None:
        self.cluster, self.client = cluster, client
        self.retire_after = retire_after
        self.first = set(worker_info(client))
        self.epochs_done = 0
        self.in_epoch = 0
        self.third_pushed = False
        self.threads: list[threading.Thread] = []
        self.added: list[str] = []
        self.retired: list[str] = []

    def on_fit_start(self, trainer) -> None:
        self._in_thread(self._grow)

    def _grow(self) -> None:
        self.cluster.scale(3)
        self.client.wait_for_workers(3, timeout=60)
        self.added = sorted(set(worker_info(self.client)) - self.first)

    def on_epoch_end(self, trainer, record) -> None:
        self.epochs_done += 1
        self.in_epoch = 0

    def on_update(self, trainer, records) -> None:
        self.in_epoch += len(records["loss"])
        self.third_pushed = self.third_pushed or 2 in records.get("staleness_worker", ())
        if self.epochs_done >= 1 and self.in_epoch >= self.retire_after \
                and self.third_pushed and len(self.threads) == 1 and self.added:
            self.retired = self.added
            self._in_thread(lambda: self.client.retire_workers(self.retired))

    def _in_thread(self, action) -> None:
        thread = threading.Thread(target=action, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=60)
            assert not thread.is_alive()


def _elastic_fit(model, loss, optimizer, data_of, epochs: int, mode: str = "async",
                 fixed: bool = False, **options):
    """An elastic fit on a cluster of its own; with ``fixed``, then the same fit on two
    workers on the same cluster (back to two processes), for comparison."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        data = data_of(client)
        holder = sorted(worker_info(client))[0]
        scaling = ScaleUpThenRetire(cluster, client)
        trainer = dt.Trainer(model, loss, optimizer, mode=mode, workers=(2, 3),
                             batch_size=10, holder_worker=holder, progress=False, **options)
        history = trainer.fit(data, epochs=epochs, client=client, callbacks=[scaling])
        scaling.join()
        if not fixed:
            return trainer, history, scaling
        reference = dt.Trainer(model, loss, optimizer, mode=mode, workers=2, batch_size=10,
                               progress=False)
        reference.fit(data, epochs=epochs, client=client)
        return (trainer.evaluate(data, client=client), reference.evaluate(data, client=client),
                history)


def test_a_run_grows_and_shrinks_with_the_cluster_and_applies_each_row_once(tmp_path, capfd):
    # Epochs of 90 batches of 80 ms (about 3.6 s on two workers): the worker added as the
    # fit starts is up (a new process: a few seconds) before the first ends.
    slow = functools.partial(spread, pace=0.08)
    trainer, history, scaling = _elastic_fit(
        tally, slow, register_tally(),
        lambda c: indexed_dataset(c, tmp_path, rows=ROWS, chunk_rows=150), epochs=3)
    counts = trainer.model.w.detach().numpy()
    assert np.all(counts == 3), (np.unique(counts, return_counts=True), history.events)
    _assert_grew_and_shrank(history, scaling)
    assert history.epochs[-1]["workers_finished"] == 2  # the retired one is gone
    # The retirement reads as one: the cluster's processes (their output is this test's
    # until the cluster closed) logged no error, traceback or cancelled trainer task.
    logged = capfd.readouterr().err
    for sign in ("ERROR", "Traceback", "died unexpectedly", "never awaited",
                 "Task cancelled", "unaware of this worker"):
        assert sign not in logged, logged[-3000:]


def _assert_grew_and_shrank(history, scaling, waited_for: bool = False) -> None:
    """A trainer worker took work on the added Dask worker (joining mid-epoch when its
    process is up in time, else at the next epoch's start), and left when it was retired,
    handing back what it had claimed; nobody restarted. ``waited_for``: the mode's rounds
    wait for every worker, and the scheduler forgets a retired worker before its task
    hears of it, so the holder's watch may find it gone and drop it before its leave
    arrives (test_chaos.py's retire cases): either way it goes out once."""
    events = "\n".join(history.events)
    went = [e for e in history.events if "left: its Dask worker is retiring" in e
            or (waited_for and "worker 2 dropped: its Dask worker" in e and "is gone" in e)]
    assert scaling.retired and len(went) == 1, events
    # No restart: workers 0 and 1 never rejoined, never came back, never were dropped.
    assert not any(w in e for e in history.events if e not in went
                   for w in ("rejoined", "came back", "dropped")), events
    shares = [record["batches_per_worker"] for record in history.epochs]
    assert all(sum(s) == ROWS // 10 for s in shares)
    assert any(len(s) > 2 and s[2] > 0 for s in shares), shares


def test_an_elastic_run_ends_near_a_fixed_size_one(tmp_path):
    def data_of(client):
        return dt.prepare("regression", tmp_path / "reg.zarr", client=client, samples=1800,
                          width=4, chunk_rows=300, seed=3, progress=False)

    slowed = functools.partial(paced_mse, pace=0.02)
    grown, fixed, history = _elastic_fit(mlp, slowed, dt.optim.sgd(0.05, momentum=0.9),
                                         data_of, epochs=3, fixed=True)
    assert grown["loss"] < 1.5 * fixed["loss"] + 1e-3, (grown, fixed, history.events)


def test_an_averaging_run_grows_and_shrinks_and_applies_each_sample_once(tmp_path):
    # ``average`` claims work too: the added worker takes part in rounds mid-run and the
    # retired one leaves between them. A row's count reaches the parameters divided by a
    # round's average there, so the applied samples are counted instead.
    slow = functools.partial(spread, pace=0.08)
    _, history, scaling = _elastic_fit(
        tally, slow, register_tally(),
        lambda c: indexed_dataset(c, tmp_path, rows=ROWS, chunk_rows=150), epochs=3,
        mode="average", average_every=1)  # rounds of a batch: enough updates to retire on
    assert sum(history.samples) == 3 * ROWS, history.events
    assert not any(history.dropped), history.events
    _assert_grew_and_shrank(history, scaling, waited_for=True)


def _tally_opening(rows: int, marker: str, gate: str):
    """Tally; the task of trainer worker 1 run after the kill (``marker`` exists) opens
    ``gate`` as it builds its model, just before it joins the holder."""
    from dasktrain.trainer.worker.loop import trainer_place

    task = trainer_place()
    if task is not None and task[0] == 1 and Path(marker).exists():
        Path(gate).touch()
    return Tally(rows)


def _gated_after_kill(output, target, marker: str, gate: str):
    """spread, whose third batch kills trainer worker 1's process (once); once the kill
    happened, trainer worker 0 waits (at most 60 s) for the gate: the epoch cannot end
    before worker 1's new task has joined."""
    from dasktrain.trainer.worker.loop import trainer_place
    from tests.common.builders import wait_for

    task = trainer_place()
    if task is not None and task[0] == 0 and Path(marker).exists():
        wait_for(Path(gate).exists, 60, f"the gate {gate}")
    return spread(output, target, pace=0.004, kill_rank=1, kill_after=3, marker=marker)


def test_a_killed_workers_restarted_process_trains_again_in_the_same_epoch(tmp_path):
    """A range of workers on a cluster of as many processes: no warning of trainers
    sharing a process; a worker's process SIGKILLed mid-epoch and started again by its
    nanny gets its trainer worker back (same number, new incarnation, its new address
    named) in that epoch, not once the next begins; numbers stay the same for the fit."""
    marker, gate = str(tmp_path / "killed"), str(tmp_path / "gate")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        data = indexed_dataset(client, tmp_path, rows=240, chunk_rows=60)
        holder = sorted(worker_info(client))[0]
        trainer = dt.Trainer(functools.partial(_tally_opening, 240, marker, gate),
                             functools.partial(_gated_after_kill, marker=marker, gate=gate),
                             register_tally(), mode="async", workers=(2, 3), batch_size=8,
                             holder_worker=holder, progress=False, timeout=60)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = trainer.fit(data, epochs=2, client=client)
    assert not [w for w in caught if "share one Dask worker" in str(w.message)], caught
    events = "\n".join(history.events)
    assert Path(marker).exists(), events
    old = next(e for e in history.events if "worker 1 joined on" in e)
    dropped = next(e for e in history.events if "worker 1 dropped" in e)
    back = next(e for e in history.events if "worker 1 rejoined on" in e)
    old_address = old.split(" on ")[1].split(" ")[0]
    assert f"on {old_address}, incarnation 1" in dropped, events  # where it was lost
    assert old_address not in back and "(incarnation 2)" in back, events
    # The new task reported for the epoch of the kill: it trained in it.
    assert 1 in [w["worker"] for w in history.epochs[0]["per_worker"]], events
    assert {w["worker"] for r in history.epochs for w in r["per_worker"]} == {0, 1}, events
    counts = trainer.model.w.detach().numpy()
    assert np.all(counts == 2), (np.unique(counts, return_counts=True), events)
