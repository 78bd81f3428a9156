"""A truncation-selection genetic algorithm with elitism in the Deep GA encoding (Such et
al. 2017), as a pure state machine.

An individual is a tuple of seeds: ``(init, m1, m2, ...)``. Its parameters are the model
made under ``torch.manual_seed(init)`` (flattened), plus ``sigma ε(m1)``, plus ``sigma ε(m2)``, ...,
added one after the other in float32. A population travels as these tuples and every
process rebuilds an individual from its seeds, starting from the longest prefix it still
holds in its cache (usually the parent, one mutation away).

Generation ``g``, ranked: the ``elite`` best are kept as they are; every other place goes
to a child of a parent drawn uniformly from the ``parents`` best, with one more seed. The
draws are pure functions of the run's seed and ``g`` (:func:`~.draws.generation_rng`), so the
ranks are all any process needs to compute the next population.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dasktrain.evolve.config import GAConfig
from dasktrain.evolve.draws import INIT_STREAM, NOISE_STREAM, PARENT_STREAM, generation_rng
from dasktrain.evolve.noise import NoiseSource

__all__ = ["Encoding", "GAState", "GeneticAlgorithm", "IndividualCache"]

Encoding = tuple[int, ...]
"""An individual: its initialisation seed, then its mutation seeds."""


@dataclasses.dataclass(slots=True)
class GAState:
    """The population's encodings, and the best individual of the last ranked generation
    (None before the first)."""

    population: tuple[Encoding, ...]
    best: Encoding | None = None

    def copy(self) -> GAState:
        return GAState(self.population, self.best)


class IndividualCache:
    """Parameters of recently built individuals, by encoding (least recently used out)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[Encoding, np.ndarray] = collections.OrderedDict()
        self.hits = self.built = 0

    def longest_prefix(self, encoding: Encoding) -> tuple[int, np.ndarray | None]:
        """The length of the longest prefix of ``encoding`` held, and its parameters."""
        for length in range(len(encoding), 0, -1):
            found = self._items.get(encoding[:length])
            if found is not None:
                self._items.move_to_end(encoding[:length])
                return length, found
        return 0, None

    def put(self, encoding: Encoding, params: np.ndarray) -> None:
        self._items[encoding] = params
        self._items.move_to_end(encoding)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


class GeneticAlgorithm:
    """Deep GA over parameters made by ``init(seed)``; see the module docstring."""

    def __init__(self, config: GAConfig, population: int, seed: int, noise: NoiseSource,
                 init: Callable[[int], np.ndarray]) -> None:
        config.check_population(population)
        self.config = config
        self.population = population
        self.parents = config.parents_of(population)
        self.seed = seed
        self.noise = noise
        self.init = init
        self.cache = IndividualCache(config.cache or 2 * population)
        self._sigma = np.float32(config.sigma)

    # -- the state -------------------------------------------------------------------
    def initial_state(self) -> GAState:
        """Generation 0: one initialisation seed per individual."""
        seeds = generation_rng(self.seed, 0, INIT_STREAM).integers(0, 2**31, self.population)
        return GAState(tuple((int(s),) for s in seeds))

    def advance(self, state: GAState, generation: int, ranks: np.ndarray) -> GAState:
        """The next population after generation ``generation`` was ranked ``ranks``."""
        order = np.argsort(-np.asarray(ranks), kind="stable")  # best first
        elite = [state.population[i] for i in order[: self.config.elite]]
        fresh = self.population - len(elite)
        chosen = generation_rng(self.seed, generation, PARENT_STREAM).integers(
            0, self.parents, fresh)
        mutations = self.noise.seeds(generation_rng(self.seed, generation, NOISE_STREAM),
                                     fresh)
        children = [(*state.population[int(order[p])], int(m))
                    for p, m in zip(chosen, mutations, strict=True)]
        return GAState(tuple(elite + children), state.population[int(order[0])])

    # -- the members -----------------------------------------------------------------
    def build(self, encoding: Encoding) -> np.ndarray:
        """The parameters ``encoding`` stands for (read-only; kept in the cache)."""
        length, params = self.cache.longest_prefix(encoding)
        if length == len(encoding):
            self.cache.hits += 1
            return params
        if params is None:
            params = np.array(self.init(encoding[0]), dtype=np.float32)
            params.flags.writeable = False
            self.cache.put(encoding[:1], params)
            length = 1
        for end in range(length + 1, len(encoding) + 1):
            params = self.mutate(params, encoding[end - 1])
        self.cache.put(encoding, params)
        self.cache.built += 1
        return params

    def mutate(self, params: np.ndarray, seed: int) -> np.ndarray:
        """A child of ``params`` by the mutation of ``seed``: params + sigma ε (float32)."""
        child = np.multiply(self.noise.vector(int(seed)), self._sigma)
        child += params
        child.flags.writeable = False
        return child

    def member(self, state: GAState, generation: int, index: int, out: np.ndarray,
               seeds: np.ndarray | None = None) -> np.ndarray:
        """Member ``index``'s parameters, written into ``out``."""
        out[:] = self.build(state.population[index])
        return out

    def best(self, state: GAState, factory: Callable[[], torch.nn.Module]) -> np.ndarray:
        """The best individual of the last ranked generation (the first of generation 0
        before any)."""
        return self.build(state.best if state.best is not None else state.population[0])

    def seeds(self, generation: int) -> None:
        """Nothing to share between members: each carries its own seeds."""
        return None

    def digest(self, state: GAState) -> int:
        """A checksum of the population's encodings, compared across processes."""
        flat = np.fromiter((s for e in state.population for s in (len(e), *e)), np.int64)
        return zlib.crc32(flat.tobytes())

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self, state: GAState) -> dict[str, Any]:
        return {"population": [list(e) for e in state.population],
                "best": list(state.best) if state.best is not None else None}

    def load_state(self, values: dict[str, Any]) -> GAState:
        best = values.get("best")
        return GAState(tuple(tuple(int(s) for s in e) for e in values["population"]),
                       tuple(int(s) for s in best) if best is not None else None)
