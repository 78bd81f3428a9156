"""Metric loggers during a real fit: a JSON-lines file, TensorBoard event files read back
with TensorBoard's own reader, and MLflow runs in a local SQLite tracking store."""

from __future__ import annotations

import json
import sys

import pytest

import dasktrain as dt
from tests.common.training import mlp, mse


def mae(output, target):
    return (output - target.reshape(output.shape)).abs().mean()


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("loggers") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=600, width=4, chunk_rows=100,
                      seed=5, split="train=0.8,val=0.2", progress=False)


@pytest.fixture(scope="module")
def logged(client, regression, tmp_path_factory):
    """One fit with every logger attached."""
    root = tmp_path_factory.mktemp("logged")
    loggers = {
        "jsonl": dt.JsonLinesLogger(root / "run" / "metrics.jsonl"),
        "jsonl_every_5": dt.JsonLinesLogger(root / "every5.jsonl", every=5),
        "tensorboard": dt.TensorBoardLogger(root / "tb"),
        "mlflow": dt.MLflowLogger(experiment="dasktrain-test", run_name="sync-2",
                                  tracking_uri=f"sqlite:///{root / 'mlflow.db'}"),
    }
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05, momentum=0.9), "async", workers=2,
                         batch_size=16, metrics={"mae": mae}, progress=False)
    history = trainer.fit(regression.split("train"), epochs=2,
                          validation=regression.split("val"), client=client,
                          callbacks=list(loggers.values()))
    return history, loggers, root


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_json_lines_hold_every_update_and_epoch(logged):
    history, _, root = logged
    lines = _lines(root / "run" / "metrics.jsonl")
    updates = [row for row in lines if row["kind"] == "update"]
    epochs = [row for row in lines if row["kind"] == "epoch"]
    assert [row["version"] for row in updates] == history.version
    assert [row["loss"] for row in updates] == history.loss
    assert [row["contributors"] for row in updates] == history.contributors
    # Each update line carries its own gradients' entries.
    assert [s for row in updates for s in row["staleness"]] == history.staleness
    assert all(len(row["staleness"]) == row["gradients"] for row in updates)
    assert [{k: v for k, v in row.items() if k != "kind"} for row in epochs] == \
        json.loads(json.dumps(history.epochs))
    assert epochs[-1]["validation"] == history.epochs[-1]["validation"]

    every5 = [row for row in _lines(root / "every5.jsonl") if row["kind"] == "update"]
    assert [row["version"] for row in every5] == [v for v in history.version if v % 5 == 0]


def test_tensorboard_event_files_hold_the_run(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history, loggers, root = logged
    assert loggers["tensorboard"].writer is None  # closed when the fit ended
    events = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == history.version
    assert [e.value for e in loss] == pytest.approx(history.loss, rel=1e-6)
    val = events.Scalars("epoch/val_loss")
    assert [e.step for e in val] == [0, 1]
    assert [e.value for e in val] == pytest.approx(
        [r["validation"]["loss"] for r in history.epochs], rel=1e-6)
    stall = events.Scalars("workers/stall/1")
    assert [e.value for e in stall] == pytest.approx(
        [r["per_worker"][1]["stall"] for r in history.epochs], rel=1e-6)
    assert {"epoch/samples_per_s", "epoch/train_mae", "workers/samples_per_s/0"} <= \
        set(events.Tags()["scalars"])
    assert "epoch/staleness" in events.Tags()["histograms"]


def test_mlflow_run_holds_params_and_metrics(logged):
    from mlflow.tracking import MlflowClient

    history, loggers, root = logged
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(loggers["mlflow"].run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "sync-2"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "dasktrain-test"
    assert run.data.params["mode"] == "async" and run.data.params["workers"] == "2"
    assert run.data.params["optimizer.lr"] == "0.05"
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in loss) == history.version
    val = sorted(client.get_metric_history(run.info.run_id, "epoch_val_loss"),
                 key=lambda m: m.step)
    assert [m.value for m in val] == pytest.approx(
        [r["validation"]["loss"] for r in history.epochs])


def test_missing_packages_are_named_with_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "dasktrain\[mlflow\]"'):
        dt.MLflowLogger()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r'pip install "dasktrain\[tensorboard\]"'):
        dt.TensorBoardLogger("unused")


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="every must be a positive integer"):
        dt.JsonLinesLogger(tmp_path / "m.jsonl", every=0)
    with pytest.raises(IsADirectoryError, match="needs a file path"):
        dt.JsonLinesLogger(tmp_path)
