"""The two algorithms' settings, as plain data: ``dt.evolve.es(...)`` and ``dt.evolve.ga(...)``.

A config is small and picklable: it travels to the workers once, inside a run's snapshot,
and is written into checkpoints as a dict. :func:`get_algorithm` is the one front door by
name; :data:`ALGORITHMS` maps each name to its config class.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from dasktrain.trainer.optim import OptimizerConfig, adam

__all__ = ["ALGORITHMS", "NOISE_KINDS", "AlgorithmConfig", "ESConfig", "GAConfig", "es", "ga",
           "get_algorithm"]

#: Where perturbations come from (see :mod:`dasktrain.evolve.noise`).
NOISE_KINDS = ("table", "generator")

#: Optimizers the ES update implements (element-wise, float32, the same on every process).
ES_OPTIMIZERS = ("sgd", "adam", "adamw")


def _positive(name: str, value: Any) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ESConfig:
    """OpenAI evolution strategies (Salimans et al. 2017).

    Each generation samples ``population / 2`` perturbations ε of the parameters θ and
    evaluates θ + sigma ε and θ - sigma ε (antithetic pairs); fitness is shaped into centred ranks
    in [-0.5, 0.5], and the estimated gradient of the expected fitness,
    ``Σ_k (u_k⁺ - u_k⁻) ε_k / (population sigma)``, is followed by ``optimizer``.
    """

    name: ClassVar[str] = "es"
    sigma: float = 0.05
    """Standard deviation of the perturbations."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=lambda: adam(0.01))
    """``dt.optim.sgd(...)`` (momentum, Nesterov), ``adam`` or ``adamw``, with weight decay
    and a learning-rate schedule (one step per generation); applied to the negated
    estimated gradient, so that it climbs the fitness (lowers a loss)."""

    def __post_init__(self) -> None:
        _positive("sigma", self.sigma)
        if not isinstance(self.optimizer, OptimizerConfig):
            raise TypeError(f"optimizer must come from dt.optim (sgd, adam, adamw), got "
                            f"{self.optimizer!r}")
        if self.optimizer.name not in ES_OPTIMIZERS:
            raise ValueError(f"the ES update runs {', '.join(ES_OPTIMIZERS)}; got optimizer "
                             f"{self.optimizer.name!r}")
        if self.optimizer.groups or self.optimizer.excludes_bias_and_norm \
                or self.optimizer.options:
            raise ValueError("the ES update takes one learning rate and weight decay for "
                             "all parameters: no groups, exclude_bias_and_norm or options")

    def check_population(self, population: int) -> None:
        """Refuse a population the algorithm cannot split."""
        if population % 2:
            raise ValueError(f"population must be even for ES: members come in antithetic "
                             f"pairs (θ + sigma ε, θ - sigma ε); got {population}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sigma": self.sigma,
                "optimizer": _optimizer_dict(self.optimizer)}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GAConfig:
    """A truncation-selection genetic algorithm with elitism, in the Deep GA encoding
    (Such et al. 2017).

    An individual is its list of seeds: an initialisation seed, then one mutation seed per
    generation it descends through; its parameters are the model made under the first
    seed plus sigma ε for each mutation seed. Each generation keeps the ``elite`` best
    unchanged and fills the rest with mutated copies of parents drawn uniformly from the
    ``parents`` best.
    """

    name: ClassVar[str] = "ga"
    sigma: float = 0.01
    """Mutation power: the standard deviation of one mutation."""
    parents: int | None = None
    """Truncation: how many of the best may be parents; default a fifth of the population
    (at least 2)."""
    elite: int = 1
    """Individuals carried into the next generation unchanged (and evaluated again)."""
    cache: int | None = None
    """Individuals' parameters each worker process keeps, most recently used first, to
    build children from their parent's parameters; default twice the population."""

    def __post_init__(self) -> None:
        _positive("sigma", self.sigma)
        if self.parents is not None and not (isinstance(self.parents, int)
                                             and self.parents >= 1):
            raise ValueError(f"parents must be a positive integer, got {self.parents!r}")
        if not (isinstance(self.elite, int) and self.elite >= 0):
            raise ValueError(f"elite must be an integer >= 0, got {self.elite!r}")
        if self.cache is not None and not (isinstance(self.cache, int) and self.cache >= 1):
            raise ValueError(f"cache must be a positive integer, got {self.cache!r}")

    def check_population(self, population: int) -> None:
        """Refuse truncation and elitism the population cannot hold."""
        if self.parents is not None and self.parents > population:
            raise ValueError(f"parents ({self.parents}) cannot exceed the population "
                             f"({population})")
        if self.elite >= population:
            raise ValueError(f"elite ({self.elite}) must be smaller than the population "
                             f"({population}): some members must be new each generation")

    def parents_of(self, population: int) -> int:
        """The number of parents for ``population``."""
        return self.parents if self.parents is not None else max(2, population // 5)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sigma": self.sigma, "parents": self.parents,
                "elite": self.elite, "cache": self.cache}


AlgorithmConfig = ESConfig | GAConfig

ALGORITHMS: dict[str, type[ESConfig] | type[GAConfig]] = {"es": ESConfig, "ga": GAConfig}
"""Algorithm names and their config classes."""


def es(sigma: float = 0.05, optimizer: OptimizerConfig | None = None) -> ESConfig:
    """OpenAI-ES settings: perturbation scale ``sigma`` and the ``optimizer`` of the
    estimated gradient (default ``dt.optim.adam(0.01)``); see :class:`ESConfig`."""
    return ESConfig(sigma=sigma, optimizer=optimizer if optimizer is not None else adam(0.01))


def ga(sigma: float = 0.01, parents: int | None = None, elite: int = 1,
       cache: int | None = None) -> GAConfig:
    """Deep GA settings: mutation power ``sigma``, truncation to ``parents``, ``elite``
    kept unchanged; see :class:`GAConfig`."""
    return GAConfig(sigma=sigma, parents=parents, elite=elite, cache=cache)


def get_algorithm(algorithm: str | AlgorithmConfig, **options: Any) -> AlgorithmConfig:
    """An algorithm config by name (``"es"``, ``"ga"``) with ``options``, or a config as
    it is."""
    if isinstance(algorithm, (ESConfig, GAConfig)):
        if options:
            raise ValueError("give the algorithm's options in its config, e.g. "
                             "dt.evolve.es(sigma=0.1), not beside it")
        return algorithm
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                         f"{sorted(ALGORITHMS)} or pass dt.evolve.es(...) / dt.evolve.ga(...)")
    return ALGORITHMS[algorithm](**options)


def _optimizer_dict(config: OptimizerConfig) -> dict[str, Any]:
    values = dataclasses.asdict(config)
    values["betas"] = list(values["betas"])
    return values
