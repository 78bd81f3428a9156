"""What a fit did: per-update loss and staleness, per-epoch throughput, stall, validation."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktrain.trainer.driver.files import read_saved, write_atomically
from dasktrain.trainer.holder.records import PER_GRADIENT, PER_UPDATE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["HISTORY_FORMAT", "History"]

HISTORY_FORMAT = "dasktrain.History/1"


@dataclasses.dataclass(slots=True)
class History:
    """The record of :meth:`Trainer.fit`.

    Per update (one optimizer step, or one averaging round, on the holder): ``version``,
    ``loss`` (batch-size weighted over what it applied), ``samples``, ``contributors``
    (gradients or replicas applied), ``gradients`` (entries recorded for it) and ``time``.
    Per gradient received: ``staleness`` (holder version at apply time minus the version
    it was computed on), ``staleness_worker``, ``scale`` (learning-rate factor),
    ``compensated`` (delay compensation) and ``dropped`` (not applied); fields a mode
    declares (``ssp``'s ``clock_lead``) are in ``extra`` and read as attributes too.
    Per epoch: a dict in ``epochs`` with the samples the holder's updates applied (a
    worker's that died or left included) and their mean loss (``train["loss"]``; the
    other training metrics are over the reports of the workers that finished it,
    ``per_worker``), wall time, samples/s, data-stall fraction, the
    workers' mean time waiting for the exchange (``exchange_s``), how they reached the
    holder (``exchange_via``: counts of ``local``, ``direct``, ``actor``) and validation
    metrics, and, where work is claimed on demand, ``batches_per_worker`` (the share of
    the epoch each worker's gradients took). ``events`` says what happened to workers
    (lost, rejoined, refused gradients, claimed work given back); ``claims`` lists each
    claim of work as ``[epoch, version, worker, first batch, stop]``; ``fenced_calls``
    counts the calls the holder refused because they came from a worker's task that was
    no longer current (a dead one's late push, a claim that waited while it was dropped).

    The per-update and per-gradient lists grow with the run (about 0.3 KB of the driver's
    memory per update), the claims with the epochs. With ``kept_updates``
    (``Trainer(history_updates=N)``) only the last N updates' records stay, and the claims
    made since the first of them; ``updates_before`` and ``samples_before`` count those let
    go, so that :attr:`updates` and :attr:`samples_per_second` still cover the whole run
    (staleness figures cover the updates kept). A run's log beside its checkpoint keeps
    every record.
    """

    mode: str = ""
    workers: int = 0
    version: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    samples: list[int] = dataclasses.field(default_factory=list)
    contributors: list[int] = dataclasses.field(default_factory=list)
    gradients: list[int] = dataclasses.field(default_factory=list)
    time: list[float] = dataclasses.field(default_factory=list)
    staleness: list[int] = dataclasses.field(default_factory=list)
    staleness_worker: list[int] = dataclasses.field(default_factory=list)
    scale: list[float] = dataclasses.field(default_factory=list)
    compensated: list[bool] = dataclasses.field(default_factory=list)
    dropped: list[bool] = dataclasses.field(default_factory=list)
    extra: dict[str, list] = dataclasses.field(default_factory=dict)
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)
    claims: list[list[int]] = dataclasses.field(default_factory=list)
    refused_gradients: int = 0
    fenced_calls: int = 0
    wall_time: float = 0.0
    kept_updates: int | None = None
    updates_before: int = 0
    samples_before: int = 0

    def extend(self, records: dict[str, list]) -> None:
        """Append a batch of the holder's update records (then let the oldest go, past
        ``kept_updates``)."""
        for name, values in records.items():
            if name in _OWN:
                getattr(self, name).extend(values)
            else:
                self.extra.setdefault(name, []).extend(values)
        self.keep(self.kept_updates)

    def keep(self, updates: int | None) -> None:
        """Keep the records of the last ``updates`` updates only (None: all), from now on."""
        self.kept_updates = updates
        if updates is None or len(self.version) <= updates:
            return
        gone = len(self.version) - updates
        # Per-gradient lists hold one entry per gradient recorded for an update.
        counts = self.gradients if len(self.gradients) == len(self.version) \
            else self.contributors
        gradients = sum(counts[:gone])
        self.updates_before += gone
        self.samples_before += sum(self.samples[:gone])
        for name in PER_UPDATE:
            del getattr(self, name)[:gone]
        for name in PER_GRADIENT:
            del getattr(self, name)[:gradients]
        for values in self.extra.values():
            del values[:gradients]
        # Claims made before the first update kept go with those updates' records.
        first = self.version[0]
        self.claims[:] = [claim for claim in self.claims if claim[1] >= first]

    def __getattr__(self, name: str) -> list:
        # Only reached for names that are not fields: a mode's declared record fields.
        try:
            return object.__getattribute__(self, "extra")[name]
        except KeyError:
            raise AttributeError(f"History has no field {name!r}") from None

    def records(self) -> dict[str, list]:
        """The per-update and per-gradient lists, by name (as the holder reports them)."""
        own = {name: list(getattr(self, name)) for name in (*PER_UPDATE, *PER_GRADIENT)}
        return {**own, **{name: list(values) for name, values in self.extra.items()}}

    @property
    def applied_staleness(self) -> list[int]:
        """Staleness of the gradients applied (dropped ones left out)."""
        return [s for s, d in zip(self.staleness, self.dropped, strict=False) if not d]

    @property
    def updates(self) -> int:
        """Updates over the whole run (those let go past ``kept_updates`` included)."""
        return self.updates_before + len(self.loss)

    @property
    def samples_per_second(self) -> float:
        samples = self.samples_before + sum(self.samples)
        return samples / self.wall_time if self.wall_time > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Headline figures."""
        last = self.epochs[-1] if self.epochs else {}
        applied = self.applied_staleness
        return {
            "mode": self.mode,
            "workers": self.workers,
            "updates": self.updates,
            "final_loss": self.loss[-1] if self.loss else None,
            "samples_per_s": self.samples_per_second,
            "mean_staleness": statistics.fmean(applied) if applied else 0.0,
            "max_staleness": max(applied, default=0),
            "dropped_gradients": sum(self.dropped),
            "compensated_gradients": sum(self.compensated),
            "data_stall": last.get("stall"),
            "refused_gradients": self.refused_gradients,
            "wall_time_s": self.wall_time,
            "validation": last.get("validation"),
            "events": len(self.events),
        }

    def to_dict(self, per_update: bool = True, empty: Collection[str] = ()) -> dict[str, Any]:
        """Plain lists and numbers (copies); ``per_update=False`` leaves out the per-update
        and per-gradient lists (a fit's checkpoint keeps those in its update log), and the
        fields named in ``empty`` come out empty (``events``, ``claims``, ``epochs``: the
        log keeps them too). What is left out is not copied: a checkpoint's summary costs
        the same however long the run."""
        left_out = set() if per_update else {*PER_UPDATE, *PER_GRADIENT}
        values = {}
        for field in dataclasses.fields(self):
            name = field.name
            if name in left_out:
                continue
            value = getattr(self, name)
            if name in empty or (name == "extra" and not per_update):
                values[name] = type(value)()
            else:
                values[name] = copy.deepcopy(value)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> History:
        return cls(**values)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the whole history as JSON (atomically: a temporary sibling renamed into
        place), to compare runs later with :meth:`load` and :func:`dasktrain.compare`;
        returns the file written."""
        document = {"format": HISTORY_FORMAT, "history": self.to_dict()}
        return write_atomically(path, json.dumps(document, default=_plain))

    @classmethod
    def load(cls, path: str | os.PathLike) -> History:
        """Read a history written by :meth:`save`."""
        values = read_saved(path, HISTORY_FORMAT, "History")
        unknown = sorted(set(values) - _OWN)
        if unknown:
            raise ValueError(f"{path} holds History fields this version does not know: "
                             f"{unknown}")
        return cls.from_dict(values)

    def plot(self, kind: str = "overview") -> Figure:
        """A figure of the run, shown inline in a notebook.

        ``kind``: ``"overview"`` (loss by update and by wall time, the first epoch metric,
        staleness), ``"loss"``, ``"metrics"`` (training and validation per epoch),
        ``"staleness"``, ``"contributors"``, ``"workers"`` (data stall and samples/s per
        worker per epoch) or ``"events"``. ``fig.savefig("x.png")`` writes it.
        """
        # Here, not at the top: matplotlib loads with the first figure, not with dasktrain.
        from dasktrain.trainer.view.plots import figure

        return figure(self, kind)

    def report(self, path: str | os.PathLike) -> Path:
        """Write a report into the directory ``path``: a PNG per figure and ``index.html``,
        one self-contained page (summary table, epochs, figures, events) that names each
        figure's PNG. Returns the page's path."""
        from dasktrain.trainer.view.report import write_report

        return write_report(self, path)


def _plain(value: Any) -> Any:
    """JSON for the numpy scalars and tuples a record may hold."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot save a {type(value).__name__} in a History")


_OWN = frozenset(f.name for f in dataclasses.fields(History))
