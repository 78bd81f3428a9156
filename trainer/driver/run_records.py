"""What one ``fit`` records as it runs, in the driver.

The holder's progress (polled by :class:`~dasktrain.trainer.driver.run.FitRun`) goes into
the :class:`~dasktrain.trainer.view.history.History`, the run's log beside the checkpoint
(:mod:`.update_log`) and the progress bar; each epoch's record, the events and the
workers' warnings likewise. One place, so that the History and the log never disagree: a
resumed run starts from the log, and what the History holds is what the log says.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Callable
from typing import Any

from dasktrain._durable import StorageOptions
from dasktrain.trainer.driver.update_log import KINDS, UpdateLog
from dasktrain.trainer.view.history import History

__all__ = ["RunRecords"]


class RunRecords:
    """The History of one fit, its log and its progress bar, fed from the holder's progress.

    Parameters
    ----------
    history
        The fit's History (a resumed one holds what the run recorded so far).
    checkpoint
        The run's checkpoint file, beside which its log lives; None: no log.
    storage_options
        fsspec's, for a checkpoint at a URL.
    progress
        The progress bar (tqdm's interface), or None.
    on_records
        Called with each poll's per-update records (the callbacks' ``on_update``).
    """

    def __init__(self, history: History, checkpoint: str | None,
                 storage_options: StorageOptions | None, progress: Any,
                 on_records: Callable[[dict[str, list]], Any] | None) -> None:
        self.history = history
        self.progress = progress
        self.on_records = on_records
        self.version = 0  # the holder's at the last poll: what events are logged at
        self.boundary_version = 0  # the version at the last epoch boundary taken
        self.epoch_summary: dict[str, str] = {}  # the last epoch's metrics, on the bar
        self._warned: set[tuple[str, str]] = set()
        self.log: UpdateLog | None = None
        if checkpoint:  # what a resumed run recorded so far starts the run's log
            self.log = UpdateLog(checkpoint, storage_options=storage_options)
            self.log.rewrite(history.records(), {name: getattr(history, name)
                                                 for name in KINDS.values()},
                             version=history.version[-1] if history.version else 0)

    def take(self, progress: dict[str, Any]) -> None:
        """The holder's progress message: its updates, claims, events and warnings."""
        self.version = progress["version"]
        claims = [[progress["epoch"], *c] for c in progress["claims"]]
        # The claims first: extending by the records lets go of the claims of updates let
        # go (history_updates), these included.
        self.history.claims.extend(claims)
        self.history.extend(progress["records"])
        if self.log is not None:
            self.log.append(progress["records"])
            self.log.append_items("claim", claims, self.version)
        self.add_events(progress["events"])
        self.history.fenced_calls = int(progress.get("fenced", 0))
        self.history.refused_gradients = progress["refused"]
        self._forward(progress["notices"])

    def show_progress(self, progress: dict[str, Any]) -> None:
        """Advance the bar by the updates of ``progress``."""
        records = progress["records"]
        if self.progress is not None and records["loss"]:
            self.progress.update(len(records["loss"]))
            self.progress.set_postfix(epoch=progress["epoch"],
                                      loss=f"{records['loss'][-1]:.4g}", **self.epoch_summary)

    def hand_on(self, progress: dict[str, Any]) -> None:
        """Give the per-update records of ``progress`` to ``on_records``."""
        if self.on_records is not None and progress["records"].get("loss"):
            self.on_records(progress["records"])

    def add_events(self, events: list[str]) -> None:
        """Events for the History (and the run's log)."""
        self.history.events.extend(events)
        if self.log is not None:
            self.log.append_items("event", events, self.version)

    def record_epoch(self, record: dict[str, Any], version: int | None = None) -> None:
        """An epoch's record for the History (and the run's log, as of ``version``: by
        default its boundary's)."""
        self.history.epochs.append(record)
        if self.log is not None:
            self.log.append_items("epoch_record", [record], self.boundary_version
                                  if version is None else version)

    def record_unrecorded(self, first: int, epoch: int, version: int) -> None:
        """A state of ``epoch`` written when the holder is lost counts the epochs before it
        (from ``first``, the driver's) as complete, some of whose ends the driver had yet
        to record: each gets a record that says so, so that a resumed History still has
        one per epoch."""
        recorded = {int(r["epoch"]) for r in self.history.epochs}
        for missing in range(first, epoch):
            if missing not in recorded:
                self.record_epoch({"epoch": missing, "unrecorded": (
                    "the parameter holder was lost before the driver recorded this epoch's "
                    "end (its updates are in the History's per-update records)")}, version)

    def show_epoch(self, record: dict[str, Any]) -> None:
        """Put an epoch's training metrics (beyond the loss) and validation metrics on the
        progress bar, where they stay until the next epoch's."""
        shown = {k: v for k, v in (record.get("train") or {}).items() if k != "loss"}
        shown.update({f"val_{k}": v for k, v in (record.get("validation") or {}).items()})
        self.epoch_summary = {k: f"{v:.4g}" for k, v in shown.items()
                              if isinstance(v, (int, float))}
        if self.progress is not None:
            self.progress.set_postfix(epoch=record["epoch"], **self.epoch_summary)

    def summary(self) -> dict[str, Any]:
        """The History for a checkpoint, of constant size (what grows with the run is in
        its log, synced to disk here first)."""
        if self.log is not None:
            self.log.sync()
        return self.history.to_dict(per_update=False, empty=KINDS.values())

    def _forward(self, notices: list[dict[str, Any]]) -> None:
        """Raise the first occurrence of each worker's warning here, where it is seen."""
        for notice in notices:
            key = (notice["category"], notice["message"])
            if key in self._warned:
                continue
            self._warned.add(key)
            self.add_events([f"worker {notice['worker']} warned: "
                             f"{notice['category']}: {notice['message']}"])
            warnings.warn(f"trainer worker {notice['worker']}: {notice['message']}",
                          _category(notice["category"]), stacklevel=3)


def _category(name: str) -> type[Warning]:
    """The built-in warning class of that name (so users' filters apply), else
    UserWarning."""
    found = getattr(builtins, name, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
