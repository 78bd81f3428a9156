"""OpenAI-ES (Salimans et al. 2017) as a pure state machine: the parameters θ and the
optimizer's state, advanced one generation at a time from that generation's ranks.

Generation ``g`` evaluates ``population / 2`` antithetic pairs: member ``2k`` is
θ + sigma ε_k and member ``2k + 1`` is θ - sigma ε_k, where ε_k is the noise vector of the
pair's seed (the seeds are a pure function of the run's seed and ``g``: nobody needs to
send them). Its ranks become centred weights u in [-0.5, 0.5]; the estimated gradient of the
expected fitness is ``ĝ = Σ_k (u_2k - u_2k+1) ε_k / (population sigma)`` and the optimizer
takes one step along ``-ĝ`` (with its weight decay and learning-rate schedule).

The same :meth:`EvolutionStrategy.advance` runs on the driver and in every worker process;
its arithmetic is float32 numpy in a fixed order (the sum over pairs in pair order, then the
optimizer of :mod:`.optimizer`), so every copy of θ stays bit-identical.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dasktrain.evolve.config import ESConfig
from dasktrain.evolve.draws import NOISE_STREAM, generation_rng
from dasktrain.evolve.noise import NoiseSource
from dasktrain.evolve.optimizer import OptimizerState, initial_state, optimizer_step
from dasktrain.evolve.shaping import centered_ranks

__all__ = ["ESState", "EvolutionStrategy"]


@dataclasses.dataclass(slots=True)
class ESState:
    """θ (flat float32, the model's trainable parameters in ``named_parameters`` order)
    and the optimizer's state."""

    params: np.ndarray
    optimizer: OptimizerState

    def copy(self) -> ESState:
        return ESState(self.params.copy(), self.optimizer.copy())


class EvolutionStrategy:
    """OpenAI-ES over ``size`` parameters with ``noise``; see the module docstring."""

    def __init__(self, config: ESConfig, population: int, seed: int, noise: NoiseSource,
                 schedule_steps: int | None = None) -> None:
        config.check_population(population)
        self.config = config
        self.population = population
        self.pairs = population // 2
        self.seed = seed
        self.noise = noise
        self.schedule_steps = schedule_steps
        self._sigma = np.float32(config.sigma)

    # -- the state -------------------------------------------------------------------
    def initial_state(self, params: np.ndarray) -> ESState:
        """The state of generation 0 from the model's initial parameters."""
        params = np.array(params, dtype=np.float32)
        return ESState(params, initial_state(self.config.optimizer, params.size))

    def seeds(self, generation: int) -> np.ndarray:
        """The noise seeds of the generation's pairs."""
        return self.noise.seeds(generation_rng(self.seed, generation, NOISE_STREAM),
                                self.pairs)

    def gradient(self, generation: int, ranks: np.ndarray) -> np.ndarray:
        """The loss gradient ``-ĝ`` (float32) the optimizer follows for the generation."""
        u = centered_ranks(ranks)
        weights = u[0::2] - u[1::2]  # float32: + member minus its antithetic twin
        grad = np.zeros(self.noise.size, dtype=np.float32)
        scratch = np.empty_like(grad)
        for weight, seed in zip(weights, self.seeds(generation), strict=True):
            np.multiply(self.noise.vector(int(seed)), weight, out=scratch)
            grad += scratch
        grad *= np.float32(-1.0 / (self.population * self.config.sigma))
        return grad

    def advance(self, state: ESState, generation: int, ranks: np.ndarray) -> ESState:
        """The state after generation ``generation`` was ranked ``ranks`` (updated in
        place, and returned)."""
        optimizer = self.config.optimizer
        lr = optimizer.lr_at(state.optimizer.step, self.schedule_steps)
        optimizer_step(optimizer, state.params, self.gradient(generation, ranks),
                       state.optimizer, lr)
        return state

    # -- the members -----------------------------------------------------------------
    def member(self, state: ESState, generation: int, index: int, out: np.ndarray,
               seeds: np.ndarray | None = None) -> np.ndarray:
        """Member ``index``'s parameters, θ ± sigma ε, written into ``out``."""
        seeds = self.seeds(generation) if seeds is None else seeds
        epsilon = self.noise.vector(int(seeds[index // 2]))
        sign = self._sigma if index % 2 == 0 else -self._sigma
        np.multiply(epsilon, sign, out=out)
        out += state.params
        return out

    def best(self, state: ESState, factory: Callable[[], torch.nn.Module]) -> np.ndarray:
        """The parameters to keep: θ."""
        return state.params

    def digest(self, state: ESState) -> int:
        """A checksum of θ, compared across processes."""
        return zlib.crc32(memoryview(state.params).cast("B"))

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self, state: ESState) -> dict[str, Any]:
        return {"params": torch.from_numpy(state.params.copy()),
                "step": state.optimizer.step,
                "buffers": {k: torch.from_numpy(v.copy())
                            for k, v in state.optimizer.buffers.items()}}

    def load_state(self, values: dict[str, Any]) -> ESState:
        buffers = {k: v.numpy().astype(np.float32) for k, v in values["buffers"].items()}
        return ESState(values["params"].numpy().astype(np.float32),
                       OptimizerState(int(values["step"]), buffers))
