"""The optimizer registry: any element-wise torch.optim class runs on the holder and equals
one process; classes that cannot run on a flat buffer are refused with the reason; an
optimizer added in one file with one registry entry trains on a real cluster."""

from __future__ import annotations

import pickle

import pytest
import torch

import dasktrain as dt
from dasktrain.cli._toml_writer import dumps
from dasktrain.cli.train_config import ConfigError, load_train_config
from tests.common.training import assert_sync_equals_one_process


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("registry") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=320, width=4, chunk_rows=80,
                      seed=3, progress=False)


# -- an optimizer of our own: one class, one builder, one registry entry --------------------
class SignSGD(torch.optim.Optimizer):
    """w -= lr * sign(g): element-wise, with no state."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad + group["weight_decay"] * p), alpha=-group["lr"])


def build_signsgd(config, params, segments):
    return SignSGD(params, lr=config.lr, weight_decay=config.weight_decay)


dt.optim.register_optimizer("signsgd", build_signsgd)


def test_an_optimizer_registered_in_one_file_trains_on_the_cluster(client, regression):
    assert_sync_equals_one_process(client, regression,
                                   dt.optim.get_optimizer("signsgd", lr=0.01))


def test_a_registered_optimizer_travels_with_its_config():
    """The holder's process never imported this module: the config carries the entry."""
    dt.optim.register_optimizer("signsgd", build_signsgd)  # this module's, whatever ran before
    config = dt.optim.get_optimizer("signsgd", lr=0.01)
    sent = pickle.dumps(config, protocol=5)
    del dt.optim.OPTIMIZERS["signsgd"]  # as in a process that never registered it
    try:
        restored = pickle.loads(sent)
        assert restored == config
        assert dt.optim.OPTIMIZERS["signsgd"].build is build_signsgd
    finally:
        dt.optim.OPTIMIZERS["signsgd"] = dt.optim.OptimizerKind(build_signsgd)
    # Built-in names travel as names.
    assert b"build_sgd" not in pickle.dumps(dt.optim.sgd(0.1))


@pytest.mark.parametrize("cls, options", [
    (torch.optim.RMSprop, {"alpha": 0.9, "momentum": 0.5}),
    (torch.optim.Adagrad, {"lr_decay": 0.01}),
    (torch.optim.NAdam, {}),
], ids=["rmsprop", "adagrad", "nadam"])
def test_any_element_wise_torch_optimizer_on_the_holder_equals_one_process(
        client, regression, cls, options):
    assert_sync_equals_one_process(
        client, regression, dt.optim.torch_optimizer(cls, lr=0.01, weight_decay=1e-3,
                                                     **options))


class NormalisedSGD(torch.optim.Optimizer):
    """w -= lr * g / |g| per tensor: not element-wise (the norm spans the tensor)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


@pytest.mark.parametrize("cls, reason", [
    (torch.optim.LBFGS, "closure"),
    (torch.optim.SparseAdam, "sparse gradients"),
    (torch.optim.Adafactor, "not element-wise"),
    (NormalisedSGD, "not element-wise"),
])
def test_optimizers_that_cannot_run_on_a_flat_buffer_are_refused(cls, reason):
    with pytest.raises(ValueError, match=f"cannot run on the holder: .*{reason}"):
        dt.optim.torch_optimizer(cls, lr=0.01)


def test_torch_optimizer_settings_are_checked():
    with pytest.raises(ValueError, match="takes no weight_decay"):
        dt.optim.torch_optimizer(torch.optim.Rprop, lr=0.01, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"not a torch\.optim\.Optimizer class"):
        dt.optim.torch_optimizer("collections.OrderedDict", lr=0.01)
    with pytest.raises(ValueError, match=r"pass \['momentum'\] as the class's own"):
        dt.optim.OptimizerConfig(name="torch", torch_class="torch.optim.RMSprop", lr=0.1,
                                 momentum=0.9)
    with pytest.raises(ValueError, match="needs torch_class"):
        dt.optim.get_optimizer("torch", lr=0.1)
    with pytest.raises(TypeError, match="'sgd' has no setting"):
        dt.optim.get_optimizer("sgd", lr=0.1, alpha=0.9)
    with pytest.raises(ValueError, match="takes no options"):
        dt.optim.OptimizerConfig(name="lamb", lr=0.1, options={"foo": 1})
    with pytest.raises(ValueError, match="built-in optimizer"):
        dt.optim.register_optimizer("adam", build_signsgd)
    # The config round-trips through its plain form (checkpoints, reports).
    config = dt.optim.torch_optimizer(torch.optim.RMSprop, lr=0.01, alpha=0.8,
                                      warmup_steps=3)
    assert dt.optim.OptimizerConfig.from_dict(config.to_dict()) == config
    assert config.warmup_steps == 3 and config.options == {"alpha": 0.8}


def test_a_run_config_names_a_torch_optimizer(regression, tmp_path):
    (tmp_path / "models.py").write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Linear(4, 1)\n")
    config = {
        "data": {"path": regression.url},
        "model": {"factory": "models.py:mlp"},
        "loss": {"name": "mse_loss"},
        "optimizer": {"name": "torch", "torch_class": "torch.optim.RMSprop", "lr": 0.01,
                      "options": {"alpha": 0.9}},
        "trainer": {"epochs": 1, "workers": 1, "batch_size": 32},
    }
    path = tmp_path / "train.toml"
    path.write_text(dumps(config))
    loaded = load_train_config(path, progress=False)
    assert loaded.trainer.optimizer == dt.optim.torch_optimizer(torch.optim.RMSprop, lr=0.01,
                                                                alpha=0.9)
    config["optimizer"] = {"name": "torch", "torch_class": "torch.optim.LBFGS", "lr": 0.01}
    path.write_text(dumps(config))
    with pytest.raises(ConfigError, match=r"\[optimizer\].*closure"):
        load_train_config(path, progress=False)
