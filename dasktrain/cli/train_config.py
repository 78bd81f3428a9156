"""The config file of ``dasktrain train``: TOML sections mapped onto the objects of the API.

One source of defaults: the keys of ``[trainer]`` are the keyword arguments of
:class:`~dasktrain.Trainer` and the options of the chosen update mode, with their defaults
read from those signatures; ``[optimizer]`` is ``dt.optim.<name>(...)``; ``[model]`` and
``[loss]`` name functions. Values are checked by the real objects (the Trainer, the
optimizer config, the mode), and their errors come back naming the key, so the file cannot
drift from the API::

    [data]       path = "data/digits.zarr", split = "train", validation = "val"
    [model]      factory = "models.py:mlp", kwargs = {hidden = 64}
    [loss]       name = "cross_entropy"
    [optimizer]  name = "sgd", lr = 0.05, momentum = 0.9
    [trainer]    mode = "sync", workers = 2, batch_size = 32, epochs = 10
    [run]        dir = "runs/digits", checkpoint_every = 100

Relative paths (the dataset, files named in ``[model]``/``[loss]``, the run directory) start
at the config file's directory. :func:`dasktrain.cli.train_keys.config_reference` documents
every key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktrain.cli import _toml_writer
from dasktrain.cli._references import is_reference
from dasktrain.cli.config_reader import ConfigError, Reader
from dasktrain.cli.train_keys import (
    ELSEWHERE,
    SECTIONS,
    all_mode_options,
    config_keys,
    mentioned,
    mode_parameters,
    optimizer_fields,
    trainer_parameters,
)

if TYPE_CHECKING:
    from dasktrain.datasets import Dataset
    from dasktrain.trainer.driver.trainer import Trainer

__all__ = ["ConfigError", "TrainConfig", "load_train_config"]


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A config file, read and checked: the objects to train with, and every value."""

    path: Path
    """The config file."""
    train: Dataset
    """The data to train on (the dataset or its split)."""
    validation: Dataset | None
    """Evaluated after every epoch, or None."""
    trainer: Trainer
    """Built from ``[model]``, ``[loss]``, ``[optimizer]``, ``[trainer]`` and ``[run]``."""
    epochs: int
    """Total epochs of the run."""
    run_dir: Path
    """Where the run's files go (``[run] dir``, relative to the config file)."""
    resolved: dict[str, dict[str, Any]]
    """Every setting with defaults filled in and paths made absolute (None: not set)."""

    def to_toml(self) -> str:
        """The resolved config as TOML (readable by :func:`load_train_config` again)."""
        header = (f"The resolved config of this run, from {self.path}: every setting, "
                  "defaults filled in.\nSettings not set are comments.")
        return _toml_writer.dumps(self.resolved, header=header)


# -- sections --------------------------------------------------------------------------
def _data(r: Reader) -> tuple[Dataset, Dataset | None, dict[str, Any]]:
    from dasktrain.datasets import open_dataset

    table = r.table("data")
    r.check_keys("data", table, config_keys()["data"])
    path = r.path_value(r.require("data", table, "path"))
    split = r.typed("data", "split", table.get("split"), str | None)
    validation = r.typed("data", "validation", table.get("validation"), str | None)
    storage = r.typed("data", "storage_options", table.get("storage_options"), dict | None)
    try:
        dataset = open_dataset(path, storage_options=storage)
    except (ValueError, OSError) as exc:
        raise r.error("data", "path", str(exc)) from exc

    def split_of(key: str, name: str | None) -> Dataset | None:
        if name is None:
            return None
        try:
            return dataset.split(name)
        except KeyError as exc:
            raise r.error("data", key, exc.args[0]) from None

    train = split_of("split", split) or dataset
    resolved = {"path": path, "split": split, "validation": validation,
                "storage_options": storage}
    return train, split_of("validation", validation), resolved


def _model(r: Reader) -> tuple[Callable, dict[str, Any]]:
    table = r.table("model")
    r.check_keys("model", table, config_keys()["model"])
    fn, text = r.reference("model", "factory", r.require("model", table, "factory"))
    kwargs = r.typed("model", "kwargs", table.get("kwargs", {}), dict)
    return r.bound("model", fn, kwargs), {"factory": text, "kwargs": kwargs}


