"""What a failing fit tells its user, and the habits around failure: a loss that is not a
scalar named by its shape, the driver's error alone on the terminal (no worker log noise,
checked on real processes: a user's script and ``dasktrain train``), ``on_exception``,
skipped non-finite batches out of the epoch's loss, and checkpoints on object storage with
``storage_options``."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import dasktrain as dt
from dasktrain.cli import _toml_writer
from dasktrain.trainer.errors import InvalidLoss
from tests.common.builders import REPO, run_cli
from tests.common.data import indexed_dataset
from tests.common.object_storage import s3_server  # noqa: F401  (the s3 fixture)
from tests.common.training import flat_parameters, mlp, mse

SCALAR = r"the loss must return a scalar \(reduce it, e.g. reduction='mean'\); it returned shape"


def _trainer(loss=mse, optimizer=None, **kw) -> dt.Trainer:
    kw.setdefault("workers", 2)
    return dt.Trainer(mlp, loss, optimizer or dt.optim.sgd(0.05), batch_size=16,
                      progress=False, **kw)


def per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss left unreduced: shape (batch,)."""
    return (output - target.reshape(output.shape)).square().sum(dim=1)


def per_sample_step(model: torch.nn.Module, batch) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": per_sample(model(x), y)}


# -- a loss that is not a scalar -----------------------------------------------------------
def test_a_loss_per_sample_is_refused_naming_its_shape(client, regression):
    trainer = _trainer(per_sample)
    with pytest.raises(InvalidLoss, match=SCALAR + r" \(16,\)") as caught:
        trainer.fit(regression, epochs=1, client=client)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, dt.TrainerError)
    assert "only one element tensors" not in str(caught.value)
    # Evaluation computes the same loss: one block of 80 rows (the dataset's chunks).
    with pytest.raises(InvalidLoss, match=SCALAR + r" \(80,\)"):
        trainer.evaluate(regression, client=client)


def test_a_custom_step_returning_a_loss_per_sample_is_refused(client, regression):
    trainer = _trainer(None, step=per_sample_step, workers=1)
    with pytest.raises(InvalidLoss, match=SCALAR + r" \(16,\)"):
        trainer.fit(regression, epochs=1, client=client)


def bad_target(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("this loss refuses every target")


def test_an_error_in_the_users_loss_names_the_worker_and_keeps_its_traceback(client,
                                                                            regression):
    with pytest.raises(dt.TrainerError, match=r"trainer worker \d failed: ValueError: this "
                                              r"loss refuses every target") as caught:
        _trainer(bad_target).fit(regression, epochs=1, client=client)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "in trainer worker" in notes and "def bad_target" not in notes
    assert "test_trainer_messages.py" in notes and "in bad_target" in notes
    assert isinstance(caught.value.__cause__, ValueError)


# -- the terminal of a failed fit ----------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import dasktrain as dt

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 1))

    if __name__ == "__main__":
        torch.set_num_threads(1)
        client = None
        if sys.argv[2] == "own":  # the user's cluster, with distributed's default logging
            from distributed import Client, LocalCluster
            client = Client(LocalCluster(n_workers=2, threads_per_worker=1,
                                         host="127.0.0.1", dashboard_address=":0"))
        data = dt.prepare("regression", os.path.join(sys.argv[1], "d.zarr"), samples=400,
                          width=4, chunk_rows=100, progress=False)
        trainer = dt.Trainer(model, torch.nn.functional.mse_loss, dt.optim.sgd(1e6),
                             workers=2, batch_size=16, progress=False)
        trainer.fit(data, epochs=3, client=client)
