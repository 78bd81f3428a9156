"""Parameter groups: per-group learning rate and weight decay, and biases and norm weights
out of weight decay, on the holder's flat buffer. Against ``torch.optim`` given the same
groups by hand, in one process and through a real cluster."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.optim.flat import FlatOptimizer, plan_runs
from tests.common.training import flat_parameters, mse


def normed(seed: int = 0) -> torch.nn.Module:
    """Linear, LayerNorm, Linear: weights, biases and a norm layer's weight interleave."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1))


def by_hand(model: torch.nn.Module, kind, lr: float, decay: float, head_lr: float,
            **options) -> torch.optim.Optimizer:
    """The groups a torch script writes: decayed weights, a no-decay list (biases and the
    norm weight), and the head ("3.") at its own rate."""
    body = dict(model.named_parameters())
    head = [body.pop("3.weight"), body.pop("3.bias")]
    decayed = [p for n, p in body.items() if p.ndim > 1]
    no_decay = [p for n, p in body.items() if p.ndim <= 1]
    return kind([{"params": decayed},
                 {"params": no_decay, "weight_decay": 0.0},
                 {"params": head[:1], "lr": head_lr},
                 {"params": head[1:], "lr": head_lr, "weight_decay": 0.0}],
                lr=lr, weight_decay=decay, **options)


CONFIGS = {
    "sgd": (dt.optim.sgd(0.05, momentum=0.9, weight_decay=0.1, exclude_bias_and_norm=True,
                         groups=[dt.optim.group("3.*", lr=0.2)]),
            lambda m: by_hand(m, torch.optim.SGD, 0.05, 0.1, 0.2, momentum=0.9)),
    "adamw": (dt.optim.adamw(0.01, weight_decay=0.5, exclude_bias_and_norm=True,
                             groups=[dt.optim.group("3.weight", "3.bias", lr=0.03)]),
              lambda m: by_hand(m, torch.optim.AdamW, 0.01, 0.5, 0.03)),
    "adam": (dt.optim.adam(0.01, weight_decay=0.5, exclude_bias_and_norm=True,
                           groups=[dt.optim.group("3.*", lr=0.03)]),
             lambda m: by_hand(m, torch.optim.Adam, 0.01, 0.5, 0.03)),
}


def test_runs_cut_the_flat_buffer_where_settings_change():
    config, _ = CONFIGS["sgd"]
    runs = plan_runs(config, FlatLayout.of(normed()).param_segments())
    # 0.weight | 0.bias 1.weight 1.bias | 3.weight | 3.bias
    assert [(r.lr, r.weight_decay, [s[0] for s in r.segments]) for r in runs] == [
        (0.05, 0.1, ["0.weight"]), (0.05, 0.0, ["0.bias", "1.weight", "1.bias"]),
        (0.2, 0.1, ["3.weight"]), (0.2, 0.0, ["3.bias"])]
    # Without groups the buffer stays one piece.
    assert len(plan_runs(dt.optim.sgd(0.1), FlatLayout.of(normed()).param_segments())) == 1


def _flat_steps(config, steps: int, seed: int, scale_after: int | None = None):
    """``steps`` random gradients through a FlatOptimizer; also returns the gradients."""
    model = normed()
    layout = FlatLayout.of(model)
    flat = flat_parameters(model).clone()
    optimizer = FlatOptimizer(config, flat, layout.param_segments())
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(layout.num_params, generator=generator) for _ in range(steps)]
    for i, grad in enumerate(grads):
        scale = 0.5 if scale_after is not None and i >= scale_after else 1.0
        optimizer.step(grad.clone(), lr=config.lr * scale)
    return flat, grads


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_flat_buffer_with_groups_equals_torch_optim_with_the_same_groups(name):
    config, reference_of = CONFIGS[name]
    # Half the rate from step 3 on: a schedule moves every group's rate alike.
    flat, grads = _flat_steps(config, 6, seed=1, scale_after=3)
    own = normed()
    reference = reference_of(own)
    for i, grad in enumerate(grads):
        for p, g in zip(own.parameters(), _split(grad, own), strict=True):
            p.grad = g
        for group in reference.param_groups:
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * (0.5 if i >= 3 else 1.0)
        reference.step()
    torch.testing.assert_close(flat, flat_parameters(own), rtol=1e-5, atol=1e-6)
    # The groups matter: without the no-decay switch the same steps end elsewhere.
    plain = dt.optim.OptimizerConfig.from_dict(
        {**config.to_dict(), "exclude_bias_and_norm": False})
    assert not torch.allclose(_flat_steps(plain, 6, seed=1, scale_after=3)[0], flat,
                              atol=1e-5)


