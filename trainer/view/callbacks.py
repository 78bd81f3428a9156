"""Callbacks: code of the user's run in the driver, per update and per epoch.

A callback is a :class:`Callback` (override what you need) or a plain function
``fn(trainer, epoch_record)``, called after every epoch. ``trainer.stop_training = True``
ends the fit cleanly after the current epoch (its checkpoint is written first), as in
Keras. :class:`EarlyStopping` and :class:`ReduceLROnPlateau` watch a metric of the epoch
record: ``"val_<name>"`` for validation (``"val_loss"``, ``"val_accuracy"``), ``"<name>"``
for the training batches (``"loss"``, or a metric given to the Trainer).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from dasktrain._durable import StorageOptions, check_storage_options, join, remove

if TYPE_CHECKING:
    import torch

    from dasktrain.trainer.view.history import History

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "ReduceLROnPlateau",
           "RunningTrainer", "as_callbacks", "monitored", "tell_exception"]

logger = logging.getLogger(__name__)


class RunningTrainer(Protocol):
    """What a callback is given of the :class:`~dasktrain.Trainer` that runs it.

    Declared here rather than imported from the Trainer's module, which imports this one
    to call the callbacks: they depend on this small interface only. The Trainer is its
    one implementation."""

    stop_training: bool
    """Set to end the fit after the current epoch."""
    history: History | None
    """The run's History, growing during the fit."""
    model: torch.nn.Module
    """A plain module holding the latest parameters (after each epoch)."""

    def set_lr_factor(self, factor: float) -> float:
        """Multiply the holder's learning-rate schedule by ``factor`` from the next
        update on."""
        ...

    def save(self, path: str | os.PathLike, *,
             storage_options: StorageOptions | None = None) -> str:
        """Save the model, the settings and the history."""
        ...


class Callback:
    """Hooks called in the driver during :meth:`Trainer.fit`; all optional."""

    steers: bool = True
    """Whether :meth:`on_epoch_end` may change the run (stop it, change the learning
    rate): the next epoch then begins once it returned. A callback that only looks
    (logs, plots, saves the model) says False: the next epoch then begins as soon as the
    last one is complete, while the callback runs on that epoch's end state."""

    def on_fit_start(self, trainer: RunningTrainer) -> None:
        """Before the first epoch of this fit."""

    def on_update(self, trainer: RunningTrainer, records: dict[str, list]) -> None:
        """New per-update records arrived (each list holds one entry per update or per
        gradient since the last call, as in :class:`History`); about twice a second."""

    def on_epoch_end(self, trainer: RunningTrainer, record: dict[str, Any]) -> None:
        """An epoch ended; ``record`` is its entry of ``History.epochs``. Runs before the
        epoch's checkpoint is written, so that it holds what the callbacks decided."""

    def on_fit_end(self, trainer: RunningTrainer, history: History) -> None:
        """The fit ended (normally or by ``stop_training``)."""

    def on_exception(self, trainer: RunningTrainer, error: BaseException) -> None:
        """The fit failed with ``error`` (it diverged, a worker failed, Ctrl-C...); called
        once, before ``error`` propagates, with ``trainer.history`` holding what was
        recorded. An exception raised here is logged and ``error`` propagates as it is."""

    def state_dict(self) -> dict[str, Any]:
        """Plain values saved in the run's checkpoint, so a resumed fit goes on counting."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class _EpochFunction(Callback):
    def __init__(self, fn: Callable[[RunningTrainer, dict[str, Any]], Any]) -> None:
        self.fn = fn

    def on_epoch_end(self, trainer: RunningTrainer, record: dict[str, Any]) -> None:
        self.fn(trainer, record)


def steers(callbacks: list[Callback]) -> bool:
    """Whether any of ``callbacks`` may steer the run at an epoch's end (see
    :attr:`Callback.steers`); one that does not override ``on_epoch_end`` does not."""
    return any(cb.steers and type(cb).on_epoch_end is not Callback.on_epoch_end
               for cb in callbacks)


def as_callbacks(items: Iterable[Callback | Callable]) -> list[Callback]:
    """Callbacks from ``Callback`` objects and plain ``fn(trainer, record)`` functions."""
    out = []
    for item in items:
        if isinstance(item, Callback):
            out.append(item)
        elif callable(item):
            out.append(_EpochFunction(item))
        else:
            raise TypeError(f"a callback must be a dt.Callback or fn(trainer, record), got "
                            f"{type(item).__name__}")
    return out


def tell_exception(callbacks: list[Callback], trainer: RunningTrainer, error: BaseException
                   ) -> None:
    """Call every callback's :meth:`Callback.on_exception`; a hook that fails is logged,
    never raised: the fit's own ``error`` is the one to propagate."""
    for callback in callbacks:
        try:
            callback.on_exception(trainer, error)
        except Exception:
            logger.exception("%s.on_exception failed (the fit's own error, %s, follows)",
                             type(callback).__name__, type(error).__name__)


def monitored(record: dict[str, Any], name: str) -> float:
    """The value of ``name`` in an epoch record (``"val_loss"``, ``"loss"``, ...)."""
    if name.startswith("val_"):
        where, key = record.get("validation") or {}, name[4:]
        if not where:
            raise ValueError(f"cannot monitor {name!r}: the fit has no validation data "
                             "(pass validation= to fit)")
    else:
        where, key = record.get("train") or {}, name
    if key not in where:
        raise ValueError(f"cannot monitor {name!r}: the epoch record has "
                         f"{sorted(where)} (validation metrics take a 'val_' prefix)")
    return float(where[key])


