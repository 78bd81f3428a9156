"""What an evolution run did, generation by generation: fitness, speed and bytes exchanged."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktrain.trainer.driver.files import read_saved, write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["EVOLUTION_HISTORY_FORMAT", "EvolutionHistory"]

EVOLUTION_HISTORY_FORMAT = "dasktrain.EvolutionHistory/1"

_PER_GENERATION = ("generation", "best", "mean", "worst", "seconds", "evaluations_per_s",
                   "compute_seconds", "tasks", "missed", "workers", "members_per_worker",
                   "bytes_sent", "record_bytes", "bytes_received", "snapshot_bytes",
                   "parameter_bytes")


@dataclasses.dataclass(slots=True)
class EvolutionHistory:
    """The record of :meth:`Evolver.fit`.

    Per generation (lists of equal length): ``generation``; ``best``, ``mean`` and
    ``worst`` fitness of the population in the fitness's own units (``fitness`` says which:
    a ``"reward"``, higher is better, or a ``"loss"``, lower is better); ``seconds`` (wall
    time of the generation) and ``evaluations_per_s`` (members evaluated per second of
    it); ``compute_seconds`` (the workers' time evaluating, summed); ``tasks`` (Dask tasks,
    re-sent ones included) and ``missed`` (tasks answered by a worker that first needed a
    snapshot); ``workers`` (how many evaluated members) and ``members_per_worker`` (how
    many each did, by address: a slow worker does fewer); ``bytes_sent`` (the tasks'
    pickled arguments), ``record_bytes`` (the generation's update record, the previous
    generation's ranks, once per worker that held it), ``bytes_received`` (the results),
    ``snapshot_bytes`` (copies of the state sent to workers: the first generation of a
    fit, and workers that joined or fell behind) and ``parameter_bytes``, what sending
    every member's float32 parameters would have sent instead
    (:meth:`exchanged_bytes` sums the first three). ``events`` says what happened to
    workers.
    """

    algorithm: str = ""
    fitness: str = ""
    population: int = 0
    parameters: int = 0
    generation: list[int] = dataclasses.field(default_factory=list)
    best: list[float] = dataclasses.field(default_factory=list)
    mean: list[float] = dataclasses.field(default_factory=list)
    worst: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    evaluations_per_s: list[float] = dataclasses.field(default_factory=list)
    compute_seconds: list[float] = dataclasses.field(default_factory=list)
    tasks: list[int] = dataclasses.field(default_factory=list)
    missed: list[int] = dataclasses.field(default_factory=list)
    workers: list[int] = dataclasses.field(default_factory=list)
    members_per_worker: list[dict[str, int]] = dataclasses.field(default_factory=list)
    bytes_sent: list[int] = dataclasses.field(default_factory=list)
    record_bytes: list[int] = dataclasses.field(default_factory=list)
    bytes_received: list[int] = dataclasses.field(default_factory=list)
    snapshot_bytes: list[int] = dataclasses.field(default_factory=list)
    parameter_bytes: list[int] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)
    wall_time: float = 0.0

    @property
    def maximize(self) -> bool:
        """Whether higher fitness is better (a reward) or lower (a loss)."""
        return self.fitness != "loss"

    @property
    def generations(self) -> int:
        return len(self.generation)

    def append(self, **values: Any) -> None:
        """Add one generation's figures (every per-generation field, by name)."""
        missing = set(_PER_GENERATION) - set(values)
        if missing or set(values) - set(_PER_GENERATION):
            raise ValueError(f"a generation's record needs exactly {_PER_GENERATION}")
        for name in _PER_GENERATION:
            getattr(self, name).append(values[name])

    def best_so_far(self) -> list[float]:
        """The best fitness reached by each generation."""
        pick = max if self.maximize else min
        out: list[float] = []
        for value in self.best:
            out.append(value if not out else pick(out[-1], value))
        return out

    def exchanged_bytes(self) -> list[int]:
        """Per generation, the bytes its tasks, update record and results took (snapshots
        apart)."""
        return [s + r + b for s, r, b in zip(self.bytes_sent, self.record_bytes,
                                             self.bytes_received, strict=True)]

    def exchange_ratio(self, skip_first: bool = True) -> float | None:
        """Bytes sending every member's parameters would take, over the bytes exchanged
        (tasks, records, results and snapshots), over the generations (the first left out
        with ``skip_first``: it carries the fit's starting snapshot)."""
        rows = range(1 if skip_first and self.generations > 1 else 0, self.generations)
        exchanged = self.exchanged_bytes()
        ours = sum(exchanged[i] + self.snapshot_bytes[i] for i in rows)
        return sum(self.parameter_bytes[i] for i in rows) / ours if ours else None

    def summary(self) -> dict[str, Any]:
        """Headline figures."""
        total = sum(self.seconds)
        evaluations = self.population * self.generations
        return {
            "algorithm": self.algorithm,
            "fitness": self.fitness,
            "generations": self.generations,
            "population": self.population,
            "parameters": self.parameters,
            "best": self.best_so_far()[-1] if self.best else None,
            "final_mean": self.mean[-1] if self.mean else None,
            "evaluations_per_s": evaluations / total if total else 0.0,
            "bytes_per_generation": (sum(self.exchanged_bytes()) / self.generations
                                     if self.generations else 0.0),
            "exchange_ratio": self.exchange_ratio(),
            "wall_time_s": self.wall_time,
            "events": len(self.events),
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EvolutionHistory:
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"EvolutionHistory fields this version does not know: {unknown}")
        if "record_bytes" not in values:  # written before records were counted apart
            values = {**values, "record_bytes": [0] * len(values.get("generation", []))}
        return cls(**values)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the history as JSON, atomically; returns the file written."""
        document = {"format": EVOLUTION_HISTORY_FORMAT, "history": self.to_dict()}
        return write_atomically(path, json.dumps(document))

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvolutionHistory:
        """Read a history written by :meth:`save`."""
        return cls.from_dict(read_saved(path, EVOLUTION_HISTORY_FORMAT, "EvolutionHistory"))

    def plot(self, kind: str = "overview") -> Figure:
        """A figure of the run: ``"overview"`` (the three below side by side),
        ``"fitness"`` (best, mean and worst per generation, and the best so far),
        ``"throughput"`` (evaluations/s per generation) or ``"bytes"`` (bytes exchanged
        per generation against sending parameters, log scale). ``fig.savefig("x.png")``
        writes it."""
        from dasktrain.evolve.view.plots import figure

        return figure(self, kind)
