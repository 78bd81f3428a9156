"""A run as every process of it sees it: the settings and functions (:class:`RunSpec`) and a
copy of its state at one generation (:class:`Snapshot`).

A worker process receives a snapshot once, when it first evaluates members of the run (or
after it fell behind, joined late or was restarted); from then on it keeps its copy of the
state in step itself, from each generation's update record.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dasktrain.evolve.algorithm import Algorithm, make_algorithm
from dasktrain.evolve.config import AlgorithmConfig
from dasktrain.evolve.draws import EVALUATION_STREAM, generation_rng
from dasktrain.evolve.model import ModelFactory
from dasktrain.evolve.noise import NoiseSource, noise_source
from dasktrain.evolve.worker.fitness import Fitness

__all__ = ["RunSpec", "Snapshot"]


@dataclasses.dataclass(frozen=True, slots=True)
class RunSpec:
    """What a process needs besides the state to evaluate members of a run."""

    run_key: str
    """Names the run (one per fit): the key of every process's copy of its state."""
    algorithm: AlgorithmConfig
    population: int
    seed: int
    noise: str
    noise_size: int | None
    num_params: int
    schedule_steps: int | None
    model: ModelFactory
    fitness: Fitness
    torch_threads: int
    timeout: float

    def noise_source(self) -> NoiseSource:
        return noise_source(self.noise, self.seed, self.num_params, self.noise_size)

    def make_algorithm(self, noise: NoiseSource | None = None) -> Algorithm:
        return make_algorithm(self.algorithm, self.population, self.seed,
                              noise or self.noise_source(), self.model, self.schedule_steps)

    def evaluation_seed(self, generation: int) -> int:
        """The seed every member of ``generation`` is evaluated with (a reward's episodes)."""
        return int(generation_rng(self.seed, generation, EVALUATION_STREAM).integers(2**31))


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """A run's spec (pickled once by the driver, unpickled by each process that needs it)
    and a copy of its state at ``generation``."""

    spec: bytes
    generation: int
    state: Any
