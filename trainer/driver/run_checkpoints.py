"""Which checkpoints one ``fit`` writes, and when, in the driver.

A run checkpoints at each epoch's boundary and, with ``checkpoint_every``, at marks every
that many updates. The holder takes the state of a mark at the exact update (its
``state_at`` call answers when it reaches it), so the driver asks for the next mark ahead
and writes what comes back on a later poll: a holder that dies between two polls has
still handed it over. Checkpoints never go backwards: a mark's state of an epoch after the
one whose boundary the driver has yet to save waits for that save, and a save older than
the last one written is refused. The file itself is :mod:`.checkpoint`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dasktrain._durable import StorageOptions
from dasktrain.trainer.driver.checkpoint import save_checkpoint
from dasktrain.trainer.driver.run_records import RunRecords
from dasktrain.trainer.errors import TrainerError

__all__ = ["RunCheckpoints", "StateNotHandedOver"]

logger = logging.getLogger(__name__)


class StateNotHandedOver(TrainerError):
    """The holder's answer to a mark's ``state_at`` call was an error."""


class RunCheckpoints:
    """The checkpoints of one fit: the epochs' boundaries and the marks between them.

    Parameters
    ----------
    path
        The run's checkpoint (a directory or a URL); None: the run writes none.
    every
        Also checkpoint every this many updates; None: at the boundaries only.
    extra
        What goes into each checkpoint beside the holder's state and the History (the
        trainer's settings, the callbacks' states, the run's plan), taken when it is
        written.
    storage_options
        fsspec's, for a checkpoint at a URL.
    records
        The run's records: their History goes in, and an epoch a mark skips past gets its
        record.
    """

    def __init__(self, path: str | None, every: int | None,
                 extra: Callable[[], dict[str, Any]],
                 storage_options: StorageOptions | None, records: RunRecords) -> None:
        self.path = path
        self.every = every
        self.extra = extra
        self.storage_options = storage_options
        self.records = records
        self.last: Path | None = None  # the file last written
        self._saved = (-1, -1)  # (version, complete epochs) of the last checkpoint written
        # The holder's answer to come for the next mark (an actor call's future: .done(),
        # .result()).
        self._pending: Any = None
        self._deferred: dict[str, Any] | None = None  # a mark's state ahead of the boundary

    def write(self, holder_state: dict[str, Any], complete_epochs: int | None) -> None:
        """Write a checkpoint of ``holder_state`` (``complete_epochs=None``: a mark, which
        counts the epochs complete by the state's own epoch), unless a newer one is
        written already."""
        version = int(holder_state["version"])
        if complete_epochs is None:
            complete_epochs = int(holder_state["epoch"])
        if (version, complete_epochs) < self._saved:  # never backwards
            # The same version with fewer epochs complete is a mark that fell on an epoch's
            # last update, taken before the boundary: the boundary's checkpoint has it.
            log = logger.warning if version < self._saved[0] else logger.debug
            log("a checkpoint at version %d (%d epochs complete) was not written: the one "
                "at version %d (%d) is newer", version, complete_epochs, *self._saved)
            return
        self.last = save_checkpoint(self.path, {
            "holder": holder_state, "complete_epochs": complete_epochs,
            "history": self.records.summary(), **self.extra()},
            storage_options=self.storage_options)
        self._saved = (version, complete_epochs)
        logger.info("checkpoint at version %d: %s", version, self.last)

    def take(self, epoch: int, version: int, ask: Callable[[int], Any] | None) -> None:
        """Write the state the holder handed over at the last mark, and ``ask`` it for the
        next one (``ask(version)`` starts the holder's ``state_at`` call and returns its
        future; None: the holder is lost, and what it handed over is written now).

        ``epoch`` is the one whose boundary the driver has yet to save: a state of a later
        epoch waits for that save. Holder shards asked for a mark one of them has passed
        answer at different updates: that answer is no state to resume from and is not
        written; the next mark is asked for instead. Raises :class:`StateNotHandedOver`
        where the holder answered with an error."""
        if not (self.path and self.every):
            return
        pending = self._pending
        start = version
        if pending is not None:
            if not pending.done():
                return
            self._pending = None
            try:
                state = pending.result()  # done: no wait
            except Exception as exc:
                raise StateNotHandedOver(f"the parameter holder could not hand over its "
                                         f"state: {type(exc).__name__}: {exc}") from exc
            if "mixed_versions" in state:  # shards caught at different updates: the next mark
                start = max(state["mixed_versions"])
            else:
                self._deferred = state
        if self._deferred is not None:
            state = self._deferred
            if int(state["epoch"]) > epoch and ask is not None:
                return  # written after the boundary's save
            self._deferred = None
            self.records.record_unrecorded(epoch, int(state["epoch"]), int(state["version"]))
            self.write(state, None)
            start = int(state["version"])
        if ask is not None:
            self._pending = ask(start + self.every)

    def forget(self) -> None:
        """Drop the call for the next mark (the run is over)."""
        self._pending = None
