"""What the generation loop asks of an algorithm, and the one way to make one.

Both algorithms are pure state machines that every process of a run holds a copy of:
``state = algorithm.advance(state, generation, ranks)`` moves a copy from one generation to
the next, ``algorithm.member(state, generation, index, out)`` writes a member's parameters,
and ``digest(state)`` lets the driver check that the copies agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from dasktrain.evolve.config import AlgorithmConfig, ESConfig
from dasktrain.evolve.deep_ga import GeneticAlgorithm
from dasktrain.evolve.model import ModelFactory, initial_parameters
from dasktrain.evolve.noise import NoiseSource
from dasktrain.evolve.openai_es import EvolutionStrategy

__all__ = ["Algorithm", "initial_state", "make_algorithm"]


class Algorithm(Protocol):
    """The interface of :class:`~.openai_es.EvolutionStrategy` and
    :class:`~.deep_ga.GeneticAlgorithm`."""

    population: int

    def advance(self, state: Any, generation: int, ranks: np.ndarray) -> Any: ...

    def seeds(self, generation: int) -> np.ndarray | None: ...

    def member(self, state: Any, generation: int, index: int, out: np.ndarray,
               seeds: np.ndarray | None = None) -> np.ndarray: ...

    def best(self, state: Any, factory: Callable[[], torch.nn.Module]) -> np.ndarray: ...

    def digest(self, state: Any) -> int: ...

    def state_dict(self, state: Any) -> dict[str, Any]: ...

    def load_state(self, values: dict[str, Any]) -> Any: ...


def make_algorithm(config: AlgorithmConfig, population: int, seed: int, noise: NoiseSource,
                   factory: ModelFactory, schedule_steps: int | None = None) -> Algorithm:
    """The algorithm of ``config``; ``factory`` makes the model (the GA's individuals are
    made under their own initialisation seeds), ``schedule_steps`` is the length of a
    decaying learning-rate schedule (ES)."""
    if isinstance(config, ESConfig):
        return EvolutionStrategy(config, population, seed, noise, schedule_steps)
    return GeneticAlgorithm(config, population, seed, noise,
                            lambda init: initial_parameters(factory, init))


def initial_state(algorithm: Algorithm, factory: ModelFactory, seed: int) -> Any:
    """Generation 0's state: ES starts from the model made under ``seed``."""
    if isinstance(algorithm, EvolutionStrategy):
        return algorithm.initial_state(initial_parameters(factory, seed))
    return algorithm.initial_state()
