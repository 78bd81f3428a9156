"""What people who train models expect: custom steps and dict batches, metrics, gradient
clipping, mixed precision, callbacks with early stopping and plateau schedules, and
prediction and evaluation spread over the cluster. On a real cluster, against plain torch
in one process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.driver.checkpoint import load_checkpoint
from tests.common.training import flat_parameters, mlp, mse


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("habits") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=600, width=4, chunk_rows=100,
                      seed=3, progress=False)


class TwoInputs(torch.nn.Module):
    """A model of two inputs (the first two and the last two features)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.left = torch.nn.Linear(2, 6)
        self.right = torch.nn.Linear(2, 6)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.left(a) + self.right(b)))


def two_input_step(model, batch):
    x = batch["x"]
    output = model(x[:, :2], x[:, 2:])
    loss = mse(output, batch["y"])
    # An auxiliary term and a metric, as a Lightning training_step would return them.
    aux = 1e-3 * sum(p.pow(2).sum() for p in model.head.parameters())
    return {"loss": loss + aux, "aux": aux}


def mae(output, target):
    return (output - target.reshape(output.shape)).abs().mean()


def _one_process(dataset, model, optimizer, batch_size, epochs, client, loss_of,
                 clip=None):
    """Plain torch on the same global batch order."""
    pipe = dt.Pipeline(dataset, batch_size, seed=0, client=client)
    for _ in range(epochs):
        for x, y in pipe:
            optimizer.zero_grad()
            loss_of(model, x, y).backward()
            if clip is not None:
                clip(model.parameters())
            optimizer.step()
    pipe.close()
    return flat_parameters(model)


def test_custom_step_with_two_inputs_and_dict_batches_equals_one_process(client, regression):
    config = dt.optim.sgd(0.05, momentum=0.9)
    trainer = dt.Trainer(TwoInputs, None, config, "sync", workers=2, batch_size=16,
                         step=two_input_step, as_dict=True, progress=False)
    history = trainer.fit(regression, epochs=2, client=client)
    reference = TwoInputs()
    expected = _one_process(
        regression, reference, torch.optim.SGD(reference.parameters(), 0.05, momentum=0.9),
        32, 2, client,
        lambda m, x, y: two_input_step(m, {"x": x, "y": y})["loss"])
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    train = history.epochs[-1]["train"]
    assert set(train) == {"loss", "aux"} and train["aux"] > 0
    # The same step scores validation, and predict takes a forward for several inputs.
    metrics = trainer.evaluate(regression, client=client)
    assert set(metrics) == {"loss", "aux"}
    out = trainer.predict(regression, forward=lambda m, b: m(b["x"][:, :2], b["x"][:, 2:]))
    x = torch.from_numpy(regression.x.compute())
    with torch.no_grad():
        direct = trainer.model(x[:, :2], x[:, 2:]).numpy()
    np.testing.assert_allclose(out.compute(), direct, rtol=1e-6, atol=1e-6)


def test_metrics_on_training_batches_and_validation(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "async", workers=2, batch_size=16,
                         metrics={"mae": mae}, progress=False)
    history = trainer.fit(regression, epochs=2, validation=regression, client=client)
    for record in history.epochs:
        assert set(record["train"]) == {"loss", "mae"}
        assert set(record["validation"]) == {"loss", "mae"}
    # Validation (tasks on the workers) equals the model applied in this process.
    x = torch.from_numpy(regression.x.compute())
    y = torch.from_numpy(regression.y.compute())
    with torch.no_grad():
        output = trainer.model(x)
    expected = {"loss": float(mse(output, y)), "mae": float(mae(output, y))}
    got = history.epochs[-1]["validation"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_the_progress_bar_shows_training_and_validation_metrics(client, regression, capfd):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=2, batch_size=32,
                         metrics={"mae": mae}, progress=True)
    history = trainer.fit(regression, epochs=1, validation=regression, client=client)
    shown = capfd.readouterr().err
    last = history.epochs[-1]
    assert f"mae={last['train']['mae']:.4g}" in shown
    assert f"val_mae={last['validation']['mae']:.4g}" in shown


@pytest.mark.parametrize("clip", [{"clip_grad_norm": 0.05}, {"clip_grad_value": 0.01},
                                  {"clip_grad_norm": 0.05, "clip_grad_value": 0.01}])