class _Plateau(Callback):
    """Counts epochs without improvement of a monitored value."""

    def __init__(self, monitor: str, mode: str, min_delta: float, patience: int) -> None:
        if mode == "auto":
            mode = "max" if any(w in monitor for w in ("acc", "r2", "auc")) else "min"
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience must be an integer >= 0, got {patience!r}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta!r}")
        self.monitor, self.mode = monitor, mode
        self.min_delta, self.patience = min_delta, patience
        self.best = math.inf if mode == "min" else -math.inf
        self.best_epoch = -1
        self.wait = 0

    def _improved(self, record: dict[str, Any]) -> bool:
        value = monitored(record, self.monitor)
        better = (value < self.best - self.min_delta if self.mode == "min" else
                  value > self.best + self.min_delta)
        if better:
            self.best, self.best_epoch, self.wait = value, int(record["epoch"]), 0
        else:
            self.wait += 1
        return better

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.wait = int(state["wait"])


class EarlyStopping(_Plateau):
    """Stop the fit once ``monitor`` has not improved by ``min_delta`` for ``patience``
    epochs. The run ends cleanly after that epoch: its checkpoint is written and
    resumable, the History is complete, ``stopped_epoch`` says where it stopped.

    Parameters
    ----------
    monitor
        ``"val_loss"`` (default), ``"val_<metric>"`` or a training metric.
    patience
        Epochs without improvement tolerated.
    mode
        ``"min"``, ``"max"`` or ``"auto"`` (max for accuracy-like names).
    min_delta
        Smallest change that counts as an improvement.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: str = "auto",
                 min_delta: float = 0.0) -> None:
        super().__init__(monitor, mode, min_delta, patience)
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, trainer: RunningTrainer, record: dict[str, Any]) -> None:
        if not self._improved(record) and self.wait >= self.patience:
            trainer.stop_training = True
            self.stopped_epoch = int(record["epoch"])
            if trainer.history is not None:
                trainer.history.events.append(
                    f"early stopping after epoch {self.stopped_epoch}: {self.monitor} has "
                    f"not improved on {self.best:.6g} (epoch {self.best_epoch}) for "
                    f"{self.wait} epoch(s)")


class ReduceLROnPlateau(_Plateau):
    """Multiply the holder's learning rate by ``factor`` once ``monitor`` has not improved
    for ``patience`` epochs (then wait ``patience`` epochs again). The factor multiplies
    the optimizer's schedule, is kept in the holder's state and in checkpoints.

    Parameters
    ----------
    monitor, mode, min_delta, patience
        As for :class:`EarlyStopping`.
    factor
        In (0, 1).
    min_factor
        The learning rate is never scaled below ``min_factor`` times the schedule's.
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 2,
                 mode: str = "auto", min_delta: float = 0.0, min_factor: float = 0.0) -> None:
        super().__init__(monitor, mode, min_delta, patience)
        if not 0 < factor < 1:
            raise ValueError(f"factor must lie in (0, 1), got {factor!r}")
        self.factor, self.min_factor = factor, min_factor
        self.lr_factor = 1.0

    def on_epoch_end(self, trainer: RunningTrainer, record: dict[str, Any]) -> None:
        if self._improved(record) or self.wait < self.patience:
            return
        self.wait = 0
        target = max(self.lr_factor * self.factor, self.min_factor)
        if target < self.lr_factor:
            self.lr_factor = trainer.set_lr_factor(target)
            if trainer.history is not None:
                trainer.history.events.append(
                    f"learning rate x{self.lr_factor:.4g} after epoch {record['epoch']}: "
                    f"{self.monitor} stalled at {self.best:.6g}")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "lr_factor": self.lr_factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.lr_factor = float(state.get("lr_factor", 1.0))


class ModelCheckpoint(_Plateau):
    """Keep the model of the last ``keep_last`` epochs (``epoch-NNNN.pt``) and of the best
    epoch by ``monitor`` (``best.pt``) in ``directory``, each a :meth:`Trainer.save` file
    that :meth:`Trainer.load` reads. Older epoch files are deleted as new ones come; the
    fit's own ``checkpoint=`` (the state to resume from) is separate and always the latest.

    Parameters
    ----------
    directory
        Where the files go.
    keep_last
        Epoch files kept (0: none).
    monitor
        The metric deciding ``best.pt`` (``"val_loss"`` by default); None: no best file.
    mode, min_delta
        As for :class:`EarlyStopping`.
    storage_options
        Passed to fsspec for a ``directory`` at a URL (``s3://...``).
    """

    steers = False  # it only looks at the epoch's end

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3,
                 monitor: str | None = "val_loss", mode: str = "auto",
                 min_delta: float = 0.0, *,
                 storage_options: StorageOptions | None = None) -> None:
        super().__init__(monitor or "loss", mode, min_delta, patience=0)
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"keep_last must be an integer >= 0, got {keep_last!r}")
        self.directory = os.fspath(directory)  # a local path or a URL (s3://bucket/run)
        self.keep_last = keep_last
        self.track_best = monitor is not None
        self.kept: list[str] = []
        self.storage_options = check_storage_options(storage_options)

    def on_epoch_end(self, trainer: RunningTrainer, record: dict[str, Any]) -> None:
        if self.keep_last:
            path = join(self.directory, f"epoch-{int(record['epoch']):04d}.pt")
            trainer.save(path, storage_options=self.storage_options)
            self.kept = [p for p in self.kept if p != path] + [path]
            while len(self.kept) > self.keep_last:
                remove(self.kept.pop(0), self.storage_options)
        if self.track_best and self._improved(record):
            trainer.save(join(self.directory, "best.pt"),
                         storage_options=self.storage_options)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kept": list(self.kept)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.kept = [str(p) for p in state.get("kept", [])]
