"""What the holder records for the History: one row per update, one entry per gradient.

Per update (``PER_UPDATE``): ``version`` (after it), ``time``, ``loss`` (sample-weighted over
what it applied), ``samples``, ``contributors`` (gradients or replicas it applied) and
``gradients`` (entries recorded for it, dropped ones included). Per gradient
(``PER_GRADIENT``, and the fields a mode declares in ``UpdateMode.gradient_fields``):
``staleness`` (holder version at apply time minus the version it was computed on),
``staleness_worker``, ``scale`` (learning-rate factor applied), ``compensated`` (delay
compensation applied) and ``dropped`` (recorded, not applied). A gradient's entry belongs
to the next update recorded after it.

Every name not in ``PER_UPDATE`` is per gradient: that is how the History and the update
log tell the two apart without a schema.

A holder on a threaded update appends from its serial thread while its event loop records
dropped gradients and takes rows for the driver: each call holds one lock, so a row is
written to every column, or to none, before anyone reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["PER_GRADIENT", "PER_UPDATE", "Records"]

PER_UPDATE = ("version", "time", "loss", "samples", "contributors", "gradients")
PER_GRADIENT = ("staleness", "staleness_worker", "scale", "compensated", "dropped")


class Records:
    """Column lists of updates and gradients, handed out by :meth:`take`."""

    def __init__(self, gradient_fields: Mapping[str, Any] | None = None) -> None:
        extra = dict(gradient_fields or {})
        clash = sorted(set(extra) & {*PER_UPDATE, *PER_GRADIENT})
        if clash:
            raise ValueError(f"gradient field(s) {clash} are recorded for every mode already")
        self._defaults = extra
        self.names = (*PER_UPDATE, *PER_GRADIENT, *extra)
        self._columns: dict[str, list] = {name: [] for name in self.names}
        self._open = 0  # gradient entries not yet closed by an update row
        self._lock = threading.Lock()

    def gradient(self, *, staleness: int, worker: int, scale: float = 1.0,
                 compensated: bool = False, dropped: bool = False, **fields: Any) -> None:
        """One gradient, applied or (``dropped``) not, with the mode's own ``fields``."""
        if fields and not fields.keys() <= self._defaults.keys():
            unknown = sorted(set(fields) - set(self._defaults))
            raise ValueError(f"gradient field(s) {unknown} were not declared by the mode")
        with self._lock:
            columns = self._columns
            columns["staleness"].append(int(staleness))
            columns["staleness_worker"].append(int(worker))
            columns["scale"].append(float(scale))
            columns["compensated"].append(bool(compensated))
            columns["dropped"].append(bool(dropped))
            for name, default in self._defaults.items():
                columns[name].append(fields.get(name, default))
            self._open += 1

    def update(self, *, version: int, loss: float, samples: int, contributors: int) -> None:
        """One update; the gradient entries recorded since the last one belong to it."""
        with self._lock:
            columns = self._columns
            columns["version"].append(int(version))
            columns["time"].append(time.time())
            columns["loss"].append(float(loss))
            columns["samples"].append(int(samples))
            columns["contributors"].append(int(contributors))
            columns["gradients"].append(self._open)
            self._open = 0

    def take(self) -> dict[str, list]:
        """The rows recorded since the last call; entries of no update yet stay."""
        taken = {name: [] for name in self.names}
        with self._lock:
            for name in PER_UPDATE:
                taken[name], self._columns[name] = self._columns[name], []
            for name in self.names[len(PER_UPDATE):]:
                column = self._columns[name]
                cut = len(column) - self._open
                taken[name], self._columns[name] = column[:cut], column[cut:]
        return taken
