"""Training that goes wrong says so: divergence, shape mistakes, workers' warnings,
oversubscription, paused workers, and checkpoint files that set only what they may."""

from __future__ import annotations

import functools
import time
import uuid
import warnings

import dask
import pytest
import torch
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain.trainer.driver.checkpoint import load_checkpoint, save_checkpoint
from tests.common.training import flat_parameters, mlp, mse


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("hardening") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=400, width=4, chunk_rows=100,
                      seed=4, progress=False)


def _trainer(optimizer=None, loss=mse, model=mlp, **kw):
    kw.setdefault("workers", 2)
    return dt.Trainer(model, loss, optimizer or dt.optim.sgd(0.05), batch_size=16,
                      progress=False, **kw)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_divergent_run_raises_with_its_history_kept(client, regression, mode):
    trainer = _trainer(dt.optim.sgd(1e6), mode=mode)
    with pytest.raises(dt.TrainingDiverged, match="training diverged at update") as caught:
        trainer.fit(regression, epochs=3, client=client)
    message = str(caught.value)
    assert "non-finite" in message and "learning rate" in message
    assert "the last finite loss was" in message
    history = caught.value.history
    assert history is trainer.history
    assert history.updates >= 1 and history.refused_gradients >= 1
    assert not history.epochs  # it stopped inside the first epoch
    assert any("training diverged" in e for e in history.events)
    # The round that diverged was refused: the model keeps the last finite parameters.
    assert torch.isfinite(flat_parameters(trainer.model)).all()


def test_skipping_stops_once_no_gradient_can_be_applied(client, regression):
    def always_nan(output, target):
        return mse(output, target) * float("nan")

    trainer = _trainer(loss=always_nan, on_nonfinite="skip", nonfinite_patience=3)
    with pytest.raises(dt.TrainingDiverged, match=r"every gradient of the last 3 round"):
        trainer.fit(regression, epochs=2, client=client)
    assert trainer.history.refused_gradients == 3 * 2  # 3 rounds of 2 workers
    assert trainer.history.updates == 0


def test_bad_nonfinite_settings_are_refused():
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        _trainer(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="nonfinite_patience must be a positive integer"):
        _trainer(on_nonfinite="skip", nonfinite_patience=0)


def _three_outputs() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_an_output_shape_that_broadcasts_against_the_targets_is_reported(client, regression):
    trainer = _trainer(loss=torch.nn.functional.mse_loss, model=_three_outputs, workers=1)
    with pytest.warns(UserWarning, match=r"output has shape \(16, 3\) but the targets "
                                         r"\(16, 1\)") as caught:
        history = trainer.fit(regression, epochs=1, client=client)
    ours = [w for w in caught if "output has shape" in str(w.message)]
    assert len(ours) == 1  # once per fit, not once per worker or step
    assert any("output has shape" in e for e in history.events)


def _loud_mse(output, target, text):
    warnings.warn(text, RuntimeWarning, stacklevel=1)
    return mse(output, target)


def test_a_warning_raised_in_a_trainer_worker_reaches_the_driver_once(client, regression):
    text = f"odd batch {uuid.uuid4().hex}"  # first of its kind in the workers' processes
    trainer = _trainer(loss=functools.partial(_loud_mse, text=text))
    with pytest.warns(RuntimeWarning, match=text) as caught:
        trainer.fit(regression, epochs=1, client=client)
    assert sum(text in str(w.message) for w in caught) == 1


def test_more_trainer_workers_than_worker_threads_warns(client, regression):
    with pytest.warns(UserWarning, match=r"3 trainer workers on a cluster of 2 worker "
                                         r"thread\(s\).*up to 2 trainer tasks share one"):
        _trainer(workers=3).fit(regression, epochs=1, client=client)


def test_load_refuses_a_checkpoint_that_sets_more_than_mode_options(client, regression,
                                                                    tmp_path):
    trainer = _trainer()
    trainer.fit(regression, epochs=1, client=client)
    path = trainer.save(tmp_path / "model.pt")
    state = load_checkpoint(path)
    state["trainer"]["mode_options"] = {"timeout": 0.001, "holder_worker": "tcp://10.0.0.1:1"}
    save_checkpoint(tmp_path / "tampered.pt", state)
    with pytest.raises(ValueError, match=r"mode 'sync' takes no option\(s\) "
                                         r"\['holder_worker', 'timeout'\]"):
        dt.Trainer.load(tmp_path / "tampered.pt", model=mlp, loss=mse)


def test_mode_options_come_as_a_dict_or_as_keywords_not_both():
    with pytest.raises(TypeError, match="given both"):
        _trainer(mode_options={"x": 1}, x=2)


@pytest.fixture
def paused_cluster():
    """Workers whose memory limit is below what a worker needs once torch is loaded: Dask
    pauses them (the nanny's kill at 95 % is off, so they stay paused)."""
    with dask.config.set({"distributed.worker.memory.terminate": False}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                         dashboard_address=None, memory_limit="150MiB") as cluster, \
            Client(cluster) as c:
        c.run(lambda: __import__("torch"))  # what every trainer task loads first
        yield c


def test_paused_workers_fail_the_fit_fast_with_the_memory_figures(paused_cluster, regression):
    started = time.monotonic()
    with pytest.raises(dt.WorkersPaused) as caught:
        _trainer(workers=1).fit(regression.url, epochs=1, client=paused_cluster)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "paused" in message and "MiB of a 150 MiB limit" in message
    assert "memory_limit" in message and "400 MiB" in message
    assert elapsed < 30, f"took {elapsed:.0f}s to notice"
    assert caught.value.history is not None