""")

#: What a worker's log adds to the terminal when a task fails or is cancelled.
WORKER_NOISE = ("Compute Failed", "Async instruction", "distributed.worker",
                "During handling of the above exception", "trainer/worker/loop.py",
                "trainer/holder/actor.py")


def _assert_no_worker_noise(output: str) -> None:
    for noise in WORKER_NOISE:
        assert noise not in output, output


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["embedded", "own"])
def test_a_diverged_script_shows_the_drivers_error_alone(tmp_path, cluster):
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), cluster],
                          capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    _assert_no_worker_noise(output)
    # Python's report of the uncaught error: one traceback, the driver's, ending in ours.
    assert output.count("Traceback (most recent call last)") == 1, output
    lines = done.stderr.strip().splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith(
        "dasktrain.trainer.errors.TrainingDiverged: training diverged at update")]
    assert len(ours) == 1, done.stderr
    if cluster == "embedded":  # nothing after it; a cluster of the user's own, left open
        assert ours[0] == len(lines) - 1, done.stderr  # at exit, may log its shutdown


@pytest.mark.slow
def test_dasktrain_train_that_diverges_prints_one_line(regression, tmp_path):
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    config = tmp_path / "train.toml"
    config.write_text(_toml_writer.dumps({
        "data": {"path": regression.url},
        "model": {"factory": "models.py:mlp",
                  "kwargs": {"features": 4, "hidden": 8, "classes": 1}},
        "loss": {"name": "mse_loss"},
        "optimizer": {"name": "sgd", "lr": 1e6},
        "trainer": {"epochs": 2, "workers": 2, "batch_size": 16},
        "run": {"dir": "runs/a"}}))
    # No --scheduler: the command's own embedded cluster, whose workers share its terminal.
    done = run_cli("train", str(config), "--no-progress", timeout=170)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    _assert_no_worker_noise(output)
    assert "Traceback" not in output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("dasktrain train: training stopped: training diverged at "
                               "update"), lines[0]


def test_trainer_tasks_of_a_failed_fit_leave_no_compute_failed_in_worker_logs(client,
                                                                              regression):
    # A user's cluster keeps its own logging; our failing tasks just give it nothing to log.
    with pytest.raises(dt.TrainingDiverged):
        _trainer(optimizer=dt.optim.sgd(1e6)).fit(regression, epochs=3, client=client)
    logs = [message for records in client.get_worker_logs().values()
            for _, message in records]
    ours = [m for m in logs if "Compute Failed" in m and "dasktrain-trainer-" in m]
    assert ours == []


# -- on_exception --------------------------------------------------------------------------
class Recorder(dt.Callback):
    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.updates_seen: list[int] = []
        self.ended = False

    def on_exception(self, trainer: dt.Trainer, error: BaseException) -> None:
        self.errors.append(error)
        self.updates_seen.append(trainer.history.updates)

    def on_fit_end(self, trainer: dt.Trainer, history: dt.History) -> None:
        self.ended = True


class Failing(dt.Callback):
    def on_exception(self, trainer: dt.Trainer, error: BaseException) -> None:
        raise RuntimeError("the failure hook itself broke")


def test_on_exception_is_called_once_and_cannot_mask_the_fits_error(client, regression,
                                                                    caplog):
    first, last = Recorder(), Recorder()
    trainer = _trainer(optimizer=dt.optim.sgd(1e6))
    with caplog.at_level(logging.ERROR, logger="dasktrain.trainer.view.callbacks"), \
            pytest.raises(dt.TrainingDiverged, match="training diverged at update") as caught:
        trainer.fit(regression, epochs=3, client=client, callbacks=[first, Failing(), last])
    for recorder in (first, last):  # the broken hook between them stops neither
        assert recorder.errors == [caught.value]
        assert recorder.updates_seen == [caught.value.history.updates]
        assert recorder.updates_seen[0] >= 1 and not recorder.ended
    logged = [r for r in caplog.records if "Failing.on_exception failed" in r.getMessage()]
    assert len(logged) == 1 and "TrainingDiverged" in logged[0].getMessage()
    assert "the failure hook itself broke" in str(logged[0].exc_info[1])
    assert torch.isfinite(flat_parameters(trainer.model)).all()


# -- on_nonfinite="skip" and the epoch's loss ----------------------------------------------
def nan_at_row_7(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, NaN for the one batch holding row 7 (targets are row indices)."""
    loss = torch.nn.functional.mse_loss(output.squeeze(1), target.float())
    return loss * float("nan") if bool((target == 7).any()) else loss


def linear3() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def test_a_skipped_nonfinite_batch_is_counted_not_averaged(client, tmp_path):
    data = indexed_dataset(client, tmp_path, rows=200)
    trainer = dt.Trainer(linear3, nan_at_row_7, dt.optim.sgd(1e-6), workers=2, batch_size=10,
                         on_nonfinite="skip", progress=False)
    recorder = Recorder()
    history = trainer.fit(data, epochs=2, client=client, callbacks=[recorder])
    assert recorder.ended and recorder.errors == []  # skipped batches fail nothing
    assert [e["skipped_steps"] for e in history.epochs] == [1, 1]  # row 7, once per epoch
    assert history.refused_gradients == 2
    for epoch in history.epochs:
        assert torch.isfinite(torch.tensor(epoch["train"]["loss"])), epoch["train"]
        # The skipped batch was still read and computed, but the holder applied the rest.
        assert sum(w["samples"] for w in epoch["per_worker"]) == 200
        assert epoch["samples"] == 190


# -- storage_options for checkpoints -------------------------------------------------------
def test_fit_save_and_load_take_storage_options_for_object_storage(client, regression,
                                                                   s3):
    # No fsspec configuration in this process: the options given are the only way in.
    run, models = s3.url("options/run"), s3.url("options/models")
    first = _trainer(workers=1)
    first.fit(regression, epochs=1, client=client, checkpoint=run,
              storage_options=s3.options,
              callbacks=[dt.ModelCheckpoint(models, keep_last=1, monitor="loss",
                                            storage_options=s3.options)])
    assert s3.names("options/run") == ["checkpoint-updates.jsonl", "checkpoint.pt"]
    assert s3.names("options/models") == ["best.pt", "epoch-0000.pt"]

    resumed = _trainer(workers=1)
    history = resumed.fit(regression, epochs=2, client=client, checkpoint=run, resume=run,
                          storage_options=s3.options)
    assert history.loss[: first.history.updates] == first.history.loss
    loaded = dt.Trainer.load(run, model=mlp, loss=mse, storage_options=s3.options)
    assert loaded.history.loss == history.loss

    saved = resumed.save(s3.url("options/final.pt"), storage_options=s3.options)
    final = dt.Trainer.load(saved, model=mlp, loss=mse, storage_options=s3.options)
    torch.testing.assert_close(flat_parameters(final.model), flat_parameters(resumed.model))
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        resumed.save(s3.url("options/other.pt"), storage_options="anon=true")


def test_a_model_the_workers_cannot_import_fails_at_once_naming_the_module(
        client, regression, tmp_path, monkeypatch):
    """A model class from a module only the driver can import: the holder's worker would
    die reading its task and the fit wait out its timeout; it stops before any task."""
    (tmp_path / "driver_only_models.py").write_text(textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)

            def forward(self, x):
                return self.lin(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # this process only: the workers run already
    from driver_only_models import Net

    trainer = dt.Trainer(Net, mse, dt.optim.sgd(0.01), mode="async", workers=2,
                         batch_size=16, progress=False, timeout=120)
    with pytest.raises(dt.TrainerError) as caught:
        trainer.fit(regression, epochs=1, client=client)
    message = str(caught.value)
    assert message.startswith("the workers cannot load the model, its optimizer and mode")
    assert "ModuleNotFoundError: No module named 'driver_only_models'" in message
    assert "client.upload_file" in message
    assert any(v == 0 for v in client.run(lambda: 0).values())  # the workers live on
