"""A model's trainable parameters as one flat float32 vector, and models made under a seed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["ModelFactory", "flat_parameters", "initial_parameters", "load_parameters",
           "made_with_seed"]

ModelFactory = Callable[[], torch.nn.Module]


def made_with_seed(factory: ModelFactory, seed: int) -> torch.nn.Module:
    """``factory()`` with torch's generator seeded by ``seed`` (restored afterwards): the
    same initial parameters in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def flat_parameters(model: torch.nn.Module) -> np.ndarray:
    """The trainable parameters, in ``named_parameters`` order, as a new float32 vector."""
    tensors = [p.detach().reshape(-1).float() for p in model.parameters() if p.requires_grad]
    if not tensors:
        raise ValueError("the model has no trainable parameters to evolve")
    return torch.cat(tensors).numpy().copy()


def initial_parameters(factory: ModelFactory, seed: int) -> np.ndarray:
    """The flat parameters of the model ``factory`` makes under ``seed``."""
    return flat_parameters(made_with_seed(factory, seed))


def load_parameters(model: torch.nn.Module, values: np.ndarray) -> torch.nn.Module:
    """Copy flat ``values`` into the model's trainable parameters; returns the model."""
    tensors = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() for p in tensors)
    if values.shape != (size,):
        raise ValueError(f"{values.shape[0]} values for a model of {size} parameters")
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(np.array(values, np.float32)),
                                            tensors)
    return model
