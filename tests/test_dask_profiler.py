"""Dask's statistical profiler is paused on the workers while they train, and runs again
once the fit has ended; ``pause_dask_profiler=False`` leaves it running."""

from __future__ import annotations

import pytest

import dasktrain as dt
from tests.common.training import mlp, mse


def _running(dask_worker) -> bool:
    return dask_worker.periodic_callbacks["profile"].is_running()


@pytest.mark.parametrize("pause", [True, False])
def test_the_profiler_is_paused_while_workers_train(client, regression, pause):
    during: list[dict] = []

    def look(trainer, record):  # on the driver, while the trainer tasks still run
        if record["epoch"] == 0:
            during.append(client.run(_running))

    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="sync", workers=2,
                         batch_size=16, pause_dask_profiler=pause, progress=False)
    assert all(client.run(_running).values())
    trainer.fit(regression, epochs=2, client=client, callbacks=[look])
    assert during and set(during[0].values()) == {not pause}
    # Started again as the last trainer task of each worker ended: its restart was queued
    # on the worker's loop before the task's result, which the fit waited for.
    assert all(client.run(_running).values())
