"""What a fit did: per-update loss and staleness, per-epoch throughput, stall, validation."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from dasktrain.trainer.update_log import PER_GRADIENT, PER_UPDATE

__all__ = ["History"]


@dataclasses.dataclass(slots=True)
class History:
    """The record of :meth:`Trainer.fit`.

    Per update (one optimizer step on the holder): ``version``, ``loss`` (batch-size weighted
    over the gradients applied), ``samples``, ``contributors`` (gradients averaged) and
    ``time``. Per applied gradient: ``staleness`` (holder version at apply time minus the
    version it was computed on) and ``staleness_worker``. Per epoch: a dict in ``epochs``
    with wall time, samples/s, data-stall fraction, the workers' mean time waiting for the
    exchange (``exchange_s``), how they reached the holder (``exchange_via``: counts of
    ``local``, ``direct``, ``actor``) and validation metrics. ``events`` says what happened
    to workers (lost, rejoined, refused gradients).
    """

    mode: str = ""
    workers: int = 0
    version: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    samples: list[int] = dataclasses.field(default_factory=list)
    contributors: list[int] = dataclasses.field(default_factory=list)
    time: list[float] = dataclasses.field(default_factory=list)
    staleness: list[int] = dataclasses.field(default_factory=list)
    staleness_worker: list[int] = dataclasses.field(default_factory=list)
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)
    refused_gradients: int = 0
    wall_time: float = 0.0

    def extend(self, records: dict[str, list]) -> None:
        """Append a batch of the holder's update records."""
        for name, values in records.items():
            getattr(self, name).extend(values)

    def records(self) -> dict[str, list]:
        """The per-update and per-gradient lists, by name (as the holder reports them)."""
        return {name: list(getattr(self, name)) for name in (*PER_UPDATE, *PER_GRADIENT)}

    @property
    def updates(self) -> int:
        return len(self.loss)

    @property
    def samples_per_second(self) -> float:
        return sum(self.samples) / self.wall_time if self.wall_time > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Headline figures."""
        last = self.epochs[-1] if self.epochs else {}
        return {
            "mode": self.mode,
            "workers": self.workers,
            "updates": self.updates,
            "final_loss": self.loss[-1] if self.loss else None,
            "samples_per_s": self.samples_per_second,
            "mean_staleness": statistics.fmean(self.staleness) if self.staleness else 0.0,
            "max_staleness": max(self.staleness, default=0),
            "data_stall": last.get("stall"),
            "refused_gradients": self.refused_gradients,
            "wall_time_s": self.wall_time,
            "validation": last.get("validation"),
            "events": len(self.events),
        }

    def to_dict(self, per_update: bool = True) -> dict[str, Any]:
        """Plain lists and numbers; ``per_update=False`` leaves out the per-update and
        per-gradient lists (a fit's checkpoint keeps those in its update log)."""
        values = dataclasses.asdict(self)
        if not per_update:
            for name in (*PER_UPDATE, *PER_GRADIENT):
                del values[name]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> History:
        return cls(**values)

    def plot(self, ax: Any = None) -> Any:
        """Loss per update (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("History.plot needs matplotlib: pip install matplotlib") \
                from exc
        if ax is None:
            _, ax = plt.subplots()
        ax.plot(self.version, self.loss)
        ax.set_xlabel("update")
        ax.set_ylabel("training loss")
        ax.set_title(f"{self.mode}, {self.workers} worker(s)")
        return ax
