"""Chaos, in the suite: every update mode under every kind of fault, each fit bounded in
time, and after each epoch every row applied exactly once.

The model is ``Tally`` (:mod:`tests.common.counting`): one parameter per row of an indexed
dataset, and an optimizer that adds one per application of a row's gradient, so after each
epoch the parameters have moved by exactly one everywhere, or some row was lost or applied
twice. In ``average`` a worker's parameters are averaged (a row's count arrives divided),
so there the samples the holder applied in each epoch are counted instead.

Faults, on a cluster of three worker processes (the holder beside trainer worker 0 as a rule):

* a trainer worker's process (never the holder's) SIGKILLed at a point of its life the test
  names (see :mod:`dasktrain.trainer.faults`): with a claim of work on its way (``claim``),
  with a push on its way (``push``), with the push of its last batch of an epoch on its way
  (``last``: the end of its stride, or the batch that ends the epoch's work), or after it
  left an epoch and asked for the next (``boundary``). In ``sync`` (ranks own a stride) Dask
  runs the task again and it joins with a new incarnation; elsewhere the others carry on.
* its Dask worker retired mid-epoch (``retire``: an elastic run), or a Dask worker added
  (``scale``: an elastic run takes it up).

A dead incarnation's late frame is covered step by step in :mod:`tests.test_fencing`.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client, LocalCluster

import dasktrain as dt
from tests.common.chaos import (
    gated_spread,
    gated_tally,
    killed_at,
    killed_worker,
    plan_kill,
    unplan,
)
from tests.common.counting import Tally, register_tally
from tests.common.data import indexed_dataset
from tests.common.training import alive_workers

ROWS, BATCH = 240, 8  # 30 batches an epoch
EPOCHS = 4
MODES = {"async": {}, "soft": {}, "ssp": {"staleness_bound": 2}, "average": {"average_every": 2},
         "sync": {}}
KILLS = {"claim": {"nth": 3}, "push": {"nth": 5}, "last": {"last": True},
         "boundary": {}}
CASES = [(mode, fault) for mode in MODES for fault in [*KILLS, "retire", "scale"]
         if not (mode == "sync" and fault == "claim")]  # sync claims nothing


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        yield cluster, client


@pytest.fixture(scope="module")
def rows(cluster, tmp_path_factory):
    return indexed_dataset(cluster[1], tmp_path_factory.mktemp("chaos"), rows=ROWS,
                           chunk_rows=60)


class EpochTallies(dt.Callback):
    """The parameters at each epoch's end (in the driver)."""

    steers = False

    def __init__(self) -> None:
        self.ends: list[np.ndarray] = []

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        self.ends.append(trainer.model.w.detach().numpy().copy())


class AfterFirstEpoch(dt.Callback):
    """Runs ``action`` on a thread (a retirement waits for the worker to leave) as the
    first epoch ends, while the workers go on into the second."""

    steers = False

    def __init__(self, action: Any) -> None:
        self.action = action
        self.thread: threading.Thread | None = None

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.action, daemon=True)
            self.thread.start()


def _assert_every_row_once_per_epoch(mode: str, history: dt.History,
                                     tallies: EpochTallies) -> None:
    assert len(history.epochs) == EPOCHS, history.events
    assert not any(history.dropped), history.events
    # Each epoch's samples and training loss are what the holder applied, a dead or
    # retired worker's batches included (in average: the check that every row counted).
    assert [r["samples"] for r in history.epochs] == [ROWS] * EPOCHS, history.events
    by_epochs = sum(r["train"]["loss"] * r["samples"] for r in history.epochs)
    by_updates = sum(loss * n for loss, n in zip(history.loss, history.samples, strict=True))
    assert by_epochs == pytest.approx(by_updates, rel=1e-6), history.events
    if mode == "average":
        return
    before = np.zeros(ROWS, dtype=np.float32)
    for epoch, after in enumerate(tallies.ends):
        counts = after - before
        assert np.array_equal(counts, np.ones(ROWS, dtype=np.float32)), (
            epoch, np.unique(counts, return_counts=True), history.events)
        before = after


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "fault"), CASES)
def test_every_row_once_per_epoch_whatever_fails(cluster, rows, tmp_path, mode, fault):
    if fault in ("retire", "scale"):  # the cluster changes: one of its own
        with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                          host="127.0.0.1", dashboard_address=None) as local, \
                Client(local) as client:
            client.wait_for_workers(3, timeout=60)
            _fit_through(local, client, rows, tmp_path, mode, fault)
    else:
        _fit_through(*cluster, rows, tmp_path, mode, fault)


