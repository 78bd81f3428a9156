"""One trainer task per worker for the whole fit: the holder ends each epoch and begins the
next, the driver's validation and callbacks see each epoch's exact end while the next one
trains, and a callback that may steer the run holds the next epoch until it returned.

Real processes: the session's two-worker LocalCluster. Which epoch a worker trains is
seen from inside its task (``trainer_place``), and told to the driver through a Dask
``Event``, so no test depends on timing.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import pytest
import torch
from distributed import Event, get_task_stream

import dasktrain as dt
from dasktrain.trainer.worker.loop import trainer_place
from tests.common.training import flat_parameters, mlp, mse, one_process

EPOCHS = 3


_CALLS: collections.Counter = collections.Counter()


def marking_mse(output: torch.Tensor, target: torch.Tensor, event: str) -> torch.Tensor:
    """MSE; a trainer worker at its second batch of epoch 1 sets the Event ``event``: its
    first batch's gradient may be computed ahead, before the holder began the epoch, but
    the second batch comes after the first one's push was answered."""
    place = trainer_place()
    if place is not None and place[1] == 1:
        _CALLS[(event, *place)] += 1
        if _CALLS[(event, *place)] == 2:
            Event(event).set()
    return mse(output, target)


class EpochEnds(dt.Callback):
    """Keeps the model's parameters at each epoch's end, and whether epoch 1 had begun
    while the callback ran for epoch 0 (waiting for it up to ``wait`` seconds)."""

    def __init__(self, steers: bool, event: str, wait: float) -> None:
        self.steers = steers
        self.event, self.wait = event, wait
        self.ends: list[torch.Tensor] = []
        self.next_began_during_callback: bool | None = None

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        self.ends.append(flat_parameters(trainer.model).clone())
        if record["epoch"] == 0:
            self.next_began_during_callback = Event(self.event).wait(self.wait)


def _fit(client, regression, callback: EpochEnds, event: str) -> dt.History:
    trainer = dt.Trainer(mlp, functools.partial(marking_mse, event=event),
                         dt.optim.sgd(0.05, momentum=0.9), mode="sync", workers=2,
                         batch_size=16, progress=False)
    return trainer.fit(regression, epochs=EPOCHS, client=client, callbacks=[callback])


def test_one_task_per_worker_trains_every_epoch(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="sync", workers=2,
                         batch_size=16, progress=False)
    with get_task_stream(client) as stream:
        history = trainer.fit(regression, epochs=EPOCHS, client=client)
    keys = {t["key"] for t in stream.data if str(t["key"]).startswith("dasktrain-trainer-")}
    assert len(keys) == 2, keys  # one per worker, not one per worker and epoch
    assert [e["epoch"] for e in history.epochs] == list(range(EPOCHS))
    assert all(e["workers_finished"] == 2 for e in history.epochs)
    assert all(e["samples"] == 320 for e in history.epochs)
    # Each later epoch says how long each worker trained nothing at its start.
    for record in history.epochs[1:]:
        assert all(w["gap_s"] is not None and w["gap_s"] >= 0 for w in record["per_worker"])


@pytest.mark.filterwarnings("ignore:3 trainer workers on a cluster of 2:UserWarning")
@pytest.mark.parametrize(("workers", "ways"), [(3, {"local": 1, "direct": 2}),
                                               (1, {"local": 1})])
def test_the_holder_goes_beside_the_fewest_trainer_tasks(client, regression, workers, ways):
    """Three trainers on two processes: two share one, and the holder, whose updates are
    serial, goes to the other (beside one trainer, not two: seen from the exchange's
    ways, one local and two over the channel). One trainer: the holder goes beside it,
    not alone."""
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="async", workers=workers,
                         batch_size=16, progress=False)
    history = trainer.fit(regression, epochs=1, client=client)
    assert history.epochs[0]["exchange_via"] == ways


@pytest.mark.parametrize("steers", [False, True], ids=["looks", "steers"])
def test_callbacks_see_each_epochs_end_exactly(client, regression, steers):
    """A callback that only looks runs while the next epoch trains, one that may steer
    before it begins; either sees the parameters one process has after that many
    epochs (sync on 2 x 16 is one process on 32)."""
    event = f"epoch-1-{'steers' if steers else 'looks'}"
    # Waiting for epoch 1 while the callback for epoch 0 runs: it comes at once when the
    # epoch overlaps (so a short wait would do), never when it is held.
    callback = EpochEnds(steers, event, wait=30.0 if not steers else 2.0)
    history = _fit(client, regression, callback, event)
    assert callback.next_began_during_callback is (not steers)
    config = dt.optim.sgd(0.05, momentum=0.9)
    for epochs, seen in enumerate(callback.ends, start=1):
        expected = one_process(regression, mlp, config, 32, epochs, client)
        torch.testing.assert_close(seen, expected, rtol=1e-5, atol=1e-6)
    assert len(history.loss) == EPOCHS * 10  # 320 rows in global batches of 32


class StopAfterFirst(dt.Callback):
    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        trainer.stop_training = True


def test_a_callback_that_stops_the_fit_begins_no_further_epoch(client, regression):
    event = "epoch-1-stopped"
    trainer = dt.Trainer(mlp, functools.partial(marking_mse, event=event),
                         dt.optim.sgd(0.05), mode="sync", workers=2, batch_size=16,
                         progress=False)
    history = trainer.fit(regression, epochs=EPOCHS, client=client,
                          callbacks=[StopAfterFirst()])
    assert [e["epoch"] for e in history.epochs] == [0]
    assert len(history.loss) == 10
    assert not Event(event).is_set()  # epoch 1 never began
    expected = one_process(regression, mlp, dt.optim.sgd(0.05), 32, 1, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)


class StopWithoutSteering(dt.Callback):
    """Says it only looks, yet stops the fit: the next epoch began meanwhile."""

    steers = False

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        trainer.stop_training = True


def test_a_stop_the_next_epoch_did_not_wait_for_keeps_the_epochs_end(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="sync", workers=2,
                         batch_size=16, progress=False)
    history = trainer.fit(regression, epochs=EPOCHS, client=client,
                          callbacks=[StopWithoutSteering()])
    assert [e["epoch"] for e in history.epochs] == [0]
    # The model is the first epoch's end, whatever of epoch 1 was applied before the stop.
    expected = one_process(regression, mlp, dt.optim.sgd(0.05), 32, 1, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