def test_clipping_in_sync_equals_torch_on_the_union_batch(client, regression, clip):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05, momentum=0.9), "sync", workers=2,
                         batch_size=16, progress=False, **clip)
    trainer.fit(regression, epochs=2, client=client)

    def torch_clip(params):
        params = list(params)
        if "clip_grad_value" in clip:
            torch.nn.utils.clip_grad_value_(params, clip["clip_grad_value"])
        if "clip_grad_norm" in clip:
            torch.nn.utils.clip_grad_norm_(params, clip["clip_grad_norm"])

    reference = mlp()
    expected = _one_process(
        regression, reference, torch.optim.SGD(reference.parameters(), 0.05, momentum=0.9),
        32, 2, client, lambda m, x, y: mse(m(x), y), clip=torch_clip)
    plain = mlp()
    unclipped = _one_process(
        regression, plain, torch.optim.SGD(plain.parameters(), 0.05, momentum=0.9),
        32, 2, client, lambda m, x, y: mse(m(x), y))
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(expected, unclipped, atol=1e-4)  # the clip did bite


def test_clipping_applies_to_local_steps_in_average_mode(client, regression):
    start = flat_parameters(mlp())
    moved = {}
    for norm in (None, 1e-4):
        trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "average", workers=2,
                             batch_size=16, average_every=4, clip_grad_norm=norm,
                             progress=False)
        trainer.fit(regression, epochs=1, client=client)
        moved[norm] = float((flat_parameters(trainer.model) - start).norm())
    # Each clipped local step moves a replica by at most lr x norm, and no worker takes
    # more than the epoch's 38 batches; an average of replicas stays within that ball. The
    # per-batch losses are too noisy to tell this apart.
    bound = 0.05 * 1e-4 * math.ceil(600 / 16)
    assert moved[1e-4] <= bound * (1 + 1e-3), moved
    assert moved[None] > 100 * bound, moved


def test_bf16_autocast_trains_to_the_fp32_loss(client, regression):
    finals = {}
    for precision in ("32", "bf16"):
        trainer = dt.Trainer(mlp, mse, dt.optim.adam(0.02), "sync", workers=2, batch_size=16,
                             precision=precision, progress=False)
        history = trainer.fit(regression, epochs=4, validation=regression, client=client)
        finals[precision] = history.epochs[-1]["validation"]["loss"]
    first = dt.Trainer(mlp, mse, dt.optim.adam(0.02)).evaluate(regression, client=client)
    # Both learned most of what there is to learn, and bf16 ends within 10 % of fp32.
    assert finals["32"] < 0.5 * first["loss"]
    assert finals["bf16"] == pytest.approx(finals["32"], rel=0.10)


def test_fp16_scales_the_loss_and_trains(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.adam(0.02), "sync", workers=2, batch_size=16,
                         precision="fp16", progress=False)
    history = trainer.fit(regression, epochs=3, client=client)
    assert history.loss[-1] < history.loss[0]


def test_fp16_keeps_its_loss_scale_from_epoch_to_epoch(client, regression):
    # 1,000 x MSE overflows float16 at the first scale (2^16): each worker skips steps,
    # halving its scale, until its gradients fit, once. A scale made again each epoch
    # skipped nearly every step of every epoch (19 of 20).
    def loud(output, target):
        return 1000.0 * mse(output, target)

    trainer = dt.Trainer(mlp, loud, dt.optim.adam(0.02), "sync", workers=2, batch_size=16,
                         precision="fp16", progress=False)
    history = trainer.fit(regression, epochs=4, client=client)
    overflows = [e["overflow_steps"] for e in history.epochs]
    assert overflows[0] >= 2 and overflows[-1] == 0, overflows
    assert history.loss[-1] < 0.5 * history.loss[0]


def test_early_stopping_stops_at_the_right_epoch_with_a_resumable_checkpoint(
        client, regression, tmp_path):
    # min_delta so large that only the first epoch counts as an improvement: with
    # patience 2 the run stops after epoch 2.
    stopper = dt.EarlyStopping("val_loss", patience=2, min_delta=1e9)
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=2, batch_size=16,
                         progress=False)
    history = trainer.fit(regression, epochs=10, validation=regression, client=client,
                          checkpoint=tmp_path / "run", callbacks=[stopper])
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]
    assert stopper.stopped_epoch == 2 and stopper.best_epoch == 0
    assert any("early stopping after epoch 2" in e for e in history.events)
    state = load_checkpoint(tmp_path / "run")
    assert state["complete_epochs"] == 3
    assert state["callbacks"][0]["state"]["wait"] == 2
    # The checkpoint resumes: two more epochs equal an uninterrupted five-epoch run.
    resumed = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=2, batch_size=16,
                         progress=False)
    resumed.fit(regression, epochs=5, client=client, resume=tmp_path / "run")
    straight = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=2, batch_size=16,
                          progress=False)
    straight.fit(regression, epochs=5, client=client)
    torch.testing.assert_close(flat_parameters(resumed.model),
                               flat_parameters(straight.model), rtol=1e-5, atol=1e-6)