def _fit_through(local: LocalCluster, client: Client, rows: Any, tmp_path: Path, mode: str,
                 fault: str) -> None:
    """A fit of ``mode`` through ``fault``; every row applied once per epoch."""
    addresses = alive_workers(client, 3)
    holder = addresses[0]  # the worker beside it is never the victim (see tests.common.chaos)
    elastic = fault in ("retire", "scale")
    marker = str(tmp_path / "killed")
    gate = str(tmp_path / "gate")
    callbacks: list[dt.Callback] = [EpochTallies()]
    model, loss = functools.partial(Tally, ROWS), functools.partial(gated_spread, holder=holder)
    if fault in KILLS:
        point = "push" if fault == "last" else fault
        client.run(plan_kill, point, marker, (0, 1), 1, holder=holder, **KILLS[fault])
    elif fault == "retire":  # trainer worker 2's Dask worker; the others wait for it to go
        leaving = addresses[2]

        def retire() -> None:
            client.retire_workers([leaving])
            Path(gate).touch()

        callbacks.append(AfterFirstEpoch(retire))
        loss = functools.partial(gated_spread, gate=gate, holder=holder)
    else:  # a fourth Dask worker: trainer worker 3 joins, the others wait until it does
        # One more worker process: the cluster's own count of its workers still has those
        # an earlier test retired (see _three_workers).
        callbacks.append(AfterFirstEpoch(lambda: local.scale(len(local.worker_spec) + 1)))
        model = functools.partial(gated_tally, ROWS, gate, 3)
        loss = functools.partial(gated_spread, gate=gate, holder=holder)
    trainer = dt.Trainer(model, loss, register_tally(), mode=mode,
                         workers=(2, 4) if elastic else 2, batch_size=BATCH,
                         holder_worker=holder, progress=False, timeout=60,
                         barrier_timeout=30, **MODES[mode])
    try:
        history = trainer.fit(rows, epochs=EPOCHS, client=client, callbacks=callbacks)
    except dt.TrainerError as error:
        raise AssertionError(f"the fit failed: {error}\n" + "\n".join(
            error.history.events if error.history is not None else [])) from error
    finally:
        client.run(unplan)
        for callback in callbacks[1:]:
            if callback.thread is not None:
                callback.thread.join(timeout=30)
    _assert_every_row_once_per_epoch(mode, history, callbacks[0])
    events = " | ".join(history.events)
    if fault in KILLS:
        assert killed_at(marker) is not None, events  # the fault happened
        victim = killed_worker(marker)
        assert any(f"worker {victim} dropped" in e or f"worker {victim}'s earlier task is "
                   "superseded" in e for e in history.events), events
        if mode == "sync":  # its stride is finished by its task, run again
            assert f"worker {victim} rejoined" in events, events
    elif fault == "retire":
        # Where work is claimed, the worker leaves with the batch in hand done; where its
        # rank owns a stride, its task is run again on another Dask worker to finish it.
        # The scheduler forgets a retired worker at once, so the holder's watch may see its
        # Dask worker gone before the leave arrives (in `average`, a run of local steps
        # later): then it is dropped, and its leave refused. Either way it goes out once
        # and what it claimed goes back to the pool (the rows, checked above).
        went = [e for e in history.events
                if "worker 2 left: its Dask worker is retiring" in e
                or ("worker 2 dropped: its Dask worker" in e and "is gone" in e)]
        assert len(went) == 1 or (mode == "sync" and "worker 2 rejoined" in events), events
    else:
        assert "worker 3 joined" in events, events
        # From the next epoch on it counts in the world (the added process may be up
        # only during the last epoch: then there is no next one).
        if any(w["worker"] == 3 for r in history.epochs[:-1] for w in r["per_worker"]):
            assert "4 trainer worker(s) (was 3)" in events, events
