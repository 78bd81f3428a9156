"""Gradient-free training on the cluster: OpenAI evolution strategies and a genetic
algorithm in the Deep GA encoding (``dt.evolve``, ``dt.Evolver``).

A population of perturbed copies of a model is evaluated on the workers every generation;
members travel as seeds and a generation exchanges their ranks, never parameters: every
worker process keeps its own copy of the run's state in step from those ranks.

The room: :mod:`.config` (the algorithms' settings), :mod:`.noise` (seeds to
perturbations), :mod:`.draws` (random choices by generation), :mod:`.shaping` (ranks),
:mod:`.optimizer` (the ES update's optimizers in numpy), :mod:`.openai_es` and
:mod:`.deep_ga` (the algorithms, pure), :mod:`.algorithm` (their interface), :mod:`.model`
(flat parameters), :mod:`.spec` (a run as a process sees it), :mod:`.wire` (what a
generation exchanges, byte for byte); ``worker/`` (each process's copy of the run, the Dask
task, fitness and data), ``driver/`` (the generation loop, the workers it uses, what it
places on them, checkpoints, :class:`Evolver`), ``view/`` (history and figures).
"""

from dasktrain.evolve.config import ALGORITHMS, ESConfig, GAConfig, es, ga, get_algorithm
from dasktrain.evolve.driver.evolver import Evolver
from dasktrain.evolve.errors import EvolutionError, FitnessFailed, InvalidFitness
from dasktrain.evolve.view.history import EvolutionHistory

__all__ = ["ALGORITHMS", "ESConfig", "EvolutionError", "EvolutionHistory", "Evolver",
           "FitnessFailed", "GAConfig", "InvalidFitness", "es", "ga", "get_algorithm"]