def test_reduce_lr_on_plateau_scales_the_holders_rate(client, regression, tmp_path):
    seen = []

    class Counting(dt.Callback):
        def on_update(self, trainer, records):
            seen.extend(records["version"])

    plateau = dt.ReduceLROnPlateau("loss", factor=0.5, patience=0, min_delta=1e9)
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=2, batch_size=16,
                         progress=False)
    history = trainer.fit(regression, epochs=3, client=client, checkpoint=tmp_path / "run",
                          callbacks=[plateau, Counting()])
    # Epoch 0 sets the best; epochs 1 and 2 do not improve: two halvings.
    assert plateau.lr_factor == 0.25
    assert load_checkpoint(tmp_path / "run")["holder"]["lr_factor"] == 0.25
    assert sorted(seen) == history.version  # every update reached on_update once
    # The factor really scales the steps: the same run on plain torch, halving the rate
    # after epoch 1 (the halving after epoch 2 has no epoch left to act on), lands on the
    # same parameters.
    reference = mlp()
    optimizer = torch.optim.SGD(reference.parameters(), 0.05)
    pipe = dt.Pipeline(regression, 32, seed=0, client=client)
    for epoch in range(3):
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * (1.0, 1.0, 0.5)[epoch]
        for x, y in pipe:
            optimizer.zero_grad()
            mse(reference(x), y).backward()
            optimizer.step()
    pipe.close()
    torch.testing.assert_close(flat_parameters(trainer.model), flat_parameters(reference),
                               rtol=1e-5, atol=1e-6)


def test_predict_equals_the_model_in_one_process(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "async", workers=2, batch_size=16,
                         progress=False)
    trainer.fit(regression, epochs=1, client=client)
    predictions = trainer.predict(regression, batch_size=64)
    assert predictions.shape == (600, 1) and predictions.numblocks[0] == 6
    with torch.no_grad():
        direct = trainer.model(torch.from_numpy(regression.x.compute())).numpy()
    np.testing.assert_allclose(predictions.compute(), direct, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp8"}, "precision must be one of"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm must be a positive number"),
    ({"metrics": {"loss": mae}}, "'loss' is measured already"),
    ({"metrics": {"mae": 3}}, "metrics must be a dict of name -> fn"),
    ({"step": "not a function"}, "step must be a function"),
])
def test_bad_habit_settings_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        dt.Trainer(mlp, mse, dt.optim.sgd(0.1), **kwargs)


def test_monitoring_validation_without_validation_data_says_so(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=2, batch_size=16,
                         progress=False)
    with pytest.raises(ValueError, match="the fit has no validation data"):
        trainer.fit(regression, epochs=2, client=client, callbacks=[dt.EarlyStopping()])


def test_model_checkpoint_keeps_the_last_epochs_and_the_best(client, regression, tmp_path):
    keeper = dt.ModelCheckpoint(tmp_path / "models", keep_last=2, monitor="val_loss")
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.3, momentum=0.9), "sync", workers=2,
                         batch_size=16, progress=False)
    history = trainer.fit(regression, epochs=4, validation=regression, client=client,
                          callbacks=[keeper])
    files = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert files == ["best.pt", "epoch-0002.pt", "epoch-0003.pt"]
    losses = [e["validation"]["loss"] for e in history.epochs]
    assert keeper.best_epoch == int(np.argmin(losses))
    best = dt.Trainer.load(tmp_path / "models" / "best.pt", model=mlp, loss=mse)
    assert best.evaluate(regression, client=client)["loss"] == pytest.approx(min(losses),
                                                                             rel=1e-6)
    last = dt.Trainer.load(tmp_path / "models" / "epoch-0003.pt", model=mlp, loss=mse)
    assert torch.equal(flat_parameters(last.model), flat_parameters(trainer.model))
