"""Resuming a fit: refuse a checkpoint of another run, and take back what it recorded.

Pure checks of a checkpoint's plain data against the trainer's settings and the dataset,
and the :class:`History` and callback states it carries; the holder's own state goes back
through the fit run.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from dasktrain._durable import StorageOptions
from dasktrain.datasets import Dataset
from dasktrain.trainer.driver.settings import TrainerSettings, resolve_assignment, run_settings
from dasktrain.trainer.driver.update_log import UpdateLog, records_of, split_kinds
from dasktrain.trainer.modes import mode_class
from dasktrain.trainer.view.callbacks import Callback
from dasktrain.trainer.view.history import History

__all__ = ["check_resumable", "checkpoint_history", "dataset_key", "load_callback_states"]


def dataset_key(dataset: Dataset) -> str:
    """Which data a run trains on: the dataset's identity and its rows."""
    return f"{dataset.identity}[{dataset.start}:{dataset.stop}]"


def checkpoint_history(state: dict[str, Any], path: str | os.PathLike,
                       storage_options: StorageOptions | None = None) -> History:
    """The History of a checkpoint: its summary, and the per-update records, events, claims
    and epoch records from the run's log beside it up to the checkpoint's version (a fit
    checkpoint) or from the file itself (a :meth:`Trainer.save`)."""
    history = History.from_dict(state["history"])
    if not history.version and "holder" in state:
        log = UpdateLog(path, storage_options=storage_options)
        updates, others = split_kinds(log.read(up_to_version=int(state["holder"]["version"])))
        # The log has every update's record, those a bounded History had let go too: all
        # are taken back (the fit bounds them again once it has rewritten the log).
        history.updates_before = history.samples_before = 0
        history.kept_updates = None
        history.extend(records_of(updates))
        for name, items in others.items():
            getattr(history, name).extend(items)
        # An epoch's record is logged as of its boundary; a checkpoint of that very
        # boundary counts only the epochs it says are complete.
        complete = int(state.get("complete_epochs", len(history.epochs)))
        history.epochs = [r for r in history.epochs if int(r["epoch"]) < complete]
    return history


def load_callback_states(callbacks: list[Callback], states: list[dict[str, Any]]) -> None:
    """Give each callback its state from the checkpoint (matched by position and type)."""
    for callback, saved in zip(callbacks, states, strict=False):
        if saved.get("type") == type(callback).__name__:
            callback.load_state_dict(saved.get("state") or {})


def check_resumable(trainer: TrainerSettings, state: dict[str, Any], dataset: Dataset,
                    epochs: int, schedule: int, epoch_steps: tuple[int, ...]) -> None:
    """Refuse a resume that would change the run.

    Every setting that decides which batches are drawn or how they are applied must
    match the checkpoint's, named in the error if not. More (or fewer) epochs are
    allowed: the learning-rate schedule is then stretched to the new length, and a
    warning says what that does to the learning rate."""
    mine, theirs = run_settings(trainer), dict(state.get("trainer", {}))
    if "assignment" in theirs:  # written as given ("auto"): compared as it resolved
        theirs["assignment"] = resolve_assignment(
            theirs["assignment"], theirs.get("mode", trainer.mode),
            int(theirs.get("holder_shards", 1)))
    for key, value in mine.items():
        if key in theirs and theirs[key] != value:
            raise ValueError(f"cannot resume: the checkpoint was made with {key}="
                             f"{theirs[key]!r}, this trainer has {key}={value!r}; "
                             "resuming would change the run (use the checkpoint's "
                             "setting, or start afresh)")
    run = state.get("run", {})
    if run.get("dataset") not in (None, dataset_key(dataset)):
        raise ValueError(f"cannot resume: the checkpoint was made on dataset "
                         f"{run['dataset']!r}, this fit is on {dataset_key(dataset)!r}")
    before = run.get("schedule_steps", run.get("total_steps",
                                                state["holder"].get("total_steps")))
    if before is not None and before != schedule:
        kind = mode_class(trainer.mode)
        step = kind.schedule_position(state["holder"], epoch_steps, trainer.mode_options)
        old = trainer.optimizer.lr_at(step, before)
        new = trainer.optimizer.lr_at(step, schedule)
        note = (f"resuming with epochs={epochs} (the checkpoint's run had "
                f"{run.get('epochs', '?')}): the schedule now spans {schedule} "
                f"steps instead of {before}")
        if old != new:
            # Points at the user's fit call: fit -> fit_trainer -> here.
            warnings.warn(f"{note}, so the learning rate at step {step} changes from "
                          f"{old:.4g} to {new:.4g}", stacklevel=4)
