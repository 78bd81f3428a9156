"""A saved trainer loads with every setting it had; its loss is never guessed; predict runs
on the cluster it is given."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.driver.checkpoint import save_checkpoint
from tests.common.training import flat_parameters, mlp, mse

FUNCTIONS = {"model", "loss", "step", "metrics", "transform"}  # never read from a file


def _settings(trainer: dt.Trainer) -> dict:
    """Every setting of ``trainer`` that is plain data, by its ``Trainer`` keyword, read
    from its public attributes."""
    options = trainer.pipeline_options
    return {
        "mode": trainer.mode, "mode_options": trainer.mode_options,
        "optimizer": trainer.optimizer, "workers": trainer.workers,
        "batch_size": trainer.batch_size,
        **{k: options[k] for k in ("seed", "shuffle", "prefetch", "shuffle_blocks",
                                   "block_rows", "drop_last", "as_dict")},
        "device": trainer.device, "holder_worker": trainer.holder_worker,
        "holder_shards": trainer.holder_shards, "timeout": trainer.timeout,
        "barrier_timeout": trainer.barrier_timeout,
        "direct_channel": trainer.direct_channel, "shared_memory": trainer.shared_memory,
        "balance": trainer.balance, "bucket_bytes": trainer.bucket_bytes,
        "on_nonfinite": trainer.on_nonfinite,
        "nonfinite_patience": trainer.nonfinite_patience,
        "checkpoint_every": trainer.checkpoint_every,
        "history_updates": trainer.history_updates, "progress": trainer.show_progress,
        "torch_threads": trainer.torch_threads, "precision": trainer.compute.precision,
        "clip_grad_norm": trainer.clip_grad_norm, "clip_grad_value": trainer.clip_grad_value,
        "assignment": trainer.assignment, "pause_dask_profiler": trainer.pause_dask_profiler,
    }


def _defaults() -> dict:
    parameters = inspect.signature(dt.Trainer.__init__).parameters.values()
    return {p.name: p.default for p in parameters
            if p.name != "self" and p.kind is not p.VAR_KEYWORD}


# Between them, every setting away from its default: shards need sync and no norm clipping.
UNUSUAL = [
    dict(mode="ssp", workers=3, batch_size=8, seed=7, shuffle=False, prefetch=2,
         shuffle_blocks=2, block_rows=40, drop_last=True, device="cpu",
         holder_worker="tcp://127.0.0.1:1234", timeout=60.0, barrier_timeout=30.0,
         direct_channel=False, shared_memory=False, bucket_bytes=4096, on_nonfinite="skip",
         nonfinite_patience=3, checkpoint_every=5, history_updates=100, progress=False,
         torch_threads=2,
         precision="bf16", as_dict=True, clip_grad_norm=1.0, clip_grad_value=0.5,
         mode_options={"staleness_bound": 1, "staleness_lr": "inverse"},
         assignment="static", pause_dask_profiler=False),
    dict(mode="sync", holder_shards=2, progress=False, balance=False),
]


def test_load_restores_every_setting_of_a_saved_trainer(tmp_path):
    defaults = _defaults()
    assert set(_settings(dt.Trainer(mlp, mse, dt.optim.sgd(0.1)))) == \
        set(defaults) - FUNCTIONS, "a Trainer setting this test does not compare"
    unusual = set()
    for i, kwargs in enumerate(UNUSUAL):
        optimizer = dt.optim.adam(0.01, weight_decay=0.1, warmup_steps=3, schedule="cosine")
        trainer = dt.Trainer(mlp, mse, optimizer, **kwargs)
        loaded = dt.Trainer.load(trainer.save(tmp_path / f"{i}.pt"), model=mlp, loss=mse)
        assert _settings(loaded) == _settings(trainer)
        # The Trainer holds mode_options=None as {}.
        normal = {**defaults, "mode_options": {}}
        unusual |= {k for k, v in _settings(trainer).items() if k in normal and v != normal[k]}
    assert unusual == set(defaults) - FUNCTIONS  # the optimizer has no default


def test_a_fit_checkpoint_restores_the_settings_too(client, regression, tmp_path):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05, momentum=0.9), "async", workers=2,
                         batch_size=16, shuffle=False, prefetch=2, timeout=60.0,
                         clip_grad_value=0.5, progress=False, staleness_lr="sqrt")
    trainer.fit(regression, epochs=1, client=client, checkpoint=tmp_path / "run")
    loaded = dt.Trainer.load(tmp_path / "run", model=mlp, loss=mse)
    assert _settings(loaded) == _settings(trainer)
    assert torch.equal(flat_parameters(loaded.model), flat_parameters(trainer.model))


def test_a_file_of_the_previous_version_loads_with_the_old_defaults(tmp_path):
    # The settings that version wrote, no more: the others take the Trainer's defaults.
    old = {"mode": "async", "workers": 3, "batch_size": 8, "seed": 4, "shuffle": False,
           "shuffle_blocks": 2, "block_rows": None, "drop_last": True, "transform": None,
           "as_dict": True, "step": None, "precision": "bf16", "clip_grad_norm": 2.0,
           "clip_grad_value": None, "optimizer": dt.optim.sgd(0.1).to_dict(),
           "mode_options": {"staleness_lr": "inverse"}}
    model = mlp()
    save_checkpoint(tmp_path / "old.pt", {"model": model.state_dict(), "trainer": old,
                                          "history": None})
    loaded = dt.Trainer.load(tmp_path / "old.pt", model=mlp, loss=mse)
    expected = {**{k: v for k, v in _defaults().items() if k not in FUNCTIONS},
                **{k: v for k, v in old.items() if k not in FUNCTIONS}}
    expected["optimizer"] = dt.optim.sgd(0.1)
    assert _settings(loaded) == expected
    with pytest.raises(ValueError, match="saved with a loss the file does not name"):
        dt.Trainer.load(tmp_path / "old.pt", model=mlp).evaluate(tmp_path / "nothing")


def test_load_takes_the_loss_or_restores_a_torch_one_and_never_guesses(client, regression,
                                                                        tmp_path):
    own = dt.Trainer(mlp, mse, dt.optim.sgd(0.1), batch_size=16, progress=False)
    loaded = dt.Trainer.load(own.save(tmp_path / "own.pt"), model=mlp)
    # Predicting needs no loss; evaluating refuses before any work, naming the fix.
    outputs = loaded.predict(regression, client=client).compute()
    assert outputs.shape == (len(regression), 1)
    with pytest.raises(ValueError, match=r"loss=function:tests\.common\.training\.mse\): "
                                         r"pass loss= to Trainer\.load"):
        loaded.evaluate(regression, client=client)
    with pytest.raises(ValueError, match=r"pass loss= to Trainer\.load"):
        loaded.fit(regression, epochs=1, client=client)
    given = dt.Trainer.load(tmp_path / "own.pt", model=mlp, loss=mse)
    assert given.evaluate(regression, client=client) == \
        own.evaluate(regression, client=client)

    named = dt.Trainer(mlp, torch.nn.functional.l1_loss, dt.optim.sgd(0.1), progress=False)
    restored = dt.Trainer.load(named.save(tmp_path / "named.pt"), model=mlp)
    assert restored.loss is torch.nn.functional.l1_loss

    # A step computed the loss: the stored loss alone would compute another one.
    stepped = dt.Trainer(mlp, torch.nn.functional.l1_loss, dt.optim.sgd(0.1),
                         step=_step, progress=False)
    path = stepped.save(tmp_path / "stepped.pt")
    with pytest.raises(ValueError, match=r"step=function:.*_step\): pass step="):
        dt.Trainer.load(path, model=mlp).evaluate(regression, client=client)
    assert dt.Trainer.load(path, model=mlp, step=_step).compute.step is _step


def _step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return mse(model(x), y)


def test_predict_runs_on_the_client_it_is_given(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.1), progress=False)
    predictions = trainer.predict(regression, batch_size=32, client=client)
    assert predictions.numblocks[0] == regression.x.numblocks[0]
    computed = client.compute(predictions).result(timeout=60)
    with torch.no_grad():
        direct = trainer.model(torch.from_numpy(np.asarray(regression.x))).numpy()
    np.testing.assert_allclose(computed, direct, rtol=1e-6, atol=1e-6)