def _split(flat: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    out, at = [], 0
    for p in model.parameters():
        out.append(flat[at:at + p.numel()].view_as(p).clone())
        at += p.numel()
    return out


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_large_batch_optimizers_keep_one_trust_ratio_per_tensor_across_groups(name):
    options = {"groups": [dt.optim.group("3.*", lr=0.3, weight_decay=0.0)]}
    config = (dt.optim.lars(0.1, weight_decay=0.01, **options) if name == "lars" else
              dt.optim.lamb(0.1, **options))
    flat_model, own = normed(), normed()
    layout = FlatLayout.of(flat_model)
    flat = flat_parameters(flat_model).clone()
    optimizer = FlatOptimizer(config, flat, layout.param_segments())
    assert len(optimizer.runs) == 2
    reference = config.build_for(own)
    generator = torch.Generator().manual_seed(2)
    for _ in range(4):
        grad = torch.randn(layout.num_params, generator=generator)
        optimizer.step(grad.clone(), lr=config.lr)
        for p, g in zip(own.parameters(), _split(grad, own), strict=True):
            p.grad = g
        reference.step()
    torch.testing.assert_close(flat, flat_parameters(own), rtol=1e-5, atol=1e-6)


def test_groups_survive_the_config_round_trip_and_bad_groups_are_refused():
    config, _ = CONFIGS["adamw"]
    assert dt.optim.OptimizerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"\['encodr\.\*'\] matches no parameter.*0\.weight"):
        dt.Trainer(normed, mse, dt.optim.sgd(0.1, groups=[dt.optim.group("encodr.*")]),
                   progress=False)
    with pytest.raises(ValueError, match="lr must be a positive number"):
        dt.optim.group("3.*", lr=-1.0)
    with pytest.raises(ValueError, match="name patterns"):
        dt.optim.group()
    with pytest.raises(TypeError, match=r"dt\.optim\.group"):
        dt.optim.sgd(0.1, groups=[{"patterns": ["3.*"]}])


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("groups") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=400, width=4, chunk_rows=100,
                      seed=5, progress=False)


def _one_process(dataset, model, optimizer, epochs, client):
    pipe = dt.Pipeline(dataset, 32, seed=0, client=client)
    for _ in range(epochs):
        for x, y in pipe:
            optimizer.zero_grad()
            mse(model(x), y).backward()
            optimizer.step()
    pipe.close()
    return flat_parameters(model)


@pytest.mark.parametrize("mode", ["sync", "average"])
def test_sync_and_averaged_local_steps_with_groups_equal_torch_optim(client, regression, mode):
    config, reference_of = CONFIGS["sgd"]
    options = ({"average_every": 1, "average_optimizer_state": True, "assignment": "static"}
               if mode == "average" else {})
    trainer = dt.Trainer(normed, mse, config, mode, workers=2, batch_size=16,
                         progress=False, **options)
    trainer.fit(regression, epochs=2, client=client)
    reference = normed()
    expected = _one_process(regression, reference, reference_of(reference), 2, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    # The same run without groups ends elsewhere: the groups changed the training.
    plain = normed()
    ungrouped = _one_process(regression, plain,
                             torch.optim.SGD(plain.parameters(), 0.05, momentum=0.9,
                                             weight_decay=0.1), 2, client)
    assert not np.allclose(expected.numpy(), ungrouped.numpy(), atol=1e-4)