def _loss(r: Reader) -> tuple[Callable, dict[str, Any]]:
    import torch.nn.functional

    table = r.table("loss")
    r.check_keys("loss", table, config_keys()["loss"])
    name = r.require("loss", table, "name")
    if is_reference(name):
        fn, name = r.reference("loss", "name", name)
    else:
        fn = getattr(torch.nn.functional, name, None) if not name.startswith("_") else None
        if not callable(fn):
            losses = [n for n in dir(torch.nn.functional) if n.endswith(("loss", "entropy"))]
            close = difflib.get_close_matches(name, losses, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else \
                " (or name one as 'file.py:function' or 'module:function')"
            raise r.error("loss", "name", f"torch.nn.functional has no loss {name!r}{hint}")
    kwargs = r.typed("loss", "kwargs", table.get("kwargs", {}), dict)
    return r.bound("loss", fn, kwargs), {"name": name, "kwargs": kwargs}


_FACTORIES = ("sgd", "adam", "adamw", "lars", "lamb")


def _optimizer(r: Reader) -> Any:
    from dasktrain.trainer import optim

    table = r.table("optimizer")
    fields = optimizer_fields()
    r.check_keys("optimizer", table, list(fields))
    name = r.require("optimizer", table, "name")
    options = {k: r.typed("optimizer", k, v, fields[k]) for k, v in table.items()
               if k != "name"}
    try:
        optim.optimizer_kind(name)  # is the name known?
    except ValueError as exc:
        raise r.error("optimizer", "name", str(exc)) from None
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    if "groups" in options:
        options["groups"] = [_group(r, i, g) for i, g in enumerate(options["groups"])]
    # dt.optim.<name> where there is one: its own defaults (adamw's decay...).
    factory = getattr(optim, name, None) if name in _FACTORIES else None
    if factory is None:  # "torch" (with torch_class) and registered optimizers
        factory = functools.partial(optim.get_optimizer, name)
    try:
        inspect.signature(factory).bind(**options)
        return factory(**options)
    except (TypeError, ValueError) as exc:
        keys = mentioned(str(exc), list(table)) or mentioned(str(exc), list(fields))
        raise r.error("optimizer", ", ".join(keys) or None, str(exc)) from None


def _group(r: Reader, index: int, group: Any) -> Any:
    from dasktrain.trainer import optim

    key = f"groups[{index}]"
    if not isinstance(group, dict):
        raise r.error("optimizer", key, f"expected a table, got {group!r}")
    known = ["patterns", "lr", "weight_decay"]
    for k in group:
        if k not in known:
            raise r.unknown("optimizer", f"{key}.{k}", known)
    patterns = group.get("patterns", [])
    if isinstance(patterns, str):
        patterns = [patterns]
    try:
        return optim.group(*patterns, lr=group.get("lr"),
                           weight_decay=group.get("weight_decay"))
    except (TypeError, ValueError) as exc:
        raise r.error("optimizer", key, str(exc)) from None


def _metrics(r: Reader, names: Any) -> dict[str, Callable]:
    from dasktrain.cli.builtin_metrics import get_metric

    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise r.error("trainer", "metrics", f"expected a list of names, got {names!r}")
    metrics: dict[str, Callable] = {}
    for name in names:
        if is_reference(name):
            fn, _ = r.reference("trainer", "metrics", name)
            label = name.rpartition(":")[2].rpartition(".")[2]
        else:
            try:
                fn, label = get_metric(name), name
            except ValueError as exc:
                raise r.error("trainer", "metrics", str(exc)) from None
        if label in metrics:
            raise r.error("trainer", "metrics", f"{label!r} is named twice")
        metrics[label] = fn
    return metrics


def _trainer_options(r: Reader) -> tuple[dict[str, Any], int, dict[str, Any],
                                          dict[str, Any]]:
    """(Trainer keywords given, epochs, every trainer value, every run value): the keys
    of ``[trainer]`` and ``[run]``, which both set Trainer keywords."""
    from dasktrain.trainer.modes import mode_class

    table, run = r.table("trainer"), r.table("run")
    parameters = trainer_parameters()
    r.check_keys("run", run, config_keys()["run"])
    mode = r.typed("trainer", "mode", table.get("mode", parameters["mode"][0]), str)
    try:
        mode_class(mode)
    except ValueError as exc:
        raise r.error("trainer", "mode", str(exc)) from None
    mode_params = mode_parameters(mode)
    others = all_mode_options()
    given: dict[str, Any] = {}
    for key, value in table.items():
        if key in ("epochs", "metrics"):
            continue
        if key in ELSEWHERE:
            raise r.unknown("trainer", key, [], ELSEWHERE[key])
        if key in mode_params:
            hint = mode_params[key][1]
        elif key in parameters:
            hint = parameters[key][1]
        elif key in others:
            raise r.error("trainer", key, f"not an option of mode {mode!r} (an option of "
                                          f"{', '.join(others[key])})")
        else:
            raise r.unknown("trainer", key, config_keys()["trainer"])
        given[key] = r.typed("trainer", key, value, hint)
    epochs = r.require("trainer", table, "epochs", int)
    if epochs < 1:
        raise r.error("trainer", "epochs", f"must be a positive integer, got {epochs!r}")
    metric_names = table.get("metrics", [])
    given["metrics"] = _metrics(r, metric_names)
    if "checkpoint_every" in run:
        given["checkpoint_every"] = r.typed("run", "checkpoint_every",
                                            run["checkpoint_every"],
                                            parameters["checkpoint_every"][1])
    values = {"epochs": epochs, "metrics": list(metric_names)}
    for key, (default, _) in parameters.items():
        if key not in ELSEWHERE and key != "metrics":
            values[key] = given.get(key, default)
    for key, (default, _) in mode_params.items():
        values[key] = given.get(key, default)
    run_dir = r.typed("run", "dir", run.get("dir", f"runs/{r.path.stem}"), str)
    run_values = {"dir": r.path_value(run_dir),
                  "checkpoint_every": given.get("checkpoint_every",
                                                parameters["checkpoint_every"][0])}
    return given, epochs, values, run_values


def _build_trainer(r: Reader, model: Callable, loss: Callable, optimizer: Any,
                   given: dict[str, Any], progress: bool) -> Trainer:
    from dasktrain.trainer.driver.trainer import Trainer

    try:
        return Trainer(model, loss, optimizer, progress=progress, **given)
    except (TypeError, ValueError) as exc:
        # The Trainer and the mode name what they refuse: point at those keys.
        message = str(exc)
        trainer = mentioned(message, list(r.table("trainer")))
        run = mentioned(message, list(r.table("run")))
        if message.startswith("parameter group"):  # checked against the model's names
            section, keys = "optimizer", ["groups"]
        elif run and not trainer:
            section, keys = "run", run
        else:
            section, keys = "trainer", trainer
        raise r.error(section, ", ".join(keys) or None, message) from None


def load_train_config(path: str | os.PathLike, *, progress: bool = True) -> TrainConfig:
    """Read the config file at ``path``, build what it describes and check every value.

    Opens the dataset (metadata only), loads the named functions and builds the
    :class:`~dasktrain.Trainer` (which builds the model once); starts no cluster.

    Raises
    ------
    ConfigError
        (a ValueError) naming the file, the section and the key: unknown keys and
        sections, missing required keys, values of the wrong type or refused by the
        Trainer, the optimizer or the mode, files or functions that cannot be found.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for section in document:
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, SECTIONS, n=1)
            hint = f"did you mean [{close[0]}]?" if close else \
                f"sections: {', '.join(SECTIONS)}"
            raise ConfigError(f"{path}: unknown section [{section}] ({hint})")
    r = Reader(path, document)
    train, validation, data_values = _data(r)
    model, model_values = _model(r)
    loss, loss_values = _loss(r)
    optimizer = _optimizer(r)
    given, epochs, trainer_values, run_values = _trainer_options(r)
    trainer = _build_trainer(r, model, loss, optimizer, given, progress)
    optimizer_values = optimizer.to_dict()
    optimizer_values["betas"] = list(optimizer_values["betas"])
    resolved = {"data": data_values, "model": model_values, "loss": loss_values,
                "optimizer": optimizer_values, "trainer": trainer_values, "run": run_values}
    return TrainConfig(path=path, train=train, validation=validation, trainer=trainer,
                       epochs=epochs, run_dir=Path(run_values["dir"]), resolved=resolved)

