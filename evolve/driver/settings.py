"""The Evolver's settings: the checks of its arguments (before any cluster work), and the
settings that define a run, as plain data (a resume must match them)."""

from __future__ import annotations

import math
from typing import Any

from dasktrain.evolve.config import NOISE_KINDS, AlgorithmConfig

__all__ = ["check_arguments", "default_members_per_task", "run_settings"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_arguments(*, reward: Any, loss: Any, population: Any, workers: Any,
                    members_per_task: Any, seed: Any, noise: Any, noise_size: Any,
                    batch_size: Any, batches: Any, timeout: Any, checkpoint_every: Any,
                    torch_threads: Any, algorithm: AlgorithmConfig) -> None:
    """Refuse bad arguments by name, with what to give instead."""
    if (reward is None) == (loss is None):
        raise ValueError("give either reward=fn(model, seed) (a control task: higher is "
                         "better) or loss=fn(output, target) (evaluated on data given to "
                         "fit: lower is better), not both or neither")
    for name, value in (("reward", reward), ("loss", loss)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a function, got {type(value).__name__}")
    checks = [
        (_is_int(population) and population >= 2,
         f"population must be an integer >= 2, got {population!r}"),
        (workers is None or (_is_int(workers) and workers >= 1),
         f"workers must be a positive integer or None (every worker), got {workers!r}"),
        (members_per_task is None or (_is_int(members_per_task) and members_per_task >= 1),
         f"members_per_task must be a positive integer, got {members_per_task!r}"),
        (_is_int(seed) and seed >= 0, f"seed must be a non-negative integer, got {seed!r}"),
        (noise in NOISE_KINDS, f"noise must be one of {NOISE_KINDS}, got {noise!r}"),
        (noise_size is None or (_is_int(noise_size) and noise_size >= 1),
         f"noise_size must be a positive integer, got {noise_size!r}"),
        (noise_size is None or noise == "table",
         "noise_size sizes a noise table; noise='generator' has none"),
        (_is_int(batch_size) and batch_size >= 1,
         f"batch_size must be a positive integer, got {batch_size!r}"),
        (_is_int(batches) and batches >= 1,
         f"batches must be a positive integer (batches per generation), got {batches!r}"),
        (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0,
         f"timeout must be a positive number of seconds, got {timeout!r}"),
        (_is_int(checkpoint_every) and checkpoint_every >= 1,
         f"checkpoint_every must be a positive integer, got {checkpoint_every!r}"),
        (_is_int(torch_threads) and torch_threads >= 0,
         f"torch_threads must be an integer >= 0, got {torch_threads!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    algorithm.check_population(population)


def default_members_per_task(algorithm: AlgorithmConfig, population: int, workers: int
                             ) -> int:
    """About four tasks per worker and generation: enough for a slow worker to take fewer
    members than a fast one, few enough that a task's fixed cost (a few ms) stays small.
    ES keeps antithetic pairs together (they share a perturbation)."""
    tasks = 4 * max(workers, 1)
    if algorithm.name == "es":
        return 2 * max(1, math.ceil(population // 2 / tasks))
    return max(1, math.ceil(population / tasks))


def run_settings(*, algorithm: AlgorithmConfig, population: int, seed: int, noise: str,
                 noise_size: int | None, parameters: int, fitness: str,
                 data: dict[str, Any] | None) -> dict[str, Any]:
    """What decides a run's generations: a resume must have the same."""
    return {"algorithm": algorithm.to_dict(), "population": population, "seed": seed,
            "noise": noise, "noise_size": noise_size, "parameters": parameters,
            "fitness": fitness, "data": data}
