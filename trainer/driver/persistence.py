"""A trainer in one file and back: :meth:`Trainer.save` and :meth:`Trainer.load`.

The file holds the model's parameters, every setting of the trainer that is plain data
(:func:`~dasktrain.trainer.driver.settings.saved_settings`) and the History. Functions (the
loss, a ``step``, metrics, a ``transform``) are written by name only and never imported
from a file: ``load`` takes them as arguments, and restores by itself only a loss of
``torch.nn.functional`` (looked up there by name). A loss it can neither take nor restore
becomes a :class:`~dasktrain.trainer.driver.settings.MissingLoss`, refused by ``evaluate``
and ``fit`` with the fix; ``predict`` needs none. A file of an earlier version lacks some
settings: those take the ``Trainer``'s defaults.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional

from dasktrain._durable import StorageOptions, check_storage_options
from dasktrain.trainer.driver.checkpoint import load_checkpoint, save_checkpoint
from dasktrain.trainer.driver.resume import checkpoint_history
from dasktrain.trainer.driver.settings import FUNCTION, PLAIN_KEYWORDS, MissingLoss
from dasktrain.trainer.optim import OptimizerConfig
from dasktrain.trainer.view.history import History
from dasktrain.trainer.worker.compute import MetricFunction, StepFunction
from dasktrain.trainer.worker.loop import LossFunction

__all__ = ["SavedTrainer", "read_trainer", "save_trainer"]

_TORCH_LOSSES = frozenset(name for name in dir(torch.nn.functional)
                          if name.endswith(("_loss", "cross_entropy")) or name == "kl_div")
"""Losses restored by name: looked up in ``torch.nn.functional``, which is imported anyway,
so a name in a file selects among them and never makes anything import."""


def save_trainer(path: str | os.PathLike, model: torch.nn.Module, settings: dict[str, Any],
                 history: History | None, *,
                 storage_options: StorageOptions | None = None) -> str:
    """Write ``model``'s parameters, ``settings`` and ``history`` to ``path`` (atomic)."""
    written = save_checkpoint(path, {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "trainer": settings,
        "history": history.to_dict() if history else None},
        storage_options=check_storage_options(storage_options))
    return str(written)


@dataclasses.dataclass(kw_only=True, slots=True)
class SavedTrainer:
    """What a trainer file holds, ready to build the Trainer from."""

    arguments: dict[str, Any]
    """The ``Trainer``'s arguments other than ``model``: the settings, the optimizer and
    the functions."""
    model_state: dict[str, torch.Tensor] | None
    """The model's ``state_dict`` (a :meth:`Trainer.save` file), else None."""
    flat_values: np.ndarray | None
    """A fit checkpoint's parameters: the holder's flat parameters, then buffers."""
    history: History | None
    """The History recorded up to the file."""


def read_trainer(path: str | os.PathLike, *, loss: LossFunction | None,
                 step: StepFunction | None, metrics: dict[str, MetricFunction] | None,
                 transform: Callable | None,
                 storage_options: StorageOptions | None) -> SavedTrainer:
    """Read a :meth:`Trainer.save` file or a fit checkpoint, with the functions given."""
    storage_options = check_storage_options(storage_options)
    state = load_checkpoint(path, storage_options=storage_options)
    config = state.get("trainer")
    if config is None:
        raise ValueError(f"{path} holds no trainer settings")
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the stored trainer settings are not a mapping")
    arguments = _plain_settings(path, config)
    arguments.update(
        optimizer=OptimizerConfig.from_dict(config["optimizer"]),
        mode_options=_mode_options(path, config),
        loss=_loss(config, loss, step), step=step, metrics=metrics, transform=transform)
    if "model" in state:
        model_state, flat = state["model"], None
    else:  # a fit checkpoint
        holder = state["holder"]
        model_state, flat = None, torch.cat([holder["params"], holder["buffers"]]).numpy()
    history = checkpoint_history(state, path, storage_options) if state.get("history") \
        else None
    return SavedTrainer(arguments=arguments, model_state=model_state, flat_values=flat,
                        history=history)


def _plain_settings(path: str | os.PathLike, config: dict[str, Any]) -> dict[str, Any]:
    """The stored settings among :data:`PLAIN_KEYWORDS` (missing ones: the defaults); only
    keyword arguments and only scalars, which the Trainer then checks as it checks any."""
    plain = {}
    for key in PLAIN_KEYWORDS:
        if key not in config:
            continue
        value = config[key]
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"{path}: the stored {key} is not a plain value: {value!r}")
        plain[key] = value
    return plain


def _mode_options(path: str | os.PathLike, config: dict[str, Any]) -> dict[str, Any]:
    mode_options = config.get("mode_options") or {}
    if not isinstance(mode_options, dict):
        raise ValueError(f"{path}: the stored mode options are not a mapping")
    # A function given as an option is stored by name only: such options are left out
    # here (the mode's default applies) and must be given again to fit.
    return {k: v for k, v in mode_options.items()
            if not (isinstance(v, str) and v.startswith(FUNCTION))}


def _loss(config: dict[str, Any], loss: LossFunction | None, step: StepFunction | None
          ) -> LossFunction | None:
    """The loss to build the trainer with: the one given, else the stored one where it can
    be restored, else a :class:`MissingLoss` naming what the file names."""
    if loss is not None:
        return loss
    saved_loss, saved_step = config.get("loss"), config.get("step")
    restored = _torch_loss(saved_loss)
    if step is not None:
        return restored  # the step computes the loss; this one only goes with it
    if restored is not None and saved_step is None:
        return restored
    # Saved with a step that is not given: the stored loss alone would compute another
    # loss than the trainer did, so none is restored.
    return MissingLoss(saved_loss, saved_step)


def _torch_loss(name: Any) -> LossFunction | None:
    prefix = f"{FUNCTION}torch.nn.functional."
    if isinstance(name, str) and name.startswith(prefix) and \
            name[len(prefix):] in _TORCH_LOSSES:
        return getattr(torch.nn.functional, name[len(prefix):])
    return None
