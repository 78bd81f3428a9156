"""The two kinds of fitness: a reward of the model alone (control tasks, higher is better)
and a loss on batches of a dataset (supervised, lower is better).

Each says what every member of a generation is evaluated on (:meth:`inputs`: the
generation's evaluation seed, or its batches) and the value of one model on it
(:meth:`value`), checked to be one finite number.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from dasktrain.evolve.errors import InvalidFitness
from dasktrain.evolve.worker.data import BatchReader, GenerationBatches
from dasktrain.trainer.worker.compute import BatchCompute, batch_size_of

__all__ = ["FITNESS_MAX", "Fitness", "LossFitness", "RewardFitness", "RewardFunction",
           "check_value", "takes_seed"]

#: The largest magnitude of a fitness value: float32's, in which results travel.
FITNESS_MAX = float(np.finfo(np.float32).max)

RewardFunction = Callable[..., float]
"""``reward(model, seed) -> float`` (or ``reward(model)``): higher is better."""


class Fitness(Protocol):
    """What a worker evaluates members with."""

    maximize: bool
    label: str

    def inputs(self, generation: int, seed: int, reader: BatchReader | None) -> Any: ...

    def value(self, model: torch.nn.Module, inputs: Any) -> float: ...


def takes_seed(reward: Callable) -> bool:
    """Whether ``reward`` takes ``(model, seed)`` (True) or ``(model)`` (False); a
    ``TypeError`` naming the signature otherwise."""
    try:
        signature = inspect.signature(reward)
    except (TypeError, ValueError):  # a builtin without a signature: call it with both
        return True
    for arguments in ((None, 0), (None,)):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        return len(arguments) == 2
    raise TypeError(f"reward must take (model, seed) or (model); {reward!r} has the "
                    f"signature {signature}")


def check_value(raw: Any, what: str) -> float:
    """``raw`` as a float if it is one finite number within float32's range, else
    :class:`InvalidFitness` saying what it is (``what`` names the reward or the loss)."""
    value = raw
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidFitness(f"{what} returned a tensor of shape {tuple(value.shape)}; "
                                 "it must return one number")
        value = value.item()
    elif isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidFitness(f"{what} returned {type(raw).__name__} {raw!r:.80}; it must "
                             "return one number")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidFitness(f"{what} returned {value}; it must return a finite number "
                             "(a smaller sigma keeps perturbed models from diverging)")
    if abs(value) > FITNESS_MAX:
        # Fitness travels as float32 (see dasktrain.evolve.wire): beyond its range it
        # would arrive as an infinity.
        raise InvalidFitness(f"{what} returned {value:.6g}, beyond the range of float32 "
                             f"(±{FITNESS_MAX:.4g}) in which fitness travels; scale it down")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class RewardFitness:
    """``reward(model, seed)``: the same seed for every member of a generation (e.g. the
    same episodes' starting states), a new one each generation."""

    reward: RewardFunction
    with_seed: bool = True
    maximize: ClassVar[bool] = True
    label: ClassVar[str] = "reward"

    def inputs(self, generation: int, seed: int, reader: BatchReader | None) -> int:
        return seed

    def value(self, model: torch.nn.Module, inputs: int) -> float:
        raw = self.reward(model, inputs) if self.with_seed else self.reward(model)
        return check_value(raw, "the reward")


@dataclasses.dataclass(frozen=True, slots=True)
class LossFitness:
    """The mean loss (batch-size weighted) over the generation's batches."""

    compute: BatchCompute
    batches: GenerationBatches
    maximize: ClassVar[bool] = False
    label: ClassVar[str] = "loss"

    def inputs(self, generation: int, seed: int, reader: BatchReader | None) -> list[Any]:
        assert reader is not None  # made by the replica for a loss fitness
        return reader.read(generation)

    def value(self, model: torch.nn.Module, inputs: list[Any]) -> float:
        total = count = 0.0
        device = torch.device("cpu")
        for batch in inputs:
            loss, _, _ = self.compute(model, batch, device)
            rows = batch_size_of(batch)
            total += check_value(loss, "the loss") * rows
            count += rows
        return total / count
